"""Checks on text from outside: messages, system prompts, bibles, whole conversations."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence

from ..config import quoted
from .limits import InputError, InputLimits


# A lone surrogate has no UTF-8 form: the tokenizer would fail on it mid-turn.
_SURROGATE = re.compile("[\ud800-\udfff]")


def is_blank(text: str) -> bool:
    """True if ``text`` shows nothing: only spaces and invisible format characters (zero-
    width spaces and joiners, direction marks, byte-order marks), which ``str.strip``
    keeps."""
    return all(char.isspace() or unicodedata.category(char) == "Cf" for char in text)


def check_text(text: object, what: str, limit: int, setting: str) -> str:
    """``text`` if it is a string of at most ``limit`` characters (``setting`` is the
    config field the limit comes from) that a tokenizer can take; else InputError."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, got {type(text).__name__}", what)
    if len(text) > limit:
        raise InputError(f"{what} is {len(text):,} characters long; the limit is {limit:,} ({setting})", what)
    return check_unicode(text, what)


def check_unicode(text: str, what: str) -> str:
    """``text`` if it is valid Unicode a tokenizer can take; else InputError."""
    if bad := _SURROGATE.search(text):
        raise InputError(f"{what} contains an unpaired surrogate (U+{ord(bad.group()):04X}) at "
                         f"character {bad.start()}: not valid Unicode text", what)
    return text


def check_system_prompt(text: object, limits: InputLimits, what: str = "the system prompt") -> str:
    """A chat's system prompt or a story's bible (pinned, hence a limit of its own)."""
    return check_text(text, what, limits.system_prompt_chars, limits.setting("system_prompt_chars"))


def check_message(index: int, message: object, limits: InputLimits, where: str = "history") -> dict[str, str]:
    """Message ``index`` of a conversation: a user or assistant message, as a plain dict."""
    field = f"{where}[{index}]"
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise InputError(f"{field} = {_short(message)}: must be a user or assistant message "
                         "with string content", field)
    content = check_text(message.get("content"), f"{field}.content", limits.message_chars,
                         limits.setting("message_chars"))
    return {"role": message["role"], "content": content}


def check_conversation(system_prompt: object, messages: object, limits: InputLimits,
                       where: str = "history") -> tuple[str | None, list[dict[str, str]]]:
    """A system prompt (or None) and user/assistant ``messages`` as a chat starts from
    them; the count is checked before any message is looked at."""
    if system_prompt is not None:
        check_system_prompt(system_prompt, limits)
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InputError(f"{where} = {_short(messages)}: must be a list of messages", where)
    check_count(len(messages), limits, where)
    checked = [check_message(index, message, limits, where) for index, message in enumerate(messages)]
    chars = len(system_prompt or "") + sum(len(m["content"]) for m in checked)
    check_chars(chars, limits, where)
    return system_prompt, checked


def check_count(messages: int, limits: InputLimits, what: str) -> None:
    if messages > limits.conversation_messages:
        raise InputError(f"{what} holds {messages:,} messages; the limit is "
                         f"{limits.conversation_messages:,} ({limits.setting('conversation_messages')})",
                         what)


def check_chars(chars: int, limits: InputLimits, what: str) -> None:
    if chars > limits.conversation_chars:
        raise InputError(f"{what} holds {chars:,} characters; the limit is {limits.conversation_chars:,} "
                         f"({limits.setting('conversation_chars')})", what)


def check_chat_turn(text: object, messages: Sequence[Mapping[str, str]], limits: InputLimits) -> str:
    """A typed chat message, and room for it and its reply in the conversation
    ``messages`` (system prompt included)."""
    text = check_text(text, "the message", limits.message_chars, limits.setting("message_chars"))
    turns = sum(m["role"] != "system" for m in messages)
    check_count(turns + 2, limits, "the conversation with this message and its reply")
    check_chars(sum(len(m["content"]) for m in messages) + len(text), limits,
                "the conversation with this message")
    return text


def check_story_turn(text: object, story_chars: int, limits: InputLimits) -> str:
    """Text to add to a story of ``story_chars`` characters (bible included)."""
    text = check_text(text, "the new story text", limits.message_chars, limits.setting("message_chars"))
    check_chars(story_chars + len(text), limits, "the story with this text")
    return text


def _short(value: object) -> str:
    """``value``'s repr, short enough for a message about a huge input."""
    if isinstance(value, (list, tuple, dict)) and len(value) >= 8:
        return f"<{type(value).__name__} of {len(value):,} items>"
    return quoted(value, 60)
