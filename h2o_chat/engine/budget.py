"""A cache budget in bytes: how many slots a conversation's bytes buy, and how a policy
splits them.

One slot is one token of one layer and KV head: its key and value at the storage's
precision (scales included) and its bookkeeping (score, position, flags). A token held
in every layer and KV head costs ``slot_bytes`` of them all; a budget of ``bytes`` holds
``bytes // slot_bytes`` tokens, pinned ones included, after the exact window's rings
(``window.py``), whose bytes do not depend on the tokens held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .quant import KVStorage
from .slots import ROLLING_METADATA, SLOT_METADATA


def cache_geometry(model: torch.nn.Module) -> tuple[int, int]:
    """Slots one token takes (layers x KV heads) and the length of one slot's key."""
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * kv_heads, head_dim


def token_bytes(model: torch.nn.Module, storage: KVStorage, rolling: bool) -> int:
    """Bytes one token takes in every layer and KV head of ``model``'s cache."""
    slots, head_dim = cache_geometry(model)
    metadata = SLOT_METADATA | (ROLLING_METADATA if rolling else {})
    return slots * (storage.slot_bytes(head_dim, model.dtype) + sum(dtype.itemsize for dtype in metadata.values()))


def window_bytes(model: torch.nn.Module, storage: KVStorage) -> int:
    """Bytes the exact window's rings take in every layer and KV head of ``model``'s cache."""
    slots, head_dim = cache_geometry(model)
    return slots * storage.window_bytes(head_dim, model.dtype)


@dataclass(frozen=True)
class ByteBudget:
    """``bytes`` per conversation at ``token_bytes`` a token, ``window_bytes`` of them
    taken by the exact window first; ``settings`` is the policy's description before any
    pins (a cache's saved settings must not move with its pins)."""

    bytes: int
    token_bytes: int
    settings: dict = field(default_factory=dict)
    window_bytes: int = 0

    @property
    def slots(self) -> int:
        """Tokens the budget holds, pinned ones included."""
        return max(0, self.bytes - self.window_bytes) // self.token_bytes

    def bytes_for(self, tokens: int) -> int:
        """The fewest bytes that hold ``tokens`` tokens."""
        return self.window_bytes + tokens * self.token_bytes


# Of a turn-aware cache's slots after the sink, the share its recent window takes: the turn
# being read and answered keeps its slots by the scores it still collects (closed turns'
# are final), so the window only has to cover the newest tokens, and the rest goes to the
# heavy hitters of every turn (the long-chat benchmark measured 1/2, 1/8, 1/16, 1/32).
TURNS_RECENT_SHARE = 16


def split_slots(policy: str, slots: int, sink: int) -> dict[str, int]:
    """The budgets of ``policy`` that fill ``slots``: after the sink, h2o gives heavy and
    recent equal halves (the paper's split), turns a sixteenth to the recent window and
    the rest to heavy hitters, sink and recent keep only a window."""
    if policy in ("h2o", "turns"):
        recent = max(1, (slots - sink) // (2 if policy == "h2o" else TURNS_RECENT_SHARE))
        return {"sink": sink, "recent": recent, "heavy": slots - sink - recent}
    if policy == "sink":
        return {"sink": sink, "recent": slots - sink}
    return {"recent": slots}
