"""Pieces of several conversations' prompts in one forward pass, packed one after another
in one batch row.

On a CPU a prompt's pass costs about its token count, so padding pieces to the longest
would compute the padding too; packed, the rest of the model (embeddings, projections,
MLPs, the output head) runs once over just the real tokens. Each conversation keeps its
own ``H2OCache``: its stretch of the new keys and values goes into its own cache as it
would alone, and its attention runs over its own cache and its own queries, so it keeps
what it keeps alone. The caller gives each token its position (``position_ids``), since
the caches have seen different lengths.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import AttentionClient, awaiting_attention, hand_over


class _Pieces:
    """One layer's attention call for every conversation's piece: each runs as alone."""

    def __init__(self, clients: list[AttentionClient], fed: list[int], keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> None:
        self.clients, self.fed, self.keys, self.values = clients, fed, keys, values

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, None]:
        hand_over(None)
        outputs = [client.attend(row_query, keys, values, None, scaling)[0]
                   for client, row_query, keys, values
                   in zip(self.clients, query.split(self.fed, dim=2), self.keys, self.values)]
        return torch.cat(outputs, dim=1), None


class _PiecesLayer(CacheLayerMixin):
    """Layer ``index`` of every conversation's cache."""

    def __init__(self, caches: list[Cache], index: int, fed: list[int]) -> None:
        super().__init__()
        self.caches, self.index, self.fed = caches, index, fed
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the conversations' own layers initialize themselves

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        clients, keys, values = [], [], []
        for cache, new_keys, new_values in zip(self.caches, key_states.split(self.fed, dim=2),
                                               value_states.split(self.fed, dim=2)):
            row_keys, row_values = cache.update(new_keys, new_values, self.index)
            clients.append(awaiting_attention())
            keys.append(row_keys)
            values.append(row_values)
        hand_over(_Pieces(clients, self.fed, keys, values))
        # The attention call reads each conversation's own slots; these are only what the
        # model's attention module passes along.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(cache.get_seq_length(self.index) for cache in self.caches)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask the model builds is not used (each conversation attends to its own
        # slots), so ask for the smallest one.
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class PiecesCache(Cache):
    """``caches`` fed ``fed[r]`` tokens each, lying one after another in the one batch row."""

    def __init__(self, caches: list[Cache], fed: list[int]) -> None:
        if len({len(cache.layers) for cache in caches}) != 1:
            raise ValueError("the caches of one batch must belong to one model")
        super().__init__(layers=[_PiecesLayer(caches, i, fed) for i in range(len(caches[0].layers))])
