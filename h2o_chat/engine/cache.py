"""A bounded KV cache for stock transformers models: one ``H2OLayer`` per decoder layer.

Data path per attention call: the model calls ``H2OCache.update`` -> ``H2OLayer.update``
appends the new keys/values (score 0) and hands itself over to the attention call that
follows in this thread -> the registered attention function (``attention.py``) computes
the softmax probabilities and gives them to ``H2OLayer.receive`` -> the layer's policy
accumulates the mass each slot received into its score -> after the last layer of its
``SlotGroup`` (neighbouring layers with stacked buffers, ``slots.py``), the group evicts
down to budget, every layer by its own scores.

Every layer keeps, per batch row and KV head, the absolute position of each slot, so
stats and tests can say exactly which tokens are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import awaiting_attention, hand_over
from .budget import ByteBudget
from .memory import return_freed_memory
from .policies import EvictionPolicy
from .quant import KVStorage
from .rope import RopeShifter
from .slots import ROLLING_METADATA, SLOT_METADATA, SlotGroup, grown_size
from .state import CacheStateMixin


class ProtectedSpans:
    """Half-open ranges of absolute token positions that are never evicted."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def covered(self) -> int:
        """Positions inside any range, each counted once."""
        covered, reached = 0, 0
        for start, end in sorted(self.ranges):
            covered += max(0, end - max(start, reached))
            reached = max(reached, end)
        return covered

    def contains(self, positions: torch.Tensor) -> torch.Tensor:
        inside = torch.zeros_like(positions, dtype=torch.bool)
        for start, end in self.ranges:
            inside |= (positions >= start) & (positions < end)
        return inside

    def covers(self, position: int) -> bool:
        return any(start <= position < end for start, end in self.ranges)


class HeldSlots:
    """A layer attribute that reads as the first ``held`` slots of the layer's buffer of
    the same name (None before its first tokens), made when read. Views made at every
    change of ``held`` instead (twice a decode step: the new token, the eviction) took a
    tenth of a batched step, most of them never read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, layer: H2OLayer | None, owner: type | None = None) -> torch.Tensor | None:
        if layer is None:
            return self
        return layer.held_slot(self.name)

    def __set__(self, layer: H2OLayer, value: object) -> None:
        raise AttributeError(f"{self.name} is a view of the layer's slot buffers; write into it instead")


class H2OLayer(CacheLayerMixin):
    """One layer's slots: keys, values, accumulated scores, absolute positions and flags.

    The attributes ``keys``, ``values``, ``scores`` (float32), ``positions``, ``valid``
    (False for padding) and ``pinned`` are views of the ``held`` slots in use of buffers
    that the layer's ``SlotGroup`` owns. Shapes: keys/values ``(batch, kv_heads, held,
    head_dim)``, the others ``(batch, kv_heads, held)``. Keys and values are stored as
    ``storage`` says (``quant.py``): quantized, ``keys``/``values`` hold the codes and
    ``keys_scale``/``keys_min`` (and the values') their groups' scales, and attention
    reads them dequantized (``read``).

    With position rolling (``rope`` given), keys are not kept at their absolute positions
    but at their temporal rank among the held slots (``rotated_at``), and each call's
    queries at the ranks after them, so a conversation longer than the model's trained
    context never shows it a position it was not trained on.

    Slots are not kept in temporal order in memory: an evicted slot is refilled by moving
    a kept slot from the end, so evicting one token per step moves one slot per head
    instead of copying the whole cache. Attention does not depend on slot order, new
    tokens always occupy the last slots during their attention call, and ``positions``
    gives the temporal order wherever it matters (the policy's view, stats).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False  # evicted slots cannot be brought back
    keys, values, scores, positions = HeldSlots(), HeldSlots(), HeldSlots(), HeldSlots()
    valid, pinned, rotated_at = HeldSlots(), HeldSlots(), HeldSlots()

    def __init__(self, policy: EvictionPolicy, spans: ProtectedSpans, rope: RopeShifter | None = None,
                 storage: KVStorage = KVStorage()) -> None:
        # Not CacheLayerMixin.__init__: it assigns ``keys`` and ``values``, which here are
        # views of the slot buffers.
        self.is_initialized = False
        self.policy = policy
        self.spans = spans
        self.rope = rope
        self.storage = storage
        # Rolling moves keys to new positions. Keys kept as the model gives them are
        # rotated in place; quantized ones are stored unrotated and rotated when read, since
        # re-quantizing at every move would add up error.
        self.key_rotation = rope if storage.rotates_keys_in_place else None
        self.group: SlotGroup | None = None
        self.closes_group = False  # the last member: its attention call evicts the group
        self.eviction_held = False  # see H2OCache.hold_eviction
        self._query_shift = 0  # rolling: positions to move this call's queries by
        self.seen = 0
        self.held = 0  # slots in use: the first ``held`` of the buffers
        self._buffers: dict[str, torch.Tensor] = {}
        self.has_padding = False  # lets unpadded decoding skip building a mask
        # Called with the probabilities of every attention call (see ``receive``), even
        # under a policy that needs no scores; e.g. the fidelity probe's full cache.
        self.attention_observer: Callable[[torch.Tensor], None] | None = None

    # ---- transformers' layer interface -------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        slots = (batch, heads, 0)
        metadata = SLOT_METADATA | (ROLLING_METADATA if self.rope is not None else {})
        empty = {
            **self.storage.keys.empty("keys", slots, key_states.shape[-1], self.device, self.dtype),
            **self.storage.values.empty("values", slots, value_states.shape[-1], self.device, self.dtype),
            **{name: torch.zeros(slots, dtype=dtype, device=self.device) for name, dtype in metadata.items()},
        }
        self.held = 0
        SlotGroup.alone(self, empty, size=0)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif awaiting_attention() is self:
            # The previous call never reached our attention function (an exception in
            # between); finish it now so the cache stays bounded regardless.
            self.receive(None)
        new = key_states.shape[2]
        self._reserve(self.held + new)
        start, end = self.held, self.held + new
        positions = torch.arange(self.seen, self.seen + new, device=self.device)
        buffers = self._buffers
        dtype = key_states.dtype
        if self.rope is not None:
            # New tokens go right after the held slots, whatever their absolute position.
            self._query_shift = start - self.seen
            if self.key_rotation is None:
                key_states = self.rope.shift(key_states, -positions.expand(*key_states.shape[:2], -1))
            elif self._query_shift:
                key_states = self.rope.shift(key_states, self._query_shift)
            buffers["rotated_at"][:, :, start:end] = torch.arange(start, end, device=self.device)
        at = (slice(None), slice(None), slice(start, end))
        self.storage.keys.write_at(buffers, "keys", at, key_states)
        self.storage.values.write_at(buffers, "values", at, value_states)
        _write_bookkeeping(buffers, at, positions, self.spans.contains(positions))
        self.seen += new
        self.held = end
        hand_over(self)
        return self.read(dtype)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The held slots' keys and values as attention uses them, in ``dtype``: the
        stored ones where kept as given, else dequantized (one pass over the held slots)."""
        held = self.held_slots()
        keys = self.storage.keys.read(held, "keys", dtype)
        if self.rope is not None and self.key_rotation is None:
            keys = self.rope.shift(keys, self.rotated_at)
        return keys, self.storage.values.read(held, "values", dtype)

    def get_seq_length(self) -> int:
        # Tokens seen, not slots held: generate and the model derive positions from it.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, self.seen - self.held

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.group is not None:
            self.group.dissolve()
        self.group = None
        self._buffers = {}
        self.is_initialized = False
        self.has_padding = False
        self.seen = self.held = self._query_shift = 0
        self.eviction_held = False
        if awaiting_attention() is self:
            hand_over(None)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (crop)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_buffers(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_buffers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_buffers(lambda t: t[indices, ...])

    # ---- the attention function's side (``attention.AttentionClient``) -------------------

    @property
    def wants_probabilities(self) -> bool:
        return self.policy.needs_scores or self.attention_observer is not None

    @property
    def sums_probabilities(self) -> bool:
        """Whether all ``receive`` does with probabilities is add each slot's mass to its
        score, so that rows of layers like it can be scored in one addition."""
        return (self.policy.needs_scores and self.attention_observer is None
                and type(self.policy).accumulate is EvictionPolicy.accumulate)

    def prepare(self, query: torch.Tensor, new_valid: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Record which new slots are real tokens (``(batch, new)`` bool, None: all);
        return the query moved to the rolled positions and the held slots' validity
        (None while the layer never held padding)."""
        if new_valid is not None:
            self._mark_padding(new_valid)
        if self._query_shift:
            query = self.rope.shift(query, self._query_shift)
        return query, self.valid if self.has_padding else None

    def receive(self, probabilities: torch.Tensor | None) -> None:
        """The end of this layer's attention call: ``probabilities`` ``(batch, kv_heads,
        groups, query, held)`` float32 where the layer wanted them, else None. The
        observer sees them, the policy folds each slot's received mass into its score,
        and the last layer of the group then evicts the group to budget."""
        hand_over(None)
        if probabilities is not None:
            if self.attention_observer is not None:
                self.attention_observer(probabilities)
            self.policy.accumulate(self.scores, probabilities.sum(dim=(2, 3)))
        if self.closes_group and not self.eviction_held:
            self.group.evict()

    def _mark_padding(self, new_valid: torch.Tensor) -> None:
        if self.policy.capacity is not None and not bool(new_valid.all()):
            # Padding slots would take budget from real tokens unevenly across rows, so a
            # padded batch could not equal its rows run alone.
            raise ValueError(
                f"padded batches are not supported with the {self.policy.name} policy: "
                "feed prompts of equal length, or one at a time (this cache must be discarded)"
            )
        new = new_valid.shape[-1]
        self.valid[..., -new:] = new_valid[:, None, :]
        self.has_padding = self.has_padding or not bool(new_valid.all())

    # ---- the slot group's side (``slots.SlotMember``) -----------------------------------

    @property
    def size(self) -> int:
        """Slots the buffers have room for."""
        return self._buffers["keys"].shape[2]

    def held_slots(self) -> dict[str, torch.Tensor]:
        return {name: buffer[:, :, : self.held] for name, buffer in self._buffers.items()}

    def held_slot(self, name: str) -> torch.Tensor | None:
        """The held slots of buffer ``name``, None where the layer has no such buffer."""
        buffer = self._buffers.get(name)
        return None if buffer is None else buffer[:, :, : self.held]

    def adopt(self, group: SlotGroup, buffers: dict[str, torch.Tensor], closes_group: bool) -> None:
        self.group, self.closes_group, self._buffers = group, closes_group, buffers

    # ---- the cache's side --------------------------------------------------------------

    @property
    def pinned_slots(self) -> int:
        """Slots held by protected tokens; never evicted, so every head of every row holds
        the same number."""
        return int(self.pinned[0, 0].sum())

    def allocated_bytes(self) -> int:
        """Bytes of every buffer this layer holds, including room reserved for new tokens."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def restore(self, slots: dict[str, torch.Tensor], size: int, seen: int, has_padding: bool,
                device: torch.device | str) -> None:
        """Hold exactly ``slots`` (by buffer name, ``(batch, kv_heads, held, ...)``, in
        slot order), in buffers of ``size`` slots on ``device``: what ``held_slots``
        and the counters of a layer showed. Same size and slot order give attention the
        same memory layout, so the next logits are bit-identical."""
        self.reset()
        keys = slots["keys"]
        self.device = torch.device(device)
        self.held = keys.shape[2]
        SlotGroup.alone(self, slots, size, self.device)
        self.seen, self.has_padding = seen, has_padding
        self.is_initialized = True

    def _reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots: a bounded cache reaches its peak size (budget
        plus one prefill chunk) once and never reallocates after that."""
        if slots > self.size:
            self.group.resize(grown_size(self.size, slots, self.held, self.policy.capacity, self.pinned_slots))

    def _map_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.is_initialized:
            self.group.dissolve()
            SlotGroup([self], {name: fn(t) for name, t in self.group.buffers.items()})


def _write_bookkeeping(buffers: dict[str, torch.Tensor], at: tuple, positions: torch.Tensor,
                       pinned: torch.Tensor) -> None:
    """New slots' bookkeeping at index ``at`` of the buffers: no score yet, their absolute
    ``positions``, real tokens, ``pinned`` where protected (both shaped to broadcast
    over what ``at`` selects)."""
    buffers["scores"][at] = 0
    buffers["positions"][at] = positions
    buffers["valid"][at] = True
    buffers["pinned"][at] = pinned


def append_rows(layers: list[H2OLayer], buffers: dict[str, torch.Tensor], key_states: torch.Tensor,
                value_states: torch.Tensor) -> bool:
    """Give each of ``layers`` its one new token, as its ``update`` would, with one write
    per buffer for all of them: row r of ``buffers`` (``(rows, kv_heads, size, ...)``, e.g.
    a ``RowPool``'s, each layer's buffers a row of them) and of ``key_states`` and
    ``value_states`` (``(rows, kv_heads, 1, head_dim)``) is ``layers[r]``'s. A dozen small
    writes per row and layer took a fifth of a 32-row decode step.

    False, with nothing written, where some layer needs more than a plain write (rolling,
    growing its buffers, finishing a call left unfinished): then each runs ``update``.
    """
    if any(layer.rope is not None or layer.held >= layer.size or awaiting_attention() is layer
           for layer in layers):
        return False
    device = key_states.device
    seen = torch.tensor([layer.seen for layer in layers], device=device)
    pinned = torch.tensor([layer.spans.covers(layer.seen) for layer in layers], device=device)
    at = (torch.arange(len(layers), device=device), slice(None),
          torch.tensor([layer.held for layer in layers], device=device))
    storage = layers[0].storage
    storage.keys.write_at(buffers, "keys", at, key_states[:, :, 0])
    storage.values.write_at(buffers, "values", at, value_states[:, :, 0])
    _write_bookkeeping(buffers, at, seen[:, None], pinned[:, None])
    for layer in layers:
        layer.seen += 1
        layer.held += 1
    return True


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

    @property
    def budget_reached(self) -> bool:
        return self.budget is not None and self.held >= self.budget


class H2OCache(CacheStateMixin, Cache):
    """A transformers ``Cache`` whose layers evict by an ``EvictionPolicy``; saved and
    resumed with ``state``/``load_state`` (``state.py``)."""

    def __init__(self, policy: EvictionPolicy, num_layers: int, rope: RopeShifter | None = None,
                 storage: KVStorage = KVStorage(), byte_budget: ByteBudget | None = None) -> None:
        self.policy = policy
        self.spans = ProtectedSpans()
        self.rolling = rope is not None
        self.storage = storage
        # With a budget in bytes, pinned tokens take their slots from the policy's share
        # (``_fit_budget``), so the cache holds at most the budget's tokens at rest.
        self.byte_budget = byte_budget
        super().__init__(layers=[H2OLayer(policy, self.spans, rope, storage) for _ in range(num_layers)])

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._stack_layers()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def fit_for_decoding(self) -> None:
        """Give back the room prompt chunks needed, once a prompt is in: a bounded cache
        takes a chunk on top of its budget before evicting, so its buffers grow to budget
        plus a chunk (twice the budget after a long message), while decoding needs the
        budget plus one token. Kept, that room doubled the memory of every idle
        conversation and of every ``RowPool`` row. The next prompt grows the buffers again
        (one copy of the held slots)."""
        capacity = self.policy.capacity
        if capacity is None:
            return
        for group in self._groups():
            layers = group.layers
            # Held past the budget (eviction held over a prompt fed in passes): all stay.
            size = max(capacity + layers[0].pinned_slots, *(layer.held for layer in layers)) + 1
            if layers[0].size > size:
                group.resize(size)
                return_freed_memory()  # else glibc keeps the larger buffers just freed

    def whole_group(self) -> SlotGroup | None:
        """The ``SlotGroup`` of every layer, where one holds them all (a bounded cache once
        every layer holds its first tokens), else None."""
        group = self.layers[0].group
        return group if group is not None and len(group) == len(self.layers) else None

    def _stack_layers(self) -> None:
        """Put each run of neighbouring layers that share device, dtype and shapes into one
        ``SlotGroup`` (all layers, on one device), so the run evicts at once. Runs are
        maximal, so an existing group always lies inside one run.

        A cache that never evicts stays unstacked: it would gain nothing, and every time
        it grows a stacked group holds the old and the new buffers of all layers at once.
        """
        layers = self.layers
        if self.policy.capacity is None or len(layers[0].group or ()) == len(layers):
            return

        def alike(layer: H2OLayer) -> tuple | None:
            if not layer.is_initialized:
                return None
            keys, values = layer.keys, layer.values
            return (keys.device, keys.dtype, keys.shape[:2], keys.shape[3:], values.shape[3:])

        start = 0
        for end in range(1, len(layers) + 1):
            if end < len(layers) and alike(layers[end]) == alike(layers[start]):
                continue
            run = layers[start:end]
            if alike(run[0]) is not None and run[0].group.layers != run:
                SlotGroup.stack(run)
            start = end

    def _groups(self) -> list[SlotGroup]:
        """The layers' slot groups, each once."""
        return list({id(layer.group): layer.group for layer in self.layers if layer.is_initialized}.values())

    def _evict_all(self) -> None:
        for group in self._groups():
            group.evict()

    def hold_eviction(self, hold: bool) -> None:
        """While held, forward passes score but do not evict: one prefill chunk fed in
        several passes then keeps exactly what one pass would (every query sees the same
        slots, and the scores add up to the same). Releasing evicts down to budget."""
        for layer in self.layers:
            layer.eviction_held = hold
        if not hold:
            self._evict_all()

    def reset(self) -> None:
        for layer in self.layers:
            layer.group = None  # every layer is emptied: nothing to hand back to the others
        super().reset()

    def protect(self, start: int, end: int) -> None:
        """Never evict tokens at absolute positions ``[start, end)``.

        Future positions are pinned as they arrive; past ones only if every layer and head
        still holds them (an evicted token cannot be brought back): else ValueError, and
        nothing changes.
        """
        if not 0 <= start <= end:
            raise ValueError(f"protected span [{start}, {end}) is not a valid range")
        lost = self.evicted(start, end)
        if lost:
            raise ValueError(f"cannot protect [{start}, {end}): {len(lost)} of those tokens were "
                             f"already evicted (first at position {lost[0]})")
        self.spans.ranges.append((start, end))
        self._refresh_pinned()
        self._fit_budget()

    def unprotect(self, start: int, end: int) -> None:
        """Undo one ``protect(start, end)``: its tokens become ordinary eviction candidates
        again, with the scores they accumulated meanwhile, unless another span covers them.

        The cache is brought back to its budget at once, so it may evict them right here.
        """
        try:
            self.spans.ranges.remove((start, end))
        except ValueError:
            raise ValueError(f"[{start}, {end}) is not a protected span; protected: "
                             f"{self.spans.ranges}") from None
        self._refresh_pinned()
        self._fit_budget()
        with torch.inference_mode():
            self._evict_all()

    def evicted(self, start: int, end: int) -> list[int]:
        """The positions in ``[start, end)``, among the tokens seen so far, that some layer,
        batch row or KV head no longer holds."""
        past_end = min(end, self.seen)
        if start >= past_end:
            return []
        everywhere = torch.ones(past_end - start, dtype=torch.bool)
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            positions = layer.positions
            inside = positions[(positions >= start) & (positions < past_end)] - start
            # A head holds a position at most once, so it is held everywhere iff it is
            # counted once per batch row and KV head.
            counts = torch.bincount(inside, minlength=past_end - start).cpu()
            everywhere &= counts == positions.shape[0] * positions.shape[1]
        return (start + (~everywhere).nonzero().flatten()).tolist()

    def _fit_budget(self) -> None:
        """Give the policy what the byte budget leaves beside the pinned tokens (those
        not seen yet included: they will be held once fed)."""
        if self.byte_budget is not None:
            self.policy.fit(self.byte_budget.slots - self.spans.covered())

    def _refresh_pinned(self) -> None:
        # Sessions feed in inference mode, so the buffers may be inference tensors.
        with torch.inference_mode():
            for layer in self.layers:
                if layer.is_initialized:
                    layer.pinned.copy_(self.spans.contains(layer.positions))

    def stats(self) -> CacheStats:
        capacity = self.policy.capacity
        first = self.layers[0]
        pinned = first.pinned_slots if first.is_initialized else 0
        layers = [
            LayerStats(
                held=layer.held,
                positions=layer.positions.sort(dim=-1).values
                if layer.is_initialized
                else torch.empty(0, 0, 0, dtype=torch.long),
            )
            for layer in self.layers
        ]
        kv_bytes = sum(layer.allocated_bytes() for layer in self.layers)
        held_bytes = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.is_initialized
            for t in layer.held_slots().values()
        )
        return CacheStats(
            policy=self.policy.describe(),
            seen=self.seen,
            held=first.held,
            pinned=pinned,
            budget=None if capacity is None else capacity + pinned,
            kv_bytes=kv_bytes,
            held_bytes=held_bytes,
            layers=layers,
            key_bits=self._bits(self.storage.key_bits, "keys"),
            value_bits=self._bits(self.storage.value_bits, "values"),
            budget_bytes=None if self.byte_budget is None else self.byte_budget.bytes,
        )

    def _bits(self, bits: int | None, name: str) -> int | None:
        first = self.layers[0]
        if bits is None and first.is_initialized:
            return getattr(first, name).element_size() * 8
        return bits
