"""The scheduler's decode step: the next token of every conversation decoding, as one
batch whose work does not grow row by row.

Every conversation's cache is a row of a ``RowPool`` (one pool per buffer layout:
storage precision, rolling, bounded or not). A step

1. plans on the host, as plain data and without reading the device: per row the token,
   its position, the slot it goes to (its ``held``), whether it is pinned, the windows of
   its policy and whether a slot must go (``batch.py``: from the last step's plan by
   arithmetic over every row, while the same conversations decode);
2. runs on the device (``_run``): the new slots' bookkeeping for every layer at once;
   the model's forward pass, in which each layer writes its rows' new keys and values
   into the pools and attends over them where they lie, adding every row's attention
   mass to its scores in one operation (``_Rows``); then one eviction over every layer,
   row and KV head of each bounded pool, the rule of ``selection.py`` with per-row
   windows and rankings;
3. settles on the host: every row's counters advance as the plan said, in the batch's
   arrays (``layer.LiveCounts``), one operation for all rows.

On CUDA, step 2 for one layout of pools and rows is captured once as a CUDA graph and
then replayed (``graphs.py``): its shapes are static, since a bounded row holds at most
its budget plus the new token, and rows are padded to a few batch sizes (``padded``) so
that conversations joining and leaving rarely change the layout. Padding rows compute in
spare rows of their pool and are never read.
"""

from __future__ import annotations

import functools
import operator
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kernels
from .attention import hand_over, hiding_bias, scored_decode, sdpa_attention
from .batch import END, EVICTS, OPENED, PINNED, POSITION, RANKING, ROPE, SLOT, START, TOKEN, Segment, StepBatch
from .cache import H2OCache
from .graphs import StepGraphs
from .layer import write_bookkeeping
from .pool import RowPool, pool_signature
from .selection import lowest_slot, middle_slots, ranking_key
from .slots import drop_newest_into
from .stored import StoredSlots
from .window import as_ring, entry_rows, entry_slots, slot_buffers, window_name

# Batch sizes a captured step is padded to: about 1.4x apart, so at most about a third
# of a step computes padding, and a few dozen graphs cover every batch.
PADDED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


# A row's policy, read for every row of a segment in C.
_NEEDS_SCORES = operator.attrgetter("policy.needs_scores")
_RANKING = operator.attrgetter("policy.ranking")
_MARKS_TURNS = operator.attrgetter("policy.marks_turns")


def padded(rows: int) -> int:
    """The batch size a step of ``rows`` rows is computed at when captured."""
    return next((size for size in PADDED_SIZES if size >= rows), -(-rows // 512) * 512)


def why_not_stepped(cache) -> str | None:
    """Why ``cache`` cannot be a row of the decode step, or None where it can. What cannot
    is decoded alone: a multi-row cache, a policy scoring slots otherwise than by adding
    up the mass they receive, an observer of every attention call, eviction held."""
    if not isinstance(cache, H2OCache):
        return "not an H2OCache"
    if not cache.policy.sums_scores:
        return f"the {cache.policy.name} policy accumulates scores its own way"
    if any(layer.attention_observer is not None or layer.eviction_held for layer in cache.layers):
        return "an attention observer or eviction held"
    if len({(layer.seen, layer.held) for layer in cache.layers}) != 1:
        return "its layers hold different counts (a pass failed midway)"
    if pool_signature(cache) is None:
        return "its layers are not one group of one row"
    return None


class DecodeStep:
    """The decode step of one model's scheduler, with the pools and captured graphs it
    keeps from step to step (see the module docstring). Not thread-safe: the scheduler's
    worker is its one caller. ``graphs``: capture on CUDA (default: where the model is
    on CUDA); ``pad``: pad rows to ``PADDED_SIZES`` (default: where graphs are used)."""

    def __init__(self, graphs: bool | None = None, pad: bool | None = None) -> None:
        self._graphs_wanted, self._pad = graphs, pad
        self._graphs: StepGraphs | None = None
        self._batch: StepBatch | None = None  # the last step's rows
        self._pools: dict[tuple, RowPool] = {}
        # Where each cache was at the last step, so a step recognises its rows without
        # working out their layout again.
        self._rows: weakref.WeakKeyDictionary[H2OCache, tuple[tuple, RowPool]] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def __call__(self, model, caches: list[H2OCache], tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens[r]`` to ``caches[r]`` (every ``why_not_stepped`` None) at its next
        position; the logits ``(rows, vocab)`` of each, in the callers' order."""
        batch = self._batch
        if batch is None or not batch.serves(caches):
            # The rows still decoding carry on from the last batch: rows coming and going
            # cost a step about what the rows that come and go cost.
            batch = self._batch = StepBatch(self._segments(model, caches, batch), caches, batch)
        plan = batch.next_plan(tokens)
        logits = self._launch(model, batch.segments, torch.from_numpy(plan))
        batch.settle(plan)
        return batch.in_callers_order(logits)

    @torch.inference_mode()
    def join(self, caches: list[H2OCache], rows: int) -> None:
        """Make ``caches`` rows of their pools now, ahead of their first step, with room
        for ``rows`` rows in each pool: a large batch built one conversation at a time
        this way never holds every conversation's own buffers beside the pool."""
        for cache in caches:
            signature = self._signature(cache)
            pool = self._pool(signature)
            pool.admit(cache, rows)
            self._rows[cache] = (signature, pool)

    def partition(self, caches: list) -> tuple[list[int], list[int]]:
        """The indices of ``caches`` the step can take as rows, and of the others. A row
        of the last step still is one: what would stop it (eviction held, pins) lets go
        of its row first."""
        batch = self._batch
        if batch is not None and batch.serves(caches):
            return list(range(len(caches))), []
        carried = batch.carried(list(map(id, caches))) if batch is not None else [-1] * len(caches)
        alone = [i for i, index in enumerate(carried) if index < 0 and why_not_stepped(caches[i]) is not None]
        return sorted(set(range(len(caches))).difference(alone)), alone

    @torch.inference_mode()  # the pools' buffers are inference tensors
    def release(self, cache: H2OCache) -> None:
        """``cache``'s turn ends: it leaves its pool, into buffers of its own. The graphs
        captured over a pool that empties go with it (an idle server holds no step)."""
        if self._batch is not None:
            self._batch.let_go(cache)
            if not self._batch.live_rows:  # its last row: nothing to go on from
                self._batch = None  # nor to keep the ended rows' caches alive
        found = self._rows.pop(cache, None)
        if found is None:
            return
        pool = found[1]
        pool.release(cache)
        if not len(pool) and self._graphs is not None:
            self._graphs.forget(pool.serial)

    @property
    def spare_bytes(self) -> int:
        """Bytes the pools hold beyond their rows' caches (``RowPool.spare_bytes``): read
        from other threads, so from numbers the pools keep, not their buffers."""
        return sum(pool.spare_bytes for pool in list(self._pools.values()))

    @property
    def pools(self) -> list[RowPool]:
        return list(self._pools.values())

    @property
    def graph_replays(self) -> int:
        """Steps run by replaying a captured graph (0 without graphs)."""
        return 0 if self._graphs is None else self._graphs.replays

    @property
    def graph_failure(self) -> str | None:
        """Why capturing the step failed (every step then runs eagerly), or None."""
        return None if self._graphs is None else self._graphs.failure

    # ---- 1. the host plans ---------------------------------------------------------------

    def _segments(self, model, caches: list[H2OCache], previous: StepBatch | None) -> list[Segment]:
        """The pools' segments of a step of ``caches``; those that are rows of ``previous``
        (at their budget, with room for the next token) go on as they are. What goes over
        every row is a lookup a row: at thousands of rows, one that comes and one that goes
        must not cost a check, a stack or a copy of every row."""
        ids = list(map(id, caches))
        # The rows of ``previous`` lie in their pools still: whatever changes a cache lets go of its row first.
        last = previous.carried(ids) if previous is not None else [-1] * len(caches)
        carried = frozenset(key for key, index in zip(ids, last) if index >= 0)
        fresh = {i: self._signature(caches[i]) for i, index in enumerate(last) if index < 0}  # not carried
        signatures = {previous.segments[index].signature for index in set(last) if index >= 0}
        signatures.update(fresh.values())
        if len(signatures) == 1:  # one pool: its members in the callers' order
            by_pool = {signatures.pop(): caches}
        else:
            by_pool: dict[tuple, list[H2OCache]] = {}
            for i, (cache, index) in enumerate(zip(caches, last)):
                signature = previous.segments[index].signature if index >= 0 else fresh[i]
                by_pool.setdefault(signature, []).append(cache)
        segments, offset = [], 0
        for signature, members in by_pool.items():
            pool = self._pool(signature)
            rows = self.batch_rows(model, len(members))
            ordered, joined = pool.join(members, rows, carried)
            for row, cache in joined:
                self._rows[cache] = (signature, pool)
                cache.evict_to_budget()
                pool.give_room(row, cache.layers[0].held + 1)
            first = ordered[0].layers[0]
            segments.append(Segment(
                pool, ordered, rows, offset, first.storage, first.rope, first.key_rotation is not None,
                scored=any(map(_NEEDS_SCORES, ordered)), bounded=signature[1],
                rankings=frozenset(map(_RANKING, ordered)), turns=any(map(_MARKS_TURNS, ordered)),
                signature=signature))
            offset += rows
        return segments

    def _pool(self, signature: tuple) -> RowPool:
        if signature not in self._pools:
            self._pools[signature] = RowPool()
        return self._pools[signature]

    def _signature(self, cache: H2OCache) -> tuple:
        known = self._rows.get(cache)
        if known is not None and known[1].holds(cache):
            return known[0]
        signature = pool_signature(cache)
        if signature is None:
            raise ValueError(f"this cache cannot be a row of the decode step: {why_not_stepped(cache)}")
        return signature

    # ---- 2. the device runs ----------------------------------------------------------------

    def batch_rows(self, model, rows: int) -> int:
        """The rows a step of ``rows`` conversations computes (padded where captured)."""
        return padded(rows) if self._pads(model) else rows

    def _pads(self, model) -> bool:
        return self._pad if self._pad is not None else self._use_graphs(model)

    def _use_graphs(self, model) -> bool:
        wanted = self._graphs_wanted
        return model.device.type == "cuda" if wanted is None else wanted

    def _launch(self, model, segments: list[Segment], plan: torch.Tensor) -> torch.Tensor:
        def run(inputs: torch.Tensor) -> torch.Tensor:
            return _run(model, segments, inputs)

        if not self._use_graphs(model):
            return run(plan.to(model.device))
        if self._graphs is None:
            self._graphs = StepGraphs(model.device)
        return self._graphs.run(tuple(seg.key for seg in segments), plan, run)


def _run(model, segments: list[Segment], inputs: torch.Tensor) -> torch.Tensor:
    """2. The device's part of a step, from the plan ``inputs`` (on the model's device):
    the logits ``(batch rows, vocab)``. Nothing here reads the device or changes host
    state, so it can be captured and replayed."""
    steps = [_Rows(seg, inputs[seg.offset : seg.offset + seg.rows]) for seg in segments]
    for rows in steps:
        rows.write_bookkeeping()
    mask = torch.ones((inputs.shape[0], 1, 1, 1), dtype=torch.bool, device=inputs.device)
    out = model(input_ids=inputs[:, TOKEN : TOKEN + 1], position_ids=inputs[:, ROPE : ROPE + 1],
                # A prepared mask: transformers builds none (each row's own comes from its plan).
                attention_mask=mask, past_key_values=_StepCache(steps, len(segments[0].caches[0].layers)),
                use_cache=True, logits_to_keep=1)
    for rows in steps:
        rows.store_new()
        if rows.seg.bounded:
            rows.evict()
    return out.logits[:, -1]


class _Rows:
    """A segment's device work in one step: its plan's tensors, made once for every layer."""

    def __init__(self, seg: Segment, plan: torch.Tensor) -> None:
        self.seg, self.plan = seg, plan
        count = seg.rows
        device = plan.device
        self.slot = plan[:, SLOT]
        size = seg.pool.size
        self.lengths = self.slot + 1  # each row's live slots: the first ``slot + 1``
        self.live = torch.arange(size, device=device) < self.lengths[:, None]  # (rows, slots)
        self.visible = self.live[:, None, None, :]
        # The new slot of each row, in one layer's (rows, kv_heads, size) buffers.
        self.at = (torch.arange(count, device=device), slice(None), self.slot)
        self.buffers = {name: t[:, :count] for name, t in seg.pool.buffers.items()}
        self.layers = [dict(zip(self.buffers, views)) for views in zip(*(t.unbind(0) for t in self.buffers.values()))]
        self.new: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}  # by layer, see ``write``
        # The fused kernel reads the new tokens as given, so even floats stored as they are
        # wait for ``store_new``: two writes a step instead of two a layer (launches are
        # what a step of few rows on a GPU waits for).
        self.kernel_reads_new = seg.scored and kernels.load("decode_kernel", device) is not None
        self.entries: torch.Tensor | None = None  # the slot of each exact window entry, every layer
        self.entry_rows: torch.Tensor | None = None  # the same as rows of a layer's read (``window.entry_rows``)

    def per_row(self, field: int) -> torch.Tensor:
        """Plan column ``field`` shaped to broadcast over ``(layers, rows, kv_heads, slots)``."""
        return self.plan[:, field].view(1, -1, 1, 1)

    def write_bookkeeping(self) -> None:
        """The new slots' score, position and flags in every layer at once."""
        every_layer = (slice(None), *self.at)  # selects (rows, layers, kv_heads)
        as_rows = (self.seg.rows, 1, 1)
        write_bookkeeping(self.buffers, every_layer, self.plan[:, POSITION].view(as_rows),
                          self.plan[:, PINNED].bool().view(as_rows))
        if "rotated_at" in self.buffers:
            self.buffers["rotated_at"][every_layer] = self.slot.view(as_rows)
        # Every layer's at once: positions do not move until the step evicts.
        self.entries = entry_slots(self.buffers, self.plan[:, POSITION].view(as_rows) + 1, self.slot.view(as_rows))
        if self.entries is not None:
            self.entry_rows = entry_rows(self.entries, self.seg.pool.size)

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Layer ``layer``'s new keys and values (the segment's batch rows of the model's
        ``(batch, kv_heads, 1, head_dim)``): into the rows' new slots where stored as they
        are and read by torch's operations; else kept aside (``attend`` uses them as
        given, ``store_new`` stores the step's new tokens of every layer at once)."""
        seg = self.seg
        new = {"keys": key_states[seg.offset : seg.offset + seg.rows, :, 0],
               "values": value_states[seg.offset : seg.offset + seg.rows, :, 0]}
        for name, codec in (("keys", seg.storage.keys), ("values", seg.storage.values)):
            if codec.exact(key_states.dtype) and not self.kernel_reads_new:
                codec.write_at(self.layers[layer], name, self.at, new[name])
            else:
                self.new[name].append(new[name])

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The rows' attention over every slot of their pool rows, the slots past each
        row's own masked out (they receive exactly zero); the mass each slot receives is
        added to its score, every row at once."""
        seg, buffers = self.seg, self.layers[layer]
        entries, rows = (None, None) if self.entries is None else (self.entries[layer], self.entry_rows[layer])
        rotation = (seg.rope, buffers["rotated_at"]) if seg.rope is not None and not seg.rotates_in_place else None
        # The new tokens as the model gave them, over what is stored in their slots.
        keys, values = (StoredSlots(codec, buffers, name, entries, self.new[name][layer] if self.new[name] else None,
                                    self.at, rotation if name == "keys" else None, rows)
                        for name, codec in (("keys", seg.storage.keys), ("values", seg.storage.values)))
        if not seg.scored:
            return sdpa_attention(query, keys.read(query.dtype), values.read(query.dtype), self.visible, scaling)
        # Slots of closed turns keep their final scores.
        counted = buffers["positions"] >= self.plan[:, OPENED].view(-1, 1, 1) if seg.turns else None
        # The kernel reads ``lengths``: the mask serves only a call it cannot take.
        mask = self.visible if self.kernel_reads_new else self.hiding_bias
        return scored_decode(query, keys, values, self.lengths, mask, scaling, buffers["scores"], counted)

    @functools.cached_property
    def hiding_bias(self) -> torch.Tensor:
        """``visible`` as the logits' bias, made once for every layer of the step, by the
        first attention that reads it in torch."""
        return hiding_bias(self.visible)

    def store_new(self) -> None:
        """The step's new tokens kept aside, every layer's in one write per buffer."""
        seg = self.seg
        every_layer = (slice(None), *self.at)  # selects (rows, layers, kv_heads)
        for name, codec in (("keys", seg.storage.keys), ("values", seg.storage.values)):
            if not self.new[name]:
                continue
            new = torch.stack(self.new[name])  # (layers, rows, kv_heads, head_dim)
            if name == "keys" and seg.rope is not None and not seg.rotates_in_place:
                # Stored unrotated (rotated when read): undo the model's rotation at the rank.
                new = seg.rope.shift(new, -self.plan[None, :, ROPE, None].expand(new.shape[:3]))
            codec.write_at(self.buffers, name, every_layer, new.transpose(0, 1))
            ring = self.buffers.get(window_name(name))
            if ring is not None:  # after attention: the entry held the token R positions back
                entry = self.plan[:, POSITION] % ring.shape[3]
                ring[:, self.at[0], :, entry] = as_ring(new.transpose(0, 1), ring)

    def evict(self) -> None:
        """Where a row is over budget, the lowest-ranked middle slot of every layer and
        KV head goes and the new slot moves into it: one pass over every layer and row."""
        seg, buffers = self.seg, slot_buffers(self.buffers)
        rope = seg.rope if seg.rotates_in_place else None
        drop_newest_into(buffers, self.lowest_slot(buffers), self.per_row(SLOT), self.per_row(EVICTS).bool(), rope)

    def lowest_slot(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The slot each layer, row and KV head would drop: the rule of ``selection.py``
        with each row's windows and ranking; one kernel on a GPU (``evict_kernel``)."""
        seg, scores, positions, pinned = self.seg, buffers["scores"], buffers["positions"], buffers["pinned"]
        kernel = kernels.load("evict_kernel", scores.device)
        if kernel is not None and kernel.usable(scores, positions, pinned):
            return kernel.lowest_slot(scores, positions, pinned, self.plan, seg.rankings, seg.turns)
        ranking = next(iter(seg.rankings)) if len(seg.rankings) == 1 else self.per_row(RANKING)
        key = ranking_key(ranking, scores, positions, self.per_row(POSITION) + 1, seg.rankings,
                          self.per_row(OPENED) if seg.turns else 0)
        middle = middle_slots(positions, pinned, self.per_row(START), self.per_row(END), self.live[None, :, None, :])
        return lowest_slot(key, positions, middle)


class _StepLayer(CacheLayerMixin):
    """Layer ``index`` of every row of a step, as transformers sees it."""

    def __init__(self, steps: list[_Rows], index: int) -> None:
        super().__init__()
        self.steps, self.index = steps, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        for rows in self.steps:
            rows.write(self.index, key_states, value_states)
        hand_over(self)
        # The attention call reads the pools; these are only what the model passes along.
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, None]:
        hand_over(None)
        if len(self.steps) == 1:
            return self.steps[0].attend(self.index, query, scaling), None
        return torch.cat([rows.attend(self.index, query[rows.seg.offset : rows.seg.offset + rows.seg.rows], scaling)
                          for rows in self.steps]), None

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class _StepCache(Cache):
    def __init__(self, steps: list[_Rows], num_layers: int) -> None:
        super().__init__(layers=[_StepLayer(steps, index) for index in range(num_layers)])
