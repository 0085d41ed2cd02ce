"""Several conversations' caches as the rows of one batch, for one forward pass: a decode
step (a token each) or pieces of several prompts (packed one after another in one batch
row).

Each conversation keeps its own ``H2OCache`` (its scores, evictions, pins, positions,
policy, rolling and budget), so nothing is copied in or out of a batch: row r's new
token goes into ``caches[r]`` as it would alone, and the attention function serves each
row from that row's own layer (``attention.Rows``). What runs batched is the rest of the
model (embeddings, projections, MLPs, norms, the output head), which is where a small
batch gains: their weights are read once per step for every row. The caller gives each
row its positions (``position_ids``), since the caches have seen different lengths.

Rows that are a ``RowPool``'s take their tokens in one write per buffer for all rows
(``append_rows``), the same slots each would have written alone, and are read and scored
where they lie.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import Rows, awaiting_attention, hand_over
from .cache import append_rows
from .pool import RowPool


class _InPool:
    """The batch's caches as rows ``0..n-1`` of ``pool``: true of every layer of them from
    the step's start (``RowPool.rows_of``) until some row's layer takes its token on its
    own (which may move it out, e.g. into bigger buffers of its own)."""

    def __init__(self, pool: RowPool, rows: int) -> None:
        self.pool, self.rows, self.intact = pool, rows, True

    def buffers(self, layer: int) -> dict[str, torch.Tensor]:
        """Buffers of ``layer`` for the batch's rows, by name."""
        return {name: self.pool.rows(name, layer, self.rows) for name in self.pool.buffers}


class _RowsLayer(CacheLayerMixin):
    """Layer ``index`` of every row's cache."""

    def __init__(self, caches: list[Cache], index: int, batched: bool, in_pool: _InPool | None,
                 fed: list[int] | None) -> None:
        super().__init__()
        self.caches, self.index, self.batched, self.in_pool, self.fed = caches, index, batched, in_pool, fed
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the rows' own layers initialize themselves

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._pooled_update(key_states, value_states)
        hand_over(rows if rows is not None else self._rows_update(key_states, value_states))
        # The attention function reads each row's own slots from ``Rows``; these are
        # only what the model's attention module passes along.
        return key_states, value_states

    def _rows_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> Rows:
        """Each row's cache takes its new token as it would alone; attention reads the
        rows where they lie if they are still the pool's rows and read as stored."""
        clients, keys, values = [], [], []
        for cache, new_keys, new_values in zip(self.caches, self._by_row(key_states), self._by_row(value_states)):
            row_keys, row_values = cache.update(new_keys, new_values, self.index)
            clients.append(awaiting_attention())
            keys.append(row_keys)
            values.append(row_values)
        held = [row_keys.shape[2] for row_keys in keys]
        if self.in_pool is None:
            return Rows(clients, held, keys, values, self.batched, fed=self.fed)
        self.in_pool.intact = False
        pooled = self.in_pool.buffers(self.index)
        if all(_lies_in(k, pooled["keys"][r]) and _lies_in(v, pooled["values"][r])
               for r, (k, v) in enumerate(zip(keys, values))):
            keys, values = pooled["keys"][:, :, : max(held)], pooled["values"][:, :, : max(held)]
        return Rows(clients, held, keys, values, self.batched)

    def _by_row(self, states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each row's new ``(1, kv_heads, tokens, head_dim)`` of the batch's ``states``."""
        return states.split(1) if self.fed is None else states.split(self.fed, dim=2)

    def _pooled_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> Rows | None:
        """Where the rows are the pool's (each layer's buffers a row of the pool's), every
        row takes its new token in one write per buffer (``append_rows``) and attention
        reads the rows where they lie, scoring them in one addition where their policies
        simply add; else None, with nothing done."""
        if self.in_pool is None or not self.in_pool.intact:
            return None
        buffers = self.in_pool.buffers(self.index)
        layers = [cache.layers[self.index] for cache in self.caches]
        if not append_rows(layers, buffers, key_states, value_states):
            return None
        held = [layer.held for layer in layers]
        longest = max(held)
        scores = buffers["scores"][:, :, :longest] if all(layer.sums_probabilities for layer in layers) else None
        return Rows(layers, held, buffers["keys"][:, :, :longest], buffers["values"][:, :, :longest],
                    self.batched, scores)

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
    """``caches`` as the rows of one batch; ``batched``: their attention runs as one call
    over padded rows (else one call per row); ``pool``: one whose rows ``0..n-1`` are
    ``caches``, in order. Each row feeds one token (a decode step, batch row r), unless
    ``fed`` says how many each feeds: then the rows' tokens lie one after another in the
    one batch row (pieces of prompts, whose attention runs row by row)."""

    def __init__(self, caches: list[Cache], batched: bool = True, pool: RowPool | None = None,
                 fed: list[int] | None = None) -> None:
        if len({len(cache.layers) for cache in caches}) != 1:
            raise ValueError("the caches of one batch must belong to one model")
        if fed is not None and (batched or pool is not None):
            raise ValueError("rows feeding several tokens are attended row by row, in their own buffers")
        in_pool = _InPool(pool, len(caches)) if pool is not None and batched else None
        super().__init__(layers=[_RowsLayer(caches, i, batched, in_pool, fed) for i in range(len(caches[0].layers))])
