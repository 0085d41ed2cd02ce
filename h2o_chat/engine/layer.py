"""One decoder layer's bounded cache, as transformers sees it: ``H2OLayer``.

Data path per attention call: the model calls ``H2OCache.update`` -> ``H2OLayer.update``
appends the new keys/values (score 0) and hands itself over to the attention call that
follows in this thread -> the registered attention function (``attention.py``) computes
the softmax probabilities and gives them to ``H2OLayer.receive`` -> the layer's policy
accumulates the mass each slot received into its score -> after the last layer of its
``SlotGroup`` (neighbouring layers with stacked buffers, ``slots.py``), the group evicts
down to budget, every layer by its own scores. This is the path of prompt chunks and of
a cache used on its own (``model.generate``); the scheduler's decode step runs every
conversation's next token through ``step.py`` instead, on the same buffers.

Every layer keeps, per batch row and KV head, the absolute position of each slot, so
stats and tests can say exactly which tokens are kept.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention import awaiting_attention, hand_over, scored_attention, sdpa_attention, slot_mask
from .memory import tensor_bytes
from .policies import EvictionPolicy
from .quant import KVStorage
from .rope import RopeShifter
from .slots import ROLLING_METADATA, SLOT_METADATA, RowBounds, SlotGroup, grown_size
from .spans import ProtectedSpans
from .turns import TurnMarks
from .window import entry_rows, entry_slots, length, read_slots, window_name, write_newest


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


class LiveCounts:
    """Where a cache's counters live while the decode step holds its row: in the step's
    arrays ``records.seen[record]`` and ``records.held[record]`` (``batch.Records``),
    which it advances for every row at once rather than layer by layer. ``leave`` hands
    them back to the layers (and tells the step)."""

    def __init__(self, records, record: int) -> None:
        self.records, self.record = records, record

    def leave(self) -> None:
        self.records.leave(self.record)


class Counted:
    """A layer's counter (``seen``: tokens seen; ``held``: slots in use, the first ``held``
    of the buffers): the layer's own, or the decode step's while it holds the layer's
    row (``LiveCounts``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.own = name, f"_{name}"

    def __get__(self, layer: H2OLayer | None, owner: type | None = None) -> int:
        if layer is None:
            return self
        live = layer.live
        return getattr(layer, self.own) if live is None else int(getattr(live.records, self.name)[live.record])

    def __set__(self, layer: H2OLayer, value: int) -> None:
        live = layer.live
        if live is None:
            setattr(layer, self.own, value)
        else:
            getattr(live.records, self.name)[live.record] = value


class H2OLayer(CacheLayerMixin):
    """One layer's slots: keys, values, accumulated scores, absolute positions and flags.

    The attributes ``keys``, ``values``, ``scores`` (float32), ``positions``, ``valid``
    (False for padding) and ``pinned`` are views of the ``held`` slots in use of buffers
    that the layer's ``SlotGroup`` owns. Shapes: keys/values ``(batch, kv_heads, held,
    head_dim)``, the others ``(batch, kv_heads, held)``. Keys and values are stored as
    ``storage`` says (``quant.py``): quantized, ``keys``/``values`` hold the codes and
    ``keys_scale``/``keys_min`` (and the values') their groups' scales, and attention
    reads them dequantized (``read``), the newest tokens from the exact window's rings
    ``window_keys``/``window_values`` where the storage keeps one (``window.py``).

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
    seen, held = Counted(), Counted()

    def __init__(self, policy: EvictionPolicy, spans: ProtectedSpans, rope: RopeShifter | None = None,
                 storage: KVStorage = KVStorage(), turns: TurnMarks | None = None) -> None:
        # Not CacheLayerMixin.__init__: it assigns ``keys`` and ``values``, which here are
        # views of the slot buffers.
        self.is_initialized = False
        self.policy = policy
        self.spans = spans
        self.turns = turns or TurnMarks()
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
        self.live: LiveCounts | None = None  # set while the decode step holds the counters
        self._seen = 0
        self._held = 0
        self._buffers: dict[str, torch.Tensor] = {}
        self.has_padding = False  # lets unpadded decoding skip building a mask
        # Called with the probabilities of every attention call (see ``receive``), even
        # under a policy that needs no scores; e.g. the fidelity probe's full cache.
        self.attention_observer: Callable[[torch.Tensor], None] | None = None

    def __deepcopy__(self, memo: dict) -> H2OLayer:
        # A copy owns its counters, never the decode step's arrays (nor the step with them).
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        state = {name: value for name, value in self.__dict__.items() if name != "live"}
        state |= {"_seen": self.seen, "_held": self.held, "live": None}
        twin.__dict__.update({name: copy.deepcopy(value, memo) for name, value in state.items()})
        return twin

    # ---- transformers' layer interface -------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        slots = (batch, heads, 0)
        metadata = SLOT_METADATA | (ROLLING_METADATA if self.rope is not None else {})
        window = self.storage.window_layout(key_states.shape[-1], self.dtype)
        empty = {
            **self.storage.keys.empty("keys", slots, key_states.shape[-1], self.device, self.dtype),
            **self.storage.values.empty("values", slots, value_states.shape[-1], self.device, self.dtype),
            **{name: torch.zeros(slots, dtype=dtype, device=self.device) for name, dtype in metadata.items()},
            **{name: torch.zeros((batch, heads, self.storage.exact_window, dim), dtype=dtype, device=self.device)
               for name, (dtype, dim) in window.items()},
        }
        self.held = 0
        SlotGroup.alone(self, empty, size=0)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.live is not None:
            self.live.leave()  # the cache takes a token on its own: the step's arrays let go
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
        stored_keys = key_states
        if self.rope is not None:
            # New tokens go right after the held slots, whatever their absolute position.
            self._query_shift = start - self.seen
            if self.key_rotation is None:  # stored unrotated
                stored_keys = self.rope.shift(key_states, -positions.expand(*key_states.shape[:2], -1))
            if self._query_shift:
                key_states = self.rope.shift(key_states, self._query_shift)
            if self.key_rotation is not None:
                stored_keys = key_states
            buffers["rotated_at"][:, :, start:end] = torch.arange(start, end, device=self.device)
        at = (slice(None), slice(None), slice(start, end))
        self.storage.keys.write_at(buffers, "keys", at, stored_keys)
        self.storage.values.write_at(buffers, "values", at, value_states)
        for name, given in (("keys", stored_keys), ("values", value_states)):
            if window_name(name) in buffers:
                write_newest(buffers[window_name(name)], positions, given)
        write_bookkeeping(buffers, at, positions, self.spans.contains(positions))
        self.seen += new
        self.held = end
        hand_over(self)
        keys, values = self.read(dtype)
        # This pass attends its own tokens as the model gave them; later passes read them
        # as stored (the decode step does the same, and can then store a step's new tokens
        # of every layer at once).
        if not self.storage.keys.exact(dtype):
            keys[:, :, start:end] = key_states
        if not self.storage.values.exact(dtype):
            values[:, :, start:end] = value_states
        return keys, values

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The held slots' keys and values as attention uses them, in ``dtype``: the
        stored ones where kept as given, else dequantized (one pass over the held slots),
        the exact window's tokens as the model gave them."""
        held = self.held_slots()
        # A read follows the pass's ``update``: its newest token is in the last held slot.
        entries = entry_slots(held, self.seen, self.held - 1)
        rows = None if entries is None else entry_rows(entries, self.held)
        keys = read_slots(self.storage.keys, held, "keys", dtype, rows)
        if self.rope is not None and self.key_rotation is None:
            keys = self.rope.shift(keys, self.rotated_at)
        return keys, read_slots(self.storage.values, held, "values", dtype, rows)

    def get_seq_length(self) -> int:
        # Tokens seen, not slots held: generate and the model derive positions from it.
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, self.seen - self.held

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.live is not None:
            self.live.leave()
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

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_buffers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_buffers(lambda t: t[indices, ...])

    # ---- the attention call (``attention.AttentionClient``) ------------------------------

    @property
    def wants_probabilities(self) -> bool:
        return self.policy.needs_scores or self.attention_observer is not None

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` over the held slots ``key``/``value`` (what ``update``
        returned); the layer then scores and evicts."""
        query_len = query.shape[2]
        if attention_mask is not None:
            # The last query row sees every real new token, so it tells which are padding.
            self._mark_padding(attention_mask[:, 0, -1, -query_len:])
        if self._query_shift:
            query = self.rope.shift(query, self._query_shift)
        valid = self.valid if self.has_padding else None
        if self.wants_probabilities:
            mask = slot_mask(valid, attention_mask, query_len, key, narrow=True)
            output, probabilities = scored_attention(query, key, value, mask, scaling, hides_rows=self.has_padding)
            self.receive(probabilities)
            return output, probabilities.flatten(1, 2)
        output = sdpa_attention(query, key, value, slot_mask(valid, attention_mask, query_len, key), scaling)
        self.receive(None)
        return output, None

    def receive(self, probabilities: torch.Tensor | None) -> None:
        """The end of this layer's attention call: ``probabilities`` ``(batch, kv_heads,
        groups, query, held)`` float32 where the layer wanted them, else None. The
        observer sees them, the policy folds each slot's received mass into its score,
        and the last layer of the group then evicts the group to budget."""
        hand_over(None)
        if probabilities is not None:
            if self.attention_observer is not None:
                self.attention_observer(probabilities)
            received = probabilities.sum(dim=(2, 3))
            if self.turns.opened:  # closed turns' scores are final
                received = received * (self.positions >= self.turns.opened)
            self.policy.accumulate(self.scores, received)
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

    @property
    def pinned_slots(self) -> int:
        """Slots held by protected tokens: every protected position seen so far (one
        cannot be protected once evicted), the same number in every head of every row."""
        return self.spans.covered(self.seen)

    def eviction_rule(self) -> tuple[int | None, RowBounds]:
        rules = self.policy.row_rules(self._buffers["keys"].shape[0])
        windows = {rule: self.spans.windows(self.seen, rule.sink, rule.recent) for rule in set(rules)}
        if len(windows) == 1:
            (rule, (start, end)), = windows.items()
            return self.policy.capacity, RowBounds(self.pinned_slots, self.seen, start, end, rule.ranking,
                                                   self.turns.opened)

        def per_row(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, device=self.device).view(-1, 1, 1)

        return self.policy.capacity, RowBounds(
            self.pinned_slots, self.seen, per_row([windows[rule][0] for rule in rules]),
            per_row([windows[rule][1] for rule in rules]), per_row([rule.ranking for rule in rules]),
            self.turns.opened)

    def held_slots(self) -> dict[str, torch.Tensor]:
        """The held slots of every slot buffer, and the exact window's rings whole."""
        return {name: buffer[:, :, : length(name, None, self.held)] for name, buffer in self._buffers.items()}

    def held_slot(self, name: str) -> torch.Tensor | None:
        """The held slots of slot buffer ``name``, None where the layer has no such buffer."""
        buffer = self._buffers.get(name)
        return None if buffer is None else buffer[:, :, : self.held]

    def adopt(self, group: SlotGroup, buffers: dict[str, torch.Tensor], closes_group: bool) -> None:
        self.group, self.closes_group, self._buffers = group, closes_group, buffers

    # ---- the cache's side --------------------------------------------------------------

    def allocated_bytes(self) -> int:
        """Bytes of every buffer this layer holds, including room reserved for new tokens."""
        return tensor_bytes(self._buffers.values())

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


def write_bookkeeping(buffers: dict[str, torch.Tensor], at: tuple, positions: torch.Tensor,
                      pinned: torch.Tensor) -> None:
    """New slots' bookkeeping at index ``at`` of the buffers: no score yet, their absolute
    ``positions``, real tokens, ``pinned`` where protected (both shaped to broadcast
    over what ``at`` selects)."""
    # Values made on the device: a Python number would be copied from host memory, which
    # a CUDA graph cannot capture.
    device = buffers["scores"].device
    buffers["scores"][at] = torch.zeros((), dtype=torch.float32, device=device)
    buffers["positions"][at] = positions
    buffers["valid"][at] = torch.ones((), dtype=torch.bool, device=device)
    buffers["pinned"][at] = pinned
