"""A chat-completions request body, checked field by field into a ``ChatRequest``.

Everything here comes from outside: each field's type and size is checked before it is
used, and a refusal names the field and what it may be. Sampling fields follow the same
rules as the config file's ``generation`` section (``h2o_chat.config``), so the API and
the page accept the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from h2o_chat.config import ConfigError, GenerationConfig, check_field, quoted
from h2o_chat.inputs import InputError, InputLimits, check_system_prompt, check_text, is_blank
from h2o_chat.inputs.text import check_chars, check_count, check_unicode

from .errors import invalid

# Bounds of what one request may carry besides the body limit and the conversation
# limits of the config (server.max_conversation_messages, ..._chars), as the page has.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_SEED = 2**63 - 1  # OpenAI's int64
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system

# Fields clients send that would change the answer's meaning if ignored: refused unless
# they ask for nothing (null, false, empty). Other unknown fields are ignored, as
# llama.cpp's and vLLM's servers do, since clients add their own (user, metadata, ...).
_UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs",
                "logit_bias", "audio", "modalities", "prediction")
# Sampling penalties (OpenAI's range): only 0, which clients send as their default.
_PENALTIES = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str
    pin: bool = False  # ours: keep this message's tokens out of eviction
    # Where the client put it in ``messages`` (None: the server's system prompt), for
    # refusals that name it; not part of what the message is.
    index: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]  # a system message first (given or the server's), last a user one
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    min_tokens: int  # end of turn not sampled before this many tokens (ignore_eos: = max_tokens)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream only: a last chunk with the usage

    @property
    def history(self) -> tuple[Message, ...]:
        """The messages before the new user message, system message first."""
        return self.messages[:-1]


def parse_chat_request(body: Any, defaults: GenerationConfig, limits: InputLimits) -> ChatRequest:
    """Check a decoded JSON body; ``defaults`` fill the sampling fields it leaves out,
    ``limits`` bound the conversation as the page's. Raises ``APIError`` (400) naming the
    first bad field."""
    if not isinstance(body, Mapping):
        raise invalid("body", f"the request body must be a JSON object, got {_json_type(body)}")
    for name in _UNSUPPORTED:
        if not _asks_nothing(name, body.get(name)):
            raise invalid(name, f"{name} is not supported by this server (plain chat only)")
    for name in _PENALTIES:
        _penalty(name, body.get(name))
    _check_response_format(body.get("response_format"))
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and len(model) <= MAX_MODEL_CHARS):
        raise invalid("model", f"model must be a string of at most {MAX_MODEL_CHARS} characters")
    n = body.get("n", 1)
    if n is not None and (type(n) is not int or n != 1):
        raise invalid("n", f"n = {quoted(n)}: must be 1 (one choice per request)")
    max_tokens, max_name = _max_tokens(body, defaults.max_new_tokens)
    ignore_eos = _bool(body, "ignore_eos", False)
    min_tokens = body.get("min_tokens")
    min_tokens = 0 if min_tokens is None else min_tokens
    if type(min_tokens) is not int or not 0 <= min_tokens <= max_tokens:
        raise invalid("min_tokens", f"min_tokens = {quoted(min_tokens)}: must be an integer from 0 to "
                                    f"{max_name} ({max_tokens})")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise invalid("stream_options", f"stream_options must be an object, got {_json_type(options)}")
    if options and not stream:  # as OpenAI's: options of a stream that is not one would go unheard
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    return ChatRequest(
        messages=_messages(body.get("messages"), defaults.system_prompt, limits),
        max_tokens=max_tokens,
        temperature=_generation(body, "temperature", defaults.temperature),
        top_p=_generation(body, "top_p", defaults.top_p),
        seed=_seed(body.get("seed", defaults.seed)),
        min_tokens=max_tokens if ignore_eos else min_tokens,
        stop=_stops(body.get("stop")),
        stream=stream,
        include_usage=stream and _bool(options, "include_usage", False, "stream_options."),
    )


def _asks_nothing(name: str, value: Any) -> bool:
    """Whether an unsupported field's value asks for nothing: null, false, empty, a tool
    choice of "none" (a 0 is not false here: its type is already wrong)."""
    return (value is None or value is False or (isinstance(value, (list, Mapping)) and not value)
            or (name in ("tool_choice", "function_call") and value == "none"))


def _penalty(name: str, value: Any) -> None:
    """A penalty is refused unless it is 0 (or absent): ignored, any other would change
    the reply without a word."""
    if value is None or (type(value) in (int, float) and value == 0):
        return
    if type(value) not in (int, float) or not -2 <= value <= 2:
        raise invalid(name, f"{name} = {quoted(value, 40)}: must be a number from -2 to 2")
    raise invalid(name, f"{name} = {quoted(value)}: only 0 is supported by this server (no penalties)")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _bool(body: Mapping, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(prefix + name, f"{prefix}{name} = {quoted(value)}: must be true or false")
    return value


def _generation(body: Mapping, name: str, default: Any, field: str | None = None) -> Any:
    """``body[name]`` (None: ``default``) under the config's rule for ``generation.<field>``,
    the message naming the API field."""
    value = body.get(name)
    if value is None:
        return default
    config_name = f"generation.{field or name}"
    try:
        return check_field(config_name, value)
    except ConfigError as err:
        raise invalid(name, str(err).replace(config_name, name, 1)) from None


def _max_tokens(body: Mapping, default: int) -> tuple[int, str]:
    """The reply's token limit, and the field it came from. Both names are checked;
    max_completion_tokens is OpenAI's newer name and wins when both come, as there."""
    given = {name: _generation(body, name, default, field="max_new_tokens")
             for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None}
    name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    return given.get(name, default), name


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= MAX_SEED:
        raise invalid("seed", f"seed = {quoted(value)}: must be an integer from 0 to {MAX_SEED}, or null")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise invalid("stop", f"stop must be a string or an array of at most {MAX_STOPS} strings")
    for index, stop in enumerate(stops):
        if not (isinstance(stop, str) and 1 <= len(stop) <= MAX_STOP_CHARS):
            raise invalid("stop", f"stop[{index}] = {quoted(stop, 40)}: must be a string of 1 to "
                                  f"{MAX_STOP_CHARS} characters")
        try:  # matched against the reply's text, which is valid Unicode
            check_unicode(stop, f"stop[{index}]")
        except InputError as err:
            raise invalid("stop", str(err)) from None
    return tuple(stops)


def _check_response_format(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise invalid("response_format", f"response_format must be an object such as "
                                         f'{{"type": "text"}}, got {_json_type(value)}')
    kind = value.get("type")
    if kind != "text":
        raise invalid("response_format", f"response_format.type = {quoted(kind, 40)}: only 'text' is "
                                         "supported")


def _messages(value: Any, default_system: str, limits: InputLimits) -> tuple[Message, ...]:
    # The count first, before any message is looked at; the reply will be one more.
    if not isinstance(value, list) or not value:
        raise invalid("messages", "messages must be a non-empty array of messages")
    try:
        check_count(len(value) + 1, limits, "messages (with the reply)")
    except InputError as err:
        raise invalid("messages", str(err)) from None
    try:
        messages = [_message(index, item, limits) for index, item in enumerate(value)]
        check_chars(sum(len(m.content) for m in messages), limits, "messages")
    except InputError as err:
        raise invalid(err.field, str(err)) from None
    for index, message in enumerate(messages[1:], start=1):
        if message.role == "system":  # as sent: system or developer
            raise invalid(f"messages[{index}].role", f"messages[{index}].role = {quoted(value[index]['role'])}: "
                                                     "a system (or developer) message may only come first")
    last = len(messages) - 1
    if messages[-1].role != "user":
        raise invalid(f"messages[{last}].role", f"messages[{last}].role = {quoted(messages[-1].role)}: "
                                                "the last message must be the user's")
    if is_blank(messages[-1].content):  # caught here, before a stream's first event goes out
        raise invalid(f"messages[{last}].content", f"messages[{last}].content is empty: the user "
                                                   "message needs some text")
    if messages[0].role != "system" and default_system:
        # The server's system prompt, as the page uses: pinned, the same for every client.
        messages.insert(0, Message("system", default_system))
    return tuple(messages)


def _message(index: int, item: Any, limits: InputLimits) -> Message:
    where = f"messages[{index}]"
    if not isinstance(item, Mapping):
        raise invalid(where, f"{where} must be an object with role and content, got {_json_type(item)}")
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"{where}.role = {quoted(role, 40)}: must be one of "
                                       + ", ".join(ROLES))
    role = "system" if role == "developer" else role
    content = _content(f"{where}.content", item.get("content"))
    if role == "system":  # pinned, hence a limit of its own
        check_system_prompt(content, limits, f"{where}.content")
    else:
        check_text(content, f"{where}.content", limits.message_chars, limits.setting("message_chars"))
    pin = _bool(item, "pin", False, f"{where}.")
    if pin and is_blank(content):  # caught here, before a stream's first event goes out
        raise invalid(f"{where}.pin", f"{where}.pin: nothing to pin: the text is empty")
    return Message(role, content, pin, index)


def _content(where: str, value: Any) -> str:
    """A message's text: a string, or an array of text parts (joined by newlines)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(where, f"{where} must be a string or an array of text parts, got {_json_type(value)}")
    texts = []
    for index, part in enumerate(value):
        field = f"{where}[{index}]"
        if not (isinstance(part, Mapping) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, Mapping) else part
            raise invalid(field, f"{field}.type = {quoted(kind, 40)}: only text "
                                 'parts ({"type": "text", "text": ...}) are supported')
        if not isinstance(part.get("text"), str):
            raise invalid(f"{field}.text", f"{field}.text must be a string, got {_json_type(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)

