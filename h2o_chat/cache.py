"""A bounded KV cache for stock transformers models: one ``H2OLayer`` per decoder layer.

Data path per attention call: the model calls ``H2OCache.update`` -> ``H2OLayer.update``
appends the new keys/values (score 0) and marks itself as the layer awaiting attention in
this thread -> the registered attention function (``attention.py``) computes the softmax
probabilities and calls ``H2OLayer.after_attention`` with the mass each slot received ->
the layer adds it to the accumulated scores and evicts down to budget.

Every layer holds its slots in temporal order, per batch row and KV head, with their
absolute positions, so stats and tests can say exactly which tokens are kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .policies import EvictionPolicy, make_policy

_awaiting = threading.local()


def layer_awaiting_attention() -> H2OLayer | None:
    """The layer whose ``update`` ran last in this thread and awaits its probabilities.

    Thread-local rather than stored on the model, so sessions decoding in two threads
    with one shared model never touch each other's cache.
    """
    return getattr(_awaiting, "layer", None)


class ProtectedSpans:
    """Half-open ranges of absolute token positions that are never evicted."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def contains(self, positions: torch.Tensor) -> torch.Tensor:
        inside = torch.zeros_like(positions, dtype=torch.bool)
        for start, end in self.ranges:
            inside |= (positions >= start) & (positions < end)
        return inside


class H2OLayer(CacheLayerMixin):
    """One layer's slots: keys, values, accumulated scores, absolute positions and flags.

    Shapes: keys/values ``(batch, kv_heads, slots, head_dim)``; scores (float32),
    positions, ``valid`` (False for padding) and ``pinned`` ``(batch, kv_heads, slots)``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False  # evicted slots cannot be brought back

    def __init__(self, policy: EvictionPolicy, spans: ProtectedSpans) -> None:
        super().__init__()
        self.policy = policy
        self.spans = spans
        self.seen = 0
        self.scores: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.pinned: torch.Tensor | None = None
        self.has_padding = False  # lets unpadded decoding skip building a mask

    # ---- transformers' layer interface -------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_empty((batch, heads, 0, key_states.shape[-1]))
        self.values = value_states.new_empty((batch, heads, 0, value_states.shape[-1]))
        slots = (batch, heads, 0)
        self.scores = torch.zeros(slots, dtype=torch.float32, device=self.device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.valid = torch.ones(slots, dtype=torch.bool, device=self.device)
        self.pinned = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif layer_awaiting_attention() is self:
            # The previous call never reached our attention function (an exception in
            # between); evict now so the cache stays bounded regardless.
            self.after_attention(None)
        batch, heads, new = key_states.shape[:3]
        positions = torch.arange(self.seen, self.seen + new, device=self.device)
        positions = positions.expand(batch, heads, new)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.scores = torch.cat([self.scores, self.scores.new_zeros((batch, heads, new))], dim=-1)
        self.positions = torch.cat([self.positions, positions], dim=-1)
        self.valid = torch.cat([self.valid, self.valid.new_ones((batch, heads, new))], dim=-1)
        self.pinned = torch.cat([self.pinned, self.spans.contains(positions)], dim=-1)
        self.seen += new
        _awaiting.layer = self
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # Tokens seen, not slots held: generate and the model derive positions from it.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.held
        return held + query_length, self.seen - held

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.scores = self.positions = self.valid = self.pinned = None
        self.is_initialized = False
        self.has_padding = False
        self.seen = 0
        if layer_awaiting_attention() is self:
            _awaiting.layer = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (crop)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices, ...])

    # ---- H2O ------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def mark_padding(self, new_slots_valid: torch.Tensor) -> None:
        """Record which of the just-added slots are real tokens, ``(batch, new)`` bool."""
        if self.policy.capacity is not None and not bool(new_slots_valid.all()):
            # Padding slots would take budget from real tokens unevenly across rows, so a
            # padded batch could not equal its rows run alone.
            raise ValueError(
                f"padded batches are not supported with the {self.policy.name} policy: "
                "feed prompts of equal length, or one at a time (this cache must be discarded)"
            )
        new = new_slots_valid.shape[-1]
        self.valid[..., -new:] = new_slots_valid[:, None, :]
        self.has_padding = self.has_padding or not bool(new_slots_valid.all())

    def after_attention(self, received: torch.Tensor | None) -> None:
        """Add the attention mass each slot just received, ``(batch, kv_heads, slots)``
        float32 or None, then evict down to budget."""
        _awaiting.layer = None
        if received is not None:
            self.scores += received
        self._evict()

    def _evict(self) -> None:
        capacity = self.policy.capacity
        if capacity is None:
            return
        slots = self.held
        # Pinned slots are never evicted, so every head of every row holds the same number.
        n_pinned = int(self.pinned[0, 0].sum())
        n_free = slots - n_pinned
        if n_free <= capacity:
            return
        if n_pinned == 0:
            self._keep(self.policy.keep(self.scores))
            return
        # Stable sort puts the evictable slots first, each group still in temporal order.
        order = torch.sort(self.pinned.to(torch.uint8), dim=-1, stable=True).indices
        free, pinned = order[..., :n_free], order[..., n_free:]
        chosen = self.policy.keep(self.scores.gather(-1, free))
        chosen = chosen.expand(*free.shape[:-1], -1)
        keep = torch.cat([free.gather(-1, chosen), pinned], dim=-1).sort(dim=-1).values
        self._keep(keep)

    def _keep(self, index: torch.Tensor) -> None:
        """Keep the slots at ``index``: ``(k,)`` for all heads or ``(batch, heads, k)``."""
        if index.dim() == 1:
            self._map_slots(lambda t: t.index_select(2, index))
            return

        def gather(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 4:
                return t.gather(2, index[..., None].expand(-1, -1, -1, t.shape[-1]))
            return t.gather(2, index)

        self._map_slots(gather)

    def _map_slots(self, fn) -> None:
        # keys/values are 4-D, the per-slot tensors 3-D: both carry slots on dim 2.
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.scores, self.positions = fn(self.scores), fn(self.positions)
        self.valid, self.pinned = fn(self.valid), fn(self.pinned)

    def _map_rows(self, fn) -> None:
        if self.is_initialized:
            self._map_slots(fn)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "keys": self.keys,
            "values": self.values,
            "scores": self.scores,
            "positions": self.positions,
            "valid": self.valid,
            "pinned": self.pinned,
        }


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
    kv_bytes: int  # bytes of every tensor the cache holds, from the tensors themselves
    layers: list[LayerStats]

    @property
    def budget_reached(self) -> bool:
        return self.budget is not None and self.held >= self.budget


class H2OCache(Cache):
    """A transformers ``Cache`` whose layers evict by an ``EvictionPolicy``."""

    def __init__(self, policy: EvictionPolicy, num_layers: int) -> None:
        self.policy = policy
        self.spans = ProtectedSpans()
        super().__init__(layers=[H2OLayer(policy, self.spans) for _ in range(num_layers)])

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    def protect(self, start: int, end: int) -> None:
        """Never evict tokens at absolute positions ``[start, end)``.

        Future positions are pinned as they arrive; past ones only if every layer and head
        still holds them (an evicted token cannot be brought back).
        """
        if not 0 <= start <= end:
            raise ValueError(f"protected span [{start}, {end}) is not a valid range")
        past_end = min(end, self.seen)
        if start < past_end:
            for layer in self.layers:
                if not layer.is_initialized:
                    continue
                inside = (layer.positions >= start) & (layer.positions < past_end)
                if not bool((inside.sum(-1) == past_end - start).all()):
                    raise ValueError(
                        f"cannot protect [{start}, {end}): some of those tokens were already evicted"
                    )
        self.spans.ranges.append((start, end))
        for layer in self.layers:
            if layer.is_initialized:
                layer.pinned = layer.spans.contains(layer.positions)

    def stats(self) -> CacheStats:
        capacity = self.policy.capacity
        first = self.layers[0]
        pinned = int(first.pinned[0, 0].sum()) if first.is_initialized else 0
        layers = [
            LayerStats(
                held=layer.held,
                positions=layer.positions.clone() if layer.is_initialized else torch.empty(0, 0, 0),
            )
            for layer in self.layers
        ]
        kv_bytes = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.is_initialized
            for t in layer.tensors().values()
        )
        return CacheStats(
            policy=self.policy.describe(),
            seen=self.seen,
            held=first.held,
            pinned=pinned,
            budget=None if capacity is None else capacity + pinned,
            kv_bytes=kv_bytes,
            layers=layers,
        )


def make_cache(model, policy: str = "h2o", **budgets: int) -> H2OCache:
    """A fresh cache for ``model`` under ``policy`` (full, h2o, recent, sink).

    ``budgets`` are ``heavy``, ``recent`` and ``sink`` slot counts. The model must use the
    registered ``h2o`` attention (``load_model`` sets it), which feeds the cache its scores.
    """
    from .attention import ATTENTION_NAME

    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"the model uses attention {config._attn_implementation!r}; the H2O cache needs "
            f"{ATTENTION_NAME!r}: load it with h2o_chat.load_model or call "
            f"register_h2o_attention() and model.set_attn_implementation({ATTENTION_NAME!r})"
        )
    unknown = set(budgets) - {"heavy", "recent", "sink"}
    if unknown:
        raise TypeError(f"unknown budget(s) {sorted(unknown)}; allowed: heavy, recent, sink")
    return H2OCache(make_policy(policy, **budgets), config.num_hidden_layers)
