"""A bounded KV cache for stock transformers models: an ``H2OCache`` of ``H2OLayer``s.

The cache holds what is the conversation's as a whole: the policy, the protected spans,
rolling and storage settings, the byte budget; it stacks its layers' slot buffers into
one ``SlotGroup`` so they evict together, pins and unpins, and reports ``stats``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .budget import ByteBudget, token_bytes, window_bytes
from .layer import H2OLayer
from .memory import freed
from .policies import EvictionPolicy
from .quant import KVStorage
from .rope import RopeShifter
from .selection import RANK_MEAN
from .slots import SlotGroup
from .spans import ProtectedSpans
from .state import CacheStateMixin
from .stats import CacheStats, LayerStats
from .turns import TurnMarks

# Room a cache that never evicts keeps for a reply's tokens: it grows by this much at a
# time as it decodes (in the decode step, with its pool).
DECODE_ROOM = 64


class H2OCache(CacheStateMixin, Cache):
    """A transformers ``Cache`` whose layers evict by an ``EvictionPolicy``; saved and
    resumed with ``state``/``load_state`` (``state.py``)."""

    def __init__(self, policy: EvictionPolicy, num_layers: int, rope: RopeShifter | None = None,
                 storage: KVStorage = KVStorage(), byte_budget: ByteBudget | None = None) -> None:
        self.policy = policy
        self.spans = ProtectedSpans()
        self.turns = TurnMarks()
        self.rolling = rope is not None
        self.storage = storage
        # With a budget in bytes, pinned tokens take their slots from the policy's share
        # (``_fit_budget``), so the cache holds at most the budget's tokens at rest.
        self.byte_budget = byte_budget
        super().__init__(layers=[H2OLayer(policy, self.spans, rope, storage, self.turns)
                                 for _ in range(num_layers)])

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._close_turn()
            self._stack_layers()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def mark_turn(self, position: int) -> None:
        """A turn begins at token ``position`` (not fed yet); a cache whose policy keeps
        scores to their turn (``turns.py``) closes the turn before it on reaching it."""
        if self.policy.marks_turns:
            self.turns.mark(position)

    def forget_turns_from(self, position: int) -> None:
        """The tokens from ``position`` on were taken back: so are the turns they began."""
        self.turns.forget_from(position)

    def turn_start_after(self, position: int) -> int | None:
        """Where the next turn after ``position`` begins, if marked: a pass must not
        straddle it, since the turn before closes there."""
        return self.turns.next_start_after(position)

    def _close_turn(self) -> None:
        """Close the open turn if this pass begins a later one: its slots' scores become
        final, as the mass per query each received in its turn where the policy ranks by
        the mean."""
        turns, seen = self.turns, self.seen
        start = turns.start_at_or_before(seen)
        if start <= turns.opened:
            return
        self.leave_step()
        if self.policy.ranking == RANK_MEAN:
            with torch.inference_mode():
                for layer in self.layers:
                    if layer.is_initialized:
                        scores, positions = layer.scores, layer.positions
                        received = (seen - positions).clamp(min=1).to(scores.dtype)
                        scores.copy_(torch.where(positions >= turns.opened, scores / received, scores))
        turns.opened = start

    def leave_step(self) -> None:
        """Take the counters back from the decode step, if it holds them: whatever changes
        the cache outside the step (pins, eviction held, a reset) starts here."""
        live = self.layers[0].live
        if live is not None:
            live.leave()

    def fit_for_decoding(self) -> None:
        """Size the buffers for decoding once a prompt is in. A bounded cache: its budget,
        pins and one token. It takes a chunk on top of its budget before evicting, so its
        buffers grow to budget plus a chunk (twice the budget after a long message); kept,
        that room doubled the memory of every idle conversation and of every ``RowPool``
        row. After a short prompt they hold less than the budget: grown now, a
        conversation decodes in buffers of one size, whatever its prompt, so the decode
        step computes the same shapes for it every time. A cache that never evicts: what
        it holds and ``DECODE_ROOM`` more (its buffers double as a prompt goes in). The next
        prompt grows them again (one copy)."""
        capacity = self.policy.capacity
        for group in self._groups():
            layers = group.layers
            held = max(layer.held for layer in layers)
            # Held past the budget (eviction held over a prompt fed in passes): all stay.
            size = held + DECODE_ROOM if capacity is None else max(capacity + layers[0].pinned_slots, held) + 1
            if layers[0].size != size:
                self.leave_step()
                before = group.nbytes
                group.resize(size)
                freed(before)  # else glibc keeps the larger buffers just freed

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more tokens in a cache that never evicts, so it does not move
        to bigger buffers as it grows (in the decode step: its whole pool, the rows beside
        it included). A bounded cache decodes in buffers of its budget and needs none."""
        if self.policy.capacity is not None:
            return
        self.leave_step()
        for group in self._groups():
            needed = max(layer.held for layer in group.layers) + tokens
            if group.layers[0].size < needed:
                group.resize(needed)

    def whole_group(self) -> SlotGroup | None:
        """The ``SlotGroup`` of every layer, where one holds them all (a bounded cache once
        every layer holds its first tokens), else None."""
        group = self.layers[0].group
        return group if group is not None and len(group) == len(self.layers) else None

    def stacked(self) -> SlotGroup | None:
        """The one group of every layer, stacking them where they are alike, whatever the
        policy (the decode step reads a conversation's layers as one); None where they
        cannot be one group (a layer without tokens yet, layers unlike each other)."""
        self._stack_layers(unbounded_too=True)
        return self.whole_group()

    def unstack(self) -> None:
        """Give a cache that never evicts a group per layer again (see ``_stack_layers``)."""
        group = self.whole_group()
        if self.policy.capacity is None and group is not None:
            group.dissolve()

    def _stack_layers(self, unbounded_too: bool = False) -> None:
        """Put each run of neighbouring layers that share device, dtype and shapes into one
        ``SlotGroup`` (all layers, on one device), so the run evicts at once. Runs are
        maximal, so an existing group always lies inside one run.

        A cache that never evicts stays unstacked unless ``unbounded_too``: it would gain
        nothing, and every time it grows a stacked group holds the old and the new buffers
        of all layers at once.
        """
        layers = self.layers
        if (self.policy.capacity is None and not unbounded_too) or len(layers[0].group or ()) == len(layers):
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

    def evict_to_budget(self) -> None:
        """Evict down to budget where some layer holds more (a chunk fed with eviction held
        and never released); the decode step drops at most one slot per head."""
        capacity = self.policy.capacity
        if capacity is not None and any(layer.held - layer.pinned_slots > capacity for layer in self.layers):
            self._evict_all()

    def hold_eviction(self, hold: bool) -> None:
        """While held, forward passes score but do not evict: one prefill chunk fed in
        several passes then keeps exactly what one pass would (every query sees the same
        slots, and the scores add up to the same). Releasing evicts down to budget."""
        self.leave_step()
        for layer in self.layers:
            layer.eviction_held = hold
        if not hold:
            self._evict_all()

    def reset(self) -> None:
        self.turns.opened = 0  # fed again from the start, the turns close again as it goes
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
        self.leave_step()
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
        self.leave_step()
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

    def peak_bytes(self, model: torch.nn.Module, tokens: int, chunk: int, pinning: int = 0) -> int:
        """The most bytes this cache's buffers take while it reads up to ``tokens`` tokens
        in all, ``chunk`` at a time, ``pinning`` more of them pinned: a bounded cache its
        budget and pins (it decodes in buffers of that size whatever it holds), and one
        chunk read on top before it evicts; one that never evicts twice what it reads,
        since its buffers double as they grow. Either has the decode room on top, which
        the decode step's rows may give it."""
        capacity = self.policy.capacity
        if capacity is None:
            slots = 2 * tokens
        else:
            budget = capacity + self.spans.covered() + pinning
            slots = max(budget, min(tokens, budget + chunk))
        slots += DECODE_ROOM
        return window_bytes(model, self.storage) + slots * token_bytes(model, self.storage, self.rolling)

    def allocated_bytes(self) -> int:
        """Bytes of every layer's buffers, room for incoming tokens included."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def stats(self) -> CacheStats:
        budget = self.policy.capacity
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
        kv_bytes = self.allocated_bytes()
        held_bytes = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.is_initialized
            for t in layer.held_slots().values()
        )
        if budget is not None:
            # A budget in bytes holds every pin, fed or not (``_fit_budget``): counting only
            # the fed ones showed a smaller budget until a chat's first send.
            budget += pinned if self.byte_budget is None else self.spans.covered()
        return CacheStats(
            policy=self.policy.describe(),
            seen=self.seen,
            held=first.held,
            pinned=pinned,
            budget=budget,
            kv_bytes=kv_bytes,
            held_bytes=held_bytes,
            layers=layers,
            key_bits=self._bits(self.storage.key_bits, "keys"),
            value_bits=self._bits(self.storage.value_bits, "values"),
            budget_bytes=None if self.byte_budget is None else self.byte_budget.bytes,
            exact_window=self.storage.exact_window,
            turn_starts=list(self.turns.starts),  # marked only where the policy keeps turns
        )

    def _bits(self, bits: int | None, name: str) -> int | None:
        first = self.layers[0]
        if bits is None and first.is_initialized:
            return getattr(first, name).element_size() * 8
        return bits
