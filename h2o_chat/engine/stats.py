"""What a cache reports about itself (``H2OCache.stats``): plain data for the UI, the API
and the tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    held: int
    # (batch, kv_heads, held) absolute positions of the kept tokens, ascending per head.
    positions: torch.Tensor


@dataclass
class CacheStats:
    policy: dict[str, int | str]
    seen: int
    held: int
    pinned: int
    budget: int | None  # slots held at rest once over budget (policy capacity + pinned)
    # Bytes of the cache's buffers (keys, values, scores, positions, flags), read off the
    # tensors: allocated includes room reserved for incoming tokens, held only slots in use.
    kv_bytes: int
    held_bytes: int
    layers: list[LayerStats]
    # Storage bits of keys and values (the model's dtype's where not set; None before the
    # first token), and the budget in bytes where the cache has one.
    key_bits: int | None = None
    value_bits: int | None = None
    budget_bytes: int | None = None
    # Newest tokens also held as the model gave them beside quantized slots (0: none).
    exact_window: int = 0
    # Where each turn begins, for a cache that keeps scores to their turn (else empty).
    turn_starts: list[int] = field(default_factory=list)

    @property
    def budget_reached(self) -> bool:
        return self.budget is not None and self.held >= self.budget
