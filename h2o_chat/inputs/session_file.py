"""Checks on a session file's contents against each other, the model, the cache and the
limits, made before the cache allocates anything for it.

A session file is trusted for nothing: the counters in ``manifest.json`` decide how
much memory resuming takes (a layer's ``size`` is the room its buffers reserve), and
the token list decides how much the next send feeds. The tensors are already in memory
(as big as the upload); what these checks bound is everything after that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..config import quoted
from .documents import require_int
from .limits import InputError, InputLimits

MANIFEST = "manifest.json"
TENSORS = "cache.safetensors"
# Template text around one message, in tokens (role markers, end of turn): the slack a
# message's unfed tokens get over its text.
_TEMPLATE_TOKENS = 64
_MAX_BYTES_PER_CHAR = 4  # UTF-8; every token decodes to at least one byte


def max_unfed_tokens(limits: InputLimits) -> int:
    """The most tokens a session within ``limits`` leaves unfed once its cache has read
    anything: one message (template included), or a system prompt or bible not yet read."""
    return _MAX_BYTES_PER_CHAR * max(limits.message_chars, limits.system_prompt_chars) + _TEMPLATE_TOKENS


def max_story_tokens(limits: InputLimits) -> int:
    return _MAX_BYTES_PER_CHAR * limits.conversation_chars


def check_tokens(tokens: Any, fed: Any, vocab: int, most: int, limits: InputLimits,
                 history: bool) -> tuple[list[int], int]:
    """The conversation's token ids and how many of them the cache has seen, checked on
    the tensor (count, range) before it becomes a Python list of ``len`` ints.

    ``most`` bounds the count (from the conversation's text). The tokens past ``fed``
    are fed on the next send, like a message, so they obey the message limit; only a
    chat (``history``) whose cache has read nothing yet, started on a history, has
    more: its whole conversation, within ``most``.
    """
    field = f"{TENSORS}: tokens"
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
        raise InputError(f"{field} must be a 1-D tensor of int32 or int64 token ids", field)
    count = require_int(tokens.numel(), f"{field} (count)", 0, most, "what the conversation's text can take")
    fed = require_int(fed, f"{MANIFEST}: fed", 0, count, "the tokens in the file")
    if fed or not history:
        require_int(count - fed, f"{field} past fed (unfed)", 0, max_unfed_tokens(limits),
                    "unfed tokens are read on the next send, like a message: "
                    f"{limits.setting('message_chars')}")
    if count and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab):
        raise InputError(f"{field}: ids must be from 0 to {vocab - 1} (the model's vocabulary)", field)
    return tokens.tolist(), fed


def check_cache_state(state: Any, tensors: Mapping[str, torch.Tensor], fed: int, tokens: int,
                      cache: Any, model: Any, prefill_chunk_size: int) -> None:
    """The manifest's ``cache`` section and the tensors, against each other, the model's
    shapes and ``cache``'s budget (its settings were checked already), so that loading
    the state allocates at most what the cache would hold anyway."""
    where = f"{MANIFEST}: cache"
    if not isinstance(state, Mapping):
        raise InputError(f"{where} must be an object", where)
    layers = state.get("layers")
    if not isinstance(layers, Sequence) or len(layers) != len(cache.layers):
        raise InputError(f"{where}.layers must list the model's {len(cache.layers)} layers", f"{where}.layers")
    protected = _protected_tokens(state.get("protected"), tokens, f"{where}.protected")
    pinned = int(protected.sum())
    if cache.policy.marks_turns:
        _check_turns(state.get("turns"), tokens, fed, f"{where}.turns")
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    capacity = cache.policy.capacity
    for index, info in enumerate(layers):
        field = f"{where}.layers[{index}]"
        if not isinstance(info, Mapping):
            raise InputError(f"{field} must be an object", field)
        if info.get("initialized") is not True:
            continue  # an empty layer: the cache's own check refuses any tokens in it
        require_int(info.get("seen"), f"{field}.seen", fed, fed, "fed: every layer saw every fed token")
        most = fed if capacity is None else min(fed, capacity + pinned)
        held = require_int(info.get("held"), f"{field}.held", 0, most,
                           "the tokens fed" if capacity is None else "the budget plus the pinned tokens")
        # Buffers reserve room for the next tokens: a cache grows them by doubling up to
        # its budget plus one prefill chunk, never further.
        require_int(info.get("size"), f"{field}.size", held, held + max(held, prefill_chunk_size),
                    "held slots plus room for one prefill chunk or a doubling")
        stored = cache.storage.layout(head_dim, model.dtype)
        _check_layer_tensors(tensors, index, (1, heads, held), stored, model.dtype, fed, capacity, pinned)
        _check_pins_held(tensors, index, (1, heads, held), protected[:fed], f"{where}.protected")
        # The exact window's rings: as long as the window, whatever the slots held.
        window = cache.storage.window_layout(head_dim, model.dtype)
        _check_stored(tensors, index, (1, heads, cache.storage.exact_window), window, model.dtype)


def _check_turns(turns: Any, tokens: int, fed: int, field: str) -> None:
    """Where a turn-aware cache's turns begin (increasing, within the tokens) and the
    open turn's start (0 or one of them, among the tokens fed)."""
    if not isinstance(turns, Mapping) or set(turns) != {"starts", "opened"}:
        raise InputError(f"{field} must be an object with starts and opened (this cache keeps turns)", field)
    starts = turns["starts"]
    if not isinstance(starts, Sequence) or len(starts) > tokens:
        raise InputError(f"{field}.starts must be a list of at most {tokens} positions", f"{field}.starts")
    last = -1
    for index, start in enumerate(starts):
        last = require_int(start, f"{field}.starts[{index}]", last + 1, tokens - 1, "after the one before, "
                           "within the tokens")
    opened = require_int(turns["opened"], f"{field}.opened", 0, fed, "the tokens fed")
    if opened and opened not in starts:
        raise InputError(f"{field}.opened = {opened}: must be 0 or one of the turn starts", f"{field}.opened")


def _protected_tokens(spans: Any, tokens: int, field: str) -> torch.Tensor:
    """Which tokens the protected ``spans`` cover (a bool per token; spans may overlap),
    the spans checked to lie within the tokens."""
    if not isinstance(spans, Sequence) or len(spans) > tokens:
        raise InputError(f"{field} must be a list of at most {tokens} [start, end] spans", field)
    checked = []
    for index, span in enumerate(spans):
        if not isinstance(span, Sequence) or len(span) != 2:
            raise InputError(f"{field}[{index}] = {quoted(span)}: must be [start, end]", f"{field}[{index}]")
        start = require_int(span[0], f"{field}[{index}][0]", 0, tokens - 1, "the tokens in the file")
        checked.append((start, require_int(span[1], f"{field}[{index}][1]", start + 1, tokens,
                                           "after start, within the tokens")))
    # Each span adds one where it starts and takes it back where it ends: a token is covered
    # where the running sum is positive. One pass, whatever the number of spans.
    edges = torch.zeros(tokens + 1, dtype=torch.int64)
    if checked:
        starts, ends = torch.tensor(checked, dtype=torch.int64).unbind(-1)
        edges.index_add_(0, starts, torch.ones_like(starts))
        edges.index_add_(0, ends, -torch.ones_like(ends))
    return edges.cumsum(0)[:tokens] > 0


def _check_pins_held(tensors: Mapping[str, torch.Tensor], index: int, slots: tuple[int, ...],
                     protected: torch.Tensor, field: str) -> None:
    """Layer ``index`` marks as pinned exactly the slots of protected tokens, and holds
    every protected token read (``protected``: a bool per token fed) in each KV head. A
    pinned token is never evicted, so a span over evicted tokens would pin nothing, yet
    count as pinned and widen the budget by its length."""
    prefix = f"{TENSORS}: layers.{index}"
    named = {name: tensors.get(f"layers.{index}.{name}") for name in ("positions", "pinned", "valid")}
    if any(t is None or tuple(t.shape) != slots for t in named.values()):
        return  # the cache's own check names what is missing or misshapen
    positions, flags, valid = named["positions"], named["pinned"], named["valid"]
    if positions.is_floating_point() or flags.dtype != torch.bool or valid.dtype != torch.bool:
        return  # likewise
    pinned = flags & valid  # padding slots hold no token
    positions = positions.long()  # within the tokens fed: checked before
    if bool((pinned & ~protected[positions]).any()):
        raise InputError(f"{prefix}.pinned marks a slot whose token no protected span covers",
                         f"{prefix}.pinned")
    held = torch.zeros((*slots[:2], protected.numel()), dtype=torch.int64)
    held.scatter_add_(-1, positions, pinned.long())
    missing = (protected & (held == 0)).nonzero()
    if missing.numel():
        head, token = int(missing[0, 1]), int(missing[0, 2])
        raise InputError(f"{field} covers token {token}, which layer {index} does not hold as pinned in "
                         f"KV head {head}: a session holds every pinned token it has read (evicted text "
                         "cannot be pinned)", field)


def _check_layer_tensors(tensors: Mapping[str, torch.Tensor], index: int, slots: tuple[int, ...],
                         stored: Mapping[str, tuple[torch.dtype, int]], model_dtype: torch.dtype, fed: int,
                         capacity: int | None, pinned: int) -> None:
    """Layer ``index``'s stored keys and values (``stored``: each buffer's dtype and last
    dimension, scales of quantized slots included) over ``slots`` ``(batch, heads,
    held)``, all finite; positions among the tokens fed; no more pinned slots than
    pinned tokens."""
    prefix = f"{TENSORS}: layers.{index}"
    _check_stored(tensors, index, slots, stored, model_dtype)
    scores = tensors.get(f"layers.{index}.scores")
    if scores is not None and scores.is_floating_point() and not bool(torch.isfinite(scores).all()):
        raise InputError(f"{prefix}.scores holds NaN or infinite values", f"{prefix}.scores")
    positions = tensors.get(f"layers.{index}.positions")
    if positions is not None and positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < fed:
        raise InputError(f"{prefix}.positions must be from 0 to {fed - 1} (the tokens fed)", f"{prefix}.positions")
    flags = tensors.get(f"layers.{index}.pinned")
    if flags is not None and flags.dtype == torch.bool and flags.dim() == 3:
        most = int(flags.sum(-1).max()) if flags.numel() else 0
        if most > pinned or (capacity is not None and slots[2] - most > capacity):
            raise InputError(f"{prefix}.pinned marks {most} slots: must be at most the {pinned} protected "
                             "tokens, with the rest within the budget", f"{prefix}.pinned")


def _check_stored(tensors: Mapping[str, torch.Tensor], index: int, lead: tuple[int, ...],
                  stored: Mapping[str, tuple[torch.dtype, int]], model_dtype: torch.dtype) -> None:
    """Layer ``index``'s tensors named in ``stored`` (each one's dtype and last dimension)
    of shape ``lead`` plus that dimension, all finite."""
    prefix = f"{TENSORS}: layers.{index}"
    for name, (dtype, last) in stored.items():
        tensor = tensors.get(f"layers.{index}.{name}")
        if tensor is None:
            continue  # the cache's own check names what is missing
        shape = (*lead, last)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            whose = "the model's are" if dtype == model_dtype else "this cache's precision stores"
            raise InputError(f"{prefix}.{name} is {tensor.dtype} {tuple(tensor.shape)}; {whose} "
                             f"{dtype} {shape}", f"{prefix}.{name}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InputError(f"{prefix}.{name} holds NaN or infinite values", f"{prefix}.{name}")


def check_template_text(text: str, messages: list[dict[str, str]], tokenizer: Any) -> None:
    """A chat's ``template_text`` must be how the chat template renders its messages
    (up to a reply cut short): it is what the next turn appends to."""
    after = tokenizer.apply_chat_template(messages + [{"role": "user", "content": ""}], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(text):
        raise InputError(f"{MANIFEST}: template_text is not the chat template's rendering of the "
                         "messages", f"{MANIFEST}: template_text")
