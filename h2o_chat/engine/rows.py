"""Several conversations' caches as the rows of one batch, for one decode step.

Each conversation keeps its own ``H2OCache`` (its scores, evictions, pins, positions,
policy, rolling and budget), so nothing is copied in or out of a batch: row r's new
token goes into ``caches[r]`` as it would alone, and the attention function serves each
row from that row's own layer (``attention.Rows``). What runs batched is the rest of the
model (embeddings, projections, MLPs, norms, the output head), which is where a small
batch gains: their weights are read once per step for every row. The caller gives each
row its position (``position_ids``), since the caches have seen different lengths.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import Rows, awaiting_attention, hand_over
from .pool import RowPool


class _RowsLayer(CacheLayerMixin):
    """Layer ``index`` of every row's cache."""

    def __init__(self, caches: list[Cache], index: int, batched: bool, pool: RowPool | None) -> None:
        super().__init__()
        self.caches, self.index, self.batched, self.pool = caches, index, batched, pool
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the rows' own layers initialize themselves

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for row, cache in enumerate(self.caches):
            keys, values = cache.update(key_states[row : row + 1], value_states[row : row + 1], self.index)
            rows.append((awaiting_attention(), keys, values))
        hand_over(Rows(rows, self.batched, self._pooled(rows)))
        # The attention function reads each row's own slots from ``Rows``; these are
        # only what the model's attention module passes along.
        return key_states, value_states

    def _pooled(self, rows: list[tuple]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row's keys and values as they lie in the pool, ``(rows, kv_heads, longest
        held, head_dim)``, where attention reads exactly those (stored as the model gives
        them: quantized slots are read dequantized); else None."""
        if self.pool is None:
            return None
        keys, values = (self.pool.rows(name, self.index, len(rows)) for name in ("keys", "values"))
        for row, (_, row_keys, row_values) in enumerate(rows):
            if not (_lies_in(row_keys, keys[row]) and _lies_in(row_values, values[row])):
                return None
        longest = max(row_keys.shape[2] for _, row_keys, _ in rows)
        return keys[:, :, :longest], values[:, :, :longest]

    def get_seq_length(self) -> int:
        return max(cache.get_seq_length(self.index) for cache in self.caches)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask the model builds is not used (each row attends to its own slots), so
        # ask for the smallest one.
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


def _lies_in(held: torch.Tensor, row: torch.Tensor) -> bool:
    """Whether ``held`` ``(1, kv_heads, held, dim)`` is the first slots of a pool row's
    ``(kv_heads, size, dim)``."""
    return held.data_ptr() == row.data_ptr() and held.dtype == row.dtype and held.stride()[1:] == row.stride()


class RowsCache(Cache):
    """``caches`` as the rows of one batch of single-token decode steps; ``batched``:
    their attention runs as one call over padded rows (else one call per row); ``pool``:
    one whose rows ``0..n-1`` are ``caches``, in order."""

    def __init__(self, caches: list[Cache], batched: bool = True, pool: RowPool | None = None) -> None:
        if len({len(cache.layers) for cache in caches}) != 1:
            raise ValueError("the caches of one batch must belong to one model")
        super().__init__(layers=[_RowsLayer(caches, i, batched, pool) for i in range(len(caches[0].layers))])
