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


class _RowsLayer(CacheLayerMixin):
    """Layer ``index`` of every row's cache."""

    def __init__(self, caches: list[Cache], index: int, batched: bool) -> None:
        super().__init__()
        self.caches, self.index, self.batched = caches, index, batched
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the rows' own layers initialize themselves

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for row, cache in enumerate(self.caches):
            keys, values = cache.update(key_states[row : row + 1], value_states[row : row + 1], self.index)
            rows.append((awaiting_attention(), keys, values))
        hand_over(Rows(rows, self.batched))
        # The attention function reads each row's own slots from ``Rows``; these are
        # only what the model's attention module passes along.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(cache.get_seq_length(self.index) for cache in self.caches)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask the model builds is not used (each row attends to its own slots), so
        # ask for the smallest one.
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class RowsCache(Cache):
    """``caches`` as the rows of one batch of single-token decode steps; ``batched``:
    their attention runs as one call over padded rows (else one call per row)."""

    def __init__(self, caches: list[Cache], batched: bool = True) -> None:
        if len({len(cache.layers) for cache in caches}) != 1:
            raise ValueError("the caches of one batch must belong to one model")
        super().__init__(layers=[_RowsLayer(caches, i, batched) for i in range(len(caches[0].layers))])
