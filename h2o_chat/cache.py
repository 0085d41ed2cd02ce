"""A bounded KV cache for stock transformers models: one ``H2OLayer`` per decoder layer.

Data path per attention call: the model calls ``H2OCache.update`` -> ``H2OLayer.update``
appends the new keys/values (score 0) and marks itself as the layer awaiting attention in
this thread -> the registered attention function (``attention.py``) computes the softmax
probabilities and calls ``H2OLayer.after_attention`` with the mass each slot received ->
the layer adds it to the accumulated scores -> after the last layer of its ``SlotGroup``
(neighbouring layers with stacked buffers), the group evicts down to budget, every layer
by its own scores.

Every layer keeps, per batch row and KV head, the absolute position of each slot, so
stats and tests can say exactly which tokens are kept.
"""

from __future__ import annotations

import copy
import re
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import ConfigError
from .policies import EvictionPolicy, make_policy
from .rope import RopeShifter

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


def _grown_size(size: int, slots: int, held: int, capacity: int | None, pinned: int) -> int:
    """Buffer size for ``slots`` slots. Geometric growth: a cache below its budget would
    otherwise reallocate and copy every buffer at every token. A bounded cache stops at
    its peak (budget, pinned slots and the incoming tokens) and never grows after that."""
    grown = max(slots, 2 * size)
    if capacity is not None:
        grown = max(slots, min(grown, capacity + pinned + slots - held))
    return grown


def evict_slots(buffers: dict[str, torch.Tensor], held: int, policy: EvictionPolicy,
                rope: RopeShifter | None) -> int:
    """Evict the slots ``policy`` drops from ``buffers`` (``(batch, heads, size, ...)``,
    the first ``held`` slots in use) and return the new number of slots held.

    ``heads`` may be the KV heads of one layer or of several stacked layers: the policy
    decides per head, so one call serves a whole ``SlotGroup``.
    """
    capacity = policy.capacity
    if capacity is None:
        return held
    pinned = buffers["pinned"][:, :, :held]
    n_pinned = int(pinned[0, 0].sum())
    n_free = held - n_pinned
    if n_free <= capacity:
        return held
    positions = buffers["positions"][:, :, :held]
    scores = buffers["scores"][:, :, :held]
    drop = policy.drop_one(scores, positions) if n_pinned == 0 and n_free == capacity + 1 else None
    if drop is not None:
        # The last slot moves into the dropped one (onto itself where it is the one).
        for buffer in buffers.values():
            index = drop.view(*drop.shape, *[1] * (buffer.dim() - 3)).expand(*drop.shape, *buffer.shape[3:])
            buffer.scatter_(2, index, buffer[:, :, held - 1 : held].clone())
        if rope is not None:
            _roll_to_ranks(buffers, held - 1, rope)
        return held - 1
    # The policy sees the evictable slots oldest first (pinned ones sort last).
    order_key = positions.masked_fill(pinned, torch.iinfo(torch.long).max)
    free = order_key.argsort(dim=-1)[..., :n_free]
    chosen = policy.keep(scores.gather(-1, free), positions.gather(-1, free))
    chosen = free.gather(-1, chosen.expand(*free.shape[:-1], -1))
    keep = pinned.scatter(-1, chosen, True)
    new_held = held - (n_free - capacity)
    # Slots are not kept in temporal order: the kept slots past ``new_held`` move into the
    # dropped slots before it. Per head both are equally many, and ``nonzero`` lists them
    # in (row, head, slot) order, so the j-th hole of a head pairs with its j-th mover.
    holes = (~keep[..., :new_held]).nonzero(as_tuple=True)
    movers = keep[..., new_held:held].nonzero(as_tuple=True)
    movers = (movers[0], movers[1], movers[2] + new_held)
    for buffer in buffers.values():
        buffer[holes] = buffer[movers]
    if rope is not None:
        _roll_to_ranks(buffers, new_held, rope)
    return new_held


def _roll_to_ranks(buffers: dict[str, torch.Tensor], held: int, rope: RopeShifter) -> None:
    """Move every kept key to its temporal rank among the held slots."""
    order = buffers["positions"][:, :, :held].argsort(dim=-1)
    ranks = torch.arange(held, device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    rotated_at = buffers["rotated_at"][:, :, :held]
    keys = buffers["keys"][:, :, :held]
    keys.copy_(rope.shift(keys, rank - rotated_at))
    rotated_at.copy_(rank)


class SlotGroup:
    """The buffers of consecutive layers, stacked: ``(batch, layers, kv_heads, size, ...)``.

    Each member layer's buffers are views of its row. After the last member's attention
    the whole group is evicted in one ``evict_slots`` call, with the layers' KV heads side
    by side; evicting layer by layer cost a few dozen small tensor ops per layer and per
    decoded token, which made H2O slower than sdpa at short contexts.

    A layer starts alone in a group of one; in a cache that evicts, ``H2OCache`` stacks
    neighbours on the same device once every layer has its first tokens (see
    ``H2OCache.update``).
    """

    def __init__(self, layers: list[H2OLayer], buffers: dict[str, torch.Tensor]) -> None:
        # Weak: members point at their group, and a cycle would keep a dropped cache's
        # buffers alive until the garbage collector happens to run.
        self._members = [weakref.ref(layer) for layer in layers]
        self._adopt(buffers)

    @property
    def layers(self) -> list[H2OLayer]:
        return [member() for member in self._members]

    def __len__(self) -> int:
        return len(self._members)

    def __deepcopy__(self, memo: dict) -> SlotGroup:
        # copy.deepcopy would keep the weak references pointing at the original layers.
        twin = SlotGroup.__new__(SlotGroup)
        memo[id(self)] = twin
        twin.buffers = copy.deepcopy(self.buffers, memo)
        twin._members = [weakref.ref(copy.deepcopy(layer, memo)) for layer in self.layers]
        return twin

    def _adopt(self, buffers: dict[str, torch.Tensor]) -> None:
        """Hold ``buffers`` and point every member's views at its row."""
        self.buffers = buffers
        layers = self.layers
        for index, layer in enumerate(layers):
            layer.group = self
            layer.closes_group = index == len(layers) - 1
            layer._buffers = {name: t[:, index] for name, t in buffers.items()}
            layer._refresh_views()

    @classmethod
    def stack(cls, layers: list[H2OLayer]) -> SlotGroup:
        """One group holding what ``layers`` (initialized, alike in shape and device) hold."""
        size = max(layer.size for layer in layers)
        buffers = {}
        for name, t in layers[0]._buffers.items():
            stacked = t.new_zeros((t.shape[0], len(layers), t.shape[1], size, *t.shape[3:]))
            for index, layer in enumerate(layers):
                stacked[:, index, :, : layer.held] = getattr(layer, name)
            buffers[name] = stacked
        return cls(layers, buffers)

    def resize(self, size: int) -> None:
        """Give every member room for ``size`` slots, keeping what it holds."""
        def grow(t: torch.Tensor) -> torch.Tensor:
            bigger = t.new_zeros((*t.shape[:3], size, *t.shape[4:]))
            kept = min(size, t.shape[3])
            bigger[:, :, :, :kept] = t[:, :, :, :kept]
            return bigger

        self._adopt({name: grow(t) for name, t in self.buffers.items()})

    def dissolve(self) -> None:
        """Give every member a group of its own (a copy of its row); a group of one
        already is one."""
        if len(self) == 1:
            return
        for index, layer in enumerate(self.layers):
            SlotGroup([layer], {name: t[:, index : index + 1].clone() for name, t in self.buffers.items()})

    def evict(self) -> None:
        """Evict every member down to budget, runs of members holding the same number of
        slots at once (all of them, unless a forward pass failed midway)."""
        layers, start = self.layers, 0
        for end in range(1, len(layers) + 1):
            if end < len(layers) and layers[end].held == layers[start].held:
                continue
            # A view (never a copy), so evicting it evicts the members.
            flat = {name: t[:, start:end].view(t.shape[0], -1, *t.shape[3:]) for name, t in self.buffers.items()}
            held = evict_slots(flat, layers[start].held, layers[start].policy, layers[start].rope)
            for layer in layers[start:end]:
                layer.held = held
                layer._refresh_views()
            start = end


class H2OLayer(CacheLayerMixin):
    """One layer's slots: keys, values, accumulated scores, absolute positions and flags.

    The attributes ``keys``, ``values``, ``scores`` (float32), ``positions``, ``valid``
    (False for padding) and ``pinned`` are views of the ``held`` slots in use of buffers
    that the layer's ``SlotGroup`` owns. Shapes: keys/values ``(batch, kv_heads, held,
    head_dim)``, the others ``(batch, kv_heads, held)``.

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

    def __init__(self, policy: EvictionPolicy, spans: ProtectedSpans, rope: RopeShifter | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.spans = spans
        self.rope = rope
        self.group: SlotGroup | None = None
        self.closes_group = False  # the last member: its attention call evicts the group
        self.query_shift = 0  # rolling: positions to move this call's queries by
        self.seen = 0
        self.held = 0
        self._buffers: dict[str, torch.Tensor] = {}
        self.scores = self.positions = self.valid = self.pinned = None
        self.has_padding = False  # lets unpadded decoding skip building a mask
        # Set by a probe (fidelity.py): attention then keeps, in ``newest_attention``, the
        # mass each slot got from the newest query, (batch, kv_heads, held) float32,
        # summed over the query heads of its group; even for a policy without scores.
        self.watch_newest = False
        self.newest_attention: torch.Tensor | None = None

    # ---- transformers' layer interface -------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        slots = (batch, 1, heads, 0)
        buffers = {
            "keys": key_states.new_empty((*slots, key_states.shape[-1])),
            "values": value_states.new_empty((*slots, value_states.shape[-1])),
            "scores": torch.zeros(slots, dtype=torch.float32, device=self.device),
            "positions": torch.zeros(slots, dtype=torch.long, device=self.device),
            "valid": torch.ones(slots, dtype=torch.bool, device=self.device),
            "pinned": torch.zeros(slots, dtype=torch.bool, device=self.device),
        }
        if self.rope is not None:
            buffers["rotated_at"] = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.held = 0
        SlotGroup([self], buffers)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif layer_awaiting_attention() is self:
            # The previous call never reached our attention function (an exception in
            # between); finish it now so the cache stays bounded regardless.
            self.after_attention(None)
        new = key_states.shape[2]
        self._reserve(self.held + new)
        start, end = self.held, self.held + new
        positions = torch.arange(self.seen, self.seen + new, device=self.device)
        buffers = self._buffers
        if self.rope is not None:
            # New tokens go right after the held slots, whatever their absolute position.
            self.query_shift = start - self.seen
            if self.query_shift:
                key_states = self.rope.shift(key_states, self.query_shift)
            buffers["rotated_at"][:, :, start:end] = torch.arange(start, end, device=self.device)
        buffers["keys"][:, :, start:end] = key_states
        buffers["values"][:, :, start:end] = value_states
        buffers["scores"][:, :, start:end] = 0
        buffers["positions"][:, :, start:end] = positions
        buffers["valid"][:, :, start:end] = True
        buffers["pinned"][:, :, start:end] = self.spans.contains(positions)
        self.held, self.seen = end, self.seen + new
        self._refresh_views()
        _awaiting.layer = self
        return self.keys, self.values

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
        self.keys = self.values = None
        self.scores = self.positions = self.valid = self.pinned = None
        self.is_initialized = False
        self.has_padding = False
        self.seen = self.held = self.query_shift = 0
        self.newest_attention = None
        if layer_awaiting_attention() is self:
            _awaiting.layer = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an evicting cache cannot be rolled back (crop)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_buffers(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_buffers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_buffers(lambda t: t[indices, ...])

    # ---- H2O ------------------------------------------------------------------------------

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
        float32 or None; the last layer of the group then evicts the group to budget."""
        _awaiting.layer = None
        if received is not None:
            self.scores += received
        if self.closes_group:
            self.group.evict()

    @property
    def pinned_slots(self) -> int:
        """Slots held by protected tokens; never evicted, so every head of every row holds
        the same number."""
        return int(self.pinned[0, 0].sum())

    @property
    def size(self) -> int:
        """Slots the buffers have room for."""
        return self._buffers["keys"].shape[2]

    def _reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots: a bounded cache reaches its peak size (budget
        plus one prefill chunk) once and never reallocates after that."""
        if slots > self.size:
            self.group.resize(_grown_size(self.size, slots, self.held, self.policy.capacity, self.pinned_slots))

    def _refresh_views(self) -> None:
        for name, buffer in self._buffers.items():
            setattr(self, name, buffer[:, :, : self.held])

    def _map_buffers(self, fn) -> None:
        if self.is_initialized:
            self.group.dissolve()
            SlotGroup([self], {name: fn(t) for name, t in self.group.buffers.items()})

    def allocated_bytes(self) -> int:
        """Bytes of every buffer this layer holds, including room reserved for new tokens."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    # ---- saving and resuming ----------------------------------------------------------------

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int | bool]]:
        """The held slots of every buffer (on the CPU, in slot order) and the counters a
        fresh layer needs to continue exactly like this one (see ``load_state``)."""
        info = {"initialized": self.is_initialized, "seen": self.seen, "held": self.held,
                "size": self.size if self.is_initialized else 0,
                "has_padding": self.has_padding}
        tensors = {name: view.detach().cpu().contiguous()
                   for name in self._buffers if (view := getattr(self, name)) is not None}
        return tensors, info

    def check_state(self, tensors: dict[str, torch.Tensor], info: dict, where: str) -> None:
        """Raise ValueError naming ``where`` if ``load_state`` could not take this state."""
        counters = {"initialized": bool, "seen": int, "held": int, "size": int, "has_padding": bool}
        for key, kind in counters.items():
            if type(info.get(key)) is not kind:
                raise ValueError(f"{where}: {key} = {info.get(key)!r} must be {kind.__name__}")
        if not info["initialized"]:
            if tensors or info["seen"] or info["held"]:
                raise ValueError(f"{where}: an empty layer must hold no tokens")
            return
        names = {"keys", "values", "scores", "positions", "valid", "pinned"}
        if self.rope is not None:
            names.add("rotated_at")
        if set(tensors) != names:
            raise ValueError(f"{where}: tensors {sorted(tensors)}, expected {sorted(names)}")
        held, size, seen = info["held"], info["size"], info["seen"]
        if not 0 <= held <= min(size, seen):
            raise ValueError(f"{where}: held = {held} must be within 0..min(size {size}, seen {seen})")
        keys = tensors["keys"]
        if keys.dim() != 4 or keys.shape[2] != held or tensors["values"].shape[:3] != keys.shape[:3]:
            raise ValueError(f"{where}: keys/values of shape {tuple(keys.shape)}/"
                             f"{tuple(tensors['values'].shape)} do not hold {held} slots")
        kinds = {"scores": torch.float32, "positions": torch.long, "valid": torch.bool,
                 "pinned": torch.bool, "rotated_at": torch.long}
        for name in names - {"keys", "values"}:
            t = tensors[name]
            if t.shape != keys.shape[:3] or t.dtype != kinds[name]:
                raise ValueError(f"{where}: {name} is {t.dtype} {tuple(t.shape)}, expected "
                                 f"{kinds[name]} {tuple(keys.shape[:3])}")

    def load_state(self, tensors: dict[str, torch.Tensor], info: dict, device: torch.device | str) -> None:
        """Become the layer ``export_state`` described, on ``device``. Buffers get their
        saved size and slot order, so attention sees the same memory layout and the next
        logits are bit-identical; scores come back too, so later evictions match."""
        self.reset()
        if not info["initialized"]:
            return
        keys = tensors["keys"]
        self.dtype, self.device = keys.dtype, torch.device(device)
        held = self.held = info["held"]

        def allocate(t: torch.Tensor) -> torch.Tensor:
            buffer = t.new_zeros((t.shape[0], 1, t.shape[1], info["size"], *t.shape[3:]), device=self.device)
            buffer[:, 0, :, :held] = t
            return buffer

        SlotGroup([self], {name: allocate(t) for name, t in tensors.items()})
        self.seen, self.has_padding = info["seen"], info["has_padding"]
        self.is_initialized = True


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

    @property
    def budget_reached(self) -> bool:
        return self.budget is not None and self.held >= self.budget


class H2OCache(Cache):
    """A transformers ``Cache`` whose layers evict by an ``EvictionPolicy``."""

    def __init__(self, policy: EvictionPolicy, num_layers: int, rope: RopeShifter | None = None) -> None:
        self.policy = policy
        self.spans = ProtectedSpans()
        self.rolling = rope is not None
        super().__init__(layers=[H2OLayer(policy, self.spans, rope) for _ in range(num_layers)])

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._stack_layers()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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
            keys, values = layer._buffers["keys"], layer._buffers["values"]
            return (keys.device, keys.dtype, keys.shape[:2], keys.shape[3:], values.shape[3:])

        start = 0
        for end in range(1, len(layers) + 1):
            if end < len(layers) and alike(layers[end]) == alike(layers[start]):
                continue
            run = layers[start:end]
            if alike(run[0]) is not None and run[0].group.layers != run:
                SlotGroup.stack(run)
            start = end

    def _evict_all(self) -> None:
        groups = {id(layer.group): layer.group for layer in self.layers if layer.is_initialized}
        for group in groups.values():
            group.evict()

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
            for t in (getattr(layer, name) for name in layer._buffers)
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
        )

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What a fresh cache needs to continue exactly where this one is: tensors named
        ``layers.<i>.<buffer>`` (CPU, held slots only) and a JSON-able dict of the policy,
        rolling, protected spans and per-layer counters. Load it with ``load_state``."""
        tensors: dict[str, torch.Tensor] = {}
        layers = []
        for index, layer in enumerate(self.layers):
            layer_tensors, info = layer.export_state()
            tensors |= {f"layers.{index}.{name}": t for name, t in layer_tensors.items()}
            layers.append(info)
        info = {"settings": self.settings(), "protected": [list(span) for span in self.spans.ranges],
                "layers": layers}
        return tensors, info

    def settings(self) -> dict[str, int | str | bool]:
        """Policy, budgets and rolling: what a saved state must match to be loaded."""
        return self.policy.describe() | {"rolling": self.rolling}

    def check_settings(self, saved: dict, source: str = "the saved state") -> None:
        """ValueError naming the first setting where ``saved`` differs from this cache's."""
        ours = self.settings()
        for key in ["policy", *sorted((set(ours) | set(saved)) - {"policy"})]:
            if ours.get(key) != saved.get(key):
                raise ValueError(f"cache.{key} = {saved.get(key)!r} in {source}, "
                                 f"{ours.get(key)!r} in this cache")

    def load_state(self, tensors: dict[str, torch.Tensor], info: dict, device: torch.device | str = "cpu") -> None:
        """Replace everything this cache holds with a ``state()``, onto ``device``.

        The state must come from a cache with the same ``settings()`` (else ValueError
        naming the setting, the state's value and this cache's); everything is checked before anything changes, so a refused state leaves this
        cache as it was.
        """
        self.check_settings(info["settings"])
        if len(info["layers"]) != len(self.layers):
            raise ValueError(f"the saved state has {len(info['layers'])} layers, this cache {len(self.layers)}")
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        for name, t in tensors.items():
            match = re.fullmatch(r"layers\.(\d+)\.(\w+)", name)
            if match is None or int(match[1]) >= len(self.layers):
                raise ValueError(f"unexpected tensor {name!r} in the saved state")
            per_layer[int(match[1])][match[2]] = t
        for index, layer in enumerate(self.layers):
            layer.check_state(per_layer[index], info["layers"][index], f"layer {index}")
        seen = {layer_info["seen"] for layer_info in info["layers"]}
        if len(seen) != 1:
            raise ValueError(f"the saved layers have seen different token counts {sorted(seen)}")
        spans = [(start, end) for start, end in info["protected"]]
        if not all(type(x) is int and x >= 0 for span in spans for x in span):
            raise ValueError(f"protected spans {info['protected']!r} must be pairs of integers >= 0")
        for index, layer in enumerate(self.layers):
            layer.load_state(per_layer[index], info["layers"][index], device)
        self._stack_layers()
        self.spans.ranges[:] = spans  # in place: the layers share this object


def make_cache(model, policy: str = "h2o", rolling: bool = False, **budgets: int | str) -> H2OCache:
    """A fresh cache for ``model`` under ``policy`` (full, h2o, recent, sink).

    ``budgets`` are ``heavy``, ``recent`` and ``sink`` slot counts, and for h2o optionally
    ``score_norm`` ("sum" or "mean", see ``H2OPolicy``). ``rolling`` places
    cached tokens at their rank in the cache rather than their absolute position (see
    ``H2OLayer``), for conversations longer than the model's trained context. The model
    must use the registered ``h2o`` attention (``load_model`` sets it), which feeds the
    cache its scores.
    """
    from .attention import ATTENTION_NAME

    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != ATTENTION_NAME:
        raise ValueError(
            f"the model uses attention {config._attn_implementation!r}; the H2O cache needs "
            f"{ATTENTION_NAME!r}: load it with h2o_chat.load_model or call "
            f"register_h2o_attention() and model.set_attn_implementation({ATTENTION_NAME!r})"
        )
    unknown = set(budgets) - {"heavy", "recent", "sink", "score_norm"}
    if unknown:
        raise TypeError(f"unknown budget(s) {sorted(unknown)}; allowed: heavy, recent, sink, score_norm")
    chosen = make_policy(policy, **budgets)
    context = getattr(config, "max_position_embeddings", None)
    if chosen.capacity is not None and context and chosen.capacity > context:
        parts = " + ".join(f"{k} {v}" for k, v in chosen.describe().items() if k in ("heavy", "recent", "sink"))
        raise ConfigError(
            f"cache budget {parts} = {chosen.capacity} slots: must be at most the "
            f"model's context of {context} tokens (max_position_embeddings)", field="cache.heavy")
    rope = RopeShifter.from_model(model) if rolling else None
    return H2OCache(chosen, config.num_hidden_layers, rope)
