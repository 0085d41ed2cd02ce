"""The rows of the decode step, kept from one step to the next: which pool row each
conversation sits in, and its plan (what the host tells the device about each row).

Planning a row from its cache (``plan_row``: its counters, pins and policy) takes a few
microseconds a row, which at thousands of rows is more than a GPU's whole step. Between
two steps of the same conversations nothing but the step changes their caches, so the
next plan follows from the last by arithmetic over every row at once (numpy), and the
counters that each row's layers would advance live in two arrays of the batch meanwhile
(``layer.LiveCounts``). A row is planned from its cache again only where arithmetic does
not tell: its recent window meets a pinned span, its sink is not filled yet, it needs
more room (a cache that never evicts), or it has just joined.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .cache import DECODE_ROOM, H2OCache
from .layer import LiveCounts
from .pool import RowPool
from .quant import KVStorage
from .rope import RopeShifter

# The columns of a step's plan, one row of integers per batch row.
TOKEN, ROPE, SLOT, POSITION, PINNED, START, END, EVICTS, RANKING, OPENED = range(10)
FIELDS = 10


@dataclass
class Segment:
    """One pool's rows in a step: batch rows ``offset .. offset + rows`` are the pool's rows
    ``0 .. rows``, of which the first ``len(caches)`` are the conversations' (the rest pad
    the batch to a captured size, never read)."""

    pool: RowPool
    caches: list[H2OCache]
    rows: int
    offset: int
    storage: KVStorage
    rope: RopeShifter | None  # rolling: the model's rotary frequencies
    rotates_in_place: bool  # rolling keys kept rotated (else rotated when read)
    scored: bool  # some row's policy ranks by attention mass
    bounded: bool
    rankings: frozenset[int]
    turns: bool  # some row's scores stay with their turn (``turns.py``)

    @property
    def key(self) -> tuple:
        """What a captured step of this segment depends on beyond its plan."""
        return (self.pool.serial, self.pool.generation, self.rows, self.scored, self.rankings, self.turns)


def plan_row(cache: H2OCache, token: int) -> list[int]:
    """The plan of one conversation's row (see ``FIELDS``), from its cache: host values only."""
    layer = cache.layers[0]
    seen, held, policy, spans = layer.seen, layer.held, cache.policy, cache.spans
    rule = policy.row_rules(1)[0]
    pinned = spans.covers(seen)
    start, end = spans.windows(seen + 1, rule.sink, rule.recent)
    capacity = policy.capacity
    evicts = capacity is not None and held + 1 - layer.pinned_slots - pinned > capacity
    # Rolling: the new token sits right after the held slots, so the model rotates its
    # key and query at that rank instead of its absolute position.
    rope_position = held if cache.rolling else seen
    return [token, rope_position, held, seen, pinned, start, end, evicts, rule.ranking, cache.turns.opened]


class StepBatch:
    """The rows of ``segments``, ``caches`` in the callers' order (see the module docstring).
    ``previous``: the last step's batch, whose rows still decoding carry on from where it
    left them (their counters and plans, no cache read); its others are let go."""

    def __init__(self, segments: list[Segment], caches: list[H2OCache], previous: StepBatch | None = None) -> None:
        self.segments, self.ids = segments, tuple(map(id, caches))
        rows = sum(seg.rows for seg in segments)
        self.members: list[tuple[H2OCache, Segment, int] | None] = [None] * rows  # by batch row
        for seg in segments:
            for index, cache in enumerate(seg.caches):
                self.members[seg.offset + index] = (cache, seg, index)
        self._row_of = {id(member[0]): row for row, member in enumerate(self.members) if member is not None}
        self.order = np.array([self._row_of[id(cache)] for cache in caches])
        self._in_order = len(caches) == rows and bool((self.order == np.arange(rows)).all())
        self._device_order: torch.Tensor | None = None
        self.real = np.array([member is not None for member in self.members])
        self.live_rows = len(self._row_of)
        self.seen, self.held = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        # What arithmetic planning needs of each row, fixed while the batch lasts.
        never = np.iinfo(np.int64).max
        self.capacity, self.pinned = np.full(rows, never, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        self.rolling, self.size = np.zeros(rows, dtype=bool), np.zeros(rows, dtype=np.int64)
        self.spans_end = np.zeros(rows, dtype=np.int64)  # where the last pinned span ends
        # The last plan of every row: rows carried on keep theirs, the others are planned
        # from their caches (``fresh``); padding rows are ranked as their segment's rows.
        self.fresh = self.real.copy()
        self.plan: np.ndarray | None = self._carry(previous)
        for row in np.flatnonzero(self.fresh):
            self._read_row(row)
        if previous is not None:
            previous.let_go()
        self.stale = False  # some row left: the next step builds a batch anew

    def _carry(self, previous: StepBatch | None) -> np.ndarray | None:
        """Take over ``previous``'s rows that are rows here too: the last plan of every
        row (None where none was carried)."""
        if previous is None or previous.plan is None:
            return None
        pairs = [(row, old) for row, member in enumerate(self.members)
                 if member is not None and (old := previous.row_of(member[0])) is not None]
        if not pairs:
            return None
        new, old = (np.array(side) for side in zip(*pairs))
        for name in ("seen", "held", "capacity", "pinned", "rolling", "size", "spans_end"):
            getattr(self, name)[new] = getattr(previous, name)[old]
        plan = np.zeros((len(self.members), FIELDS), dtype=np.int64)
        for seg in self.segments:
            plan[seg.offset : seg.offset + seg.rows, RANKING] = min(seg.rankings)
        plan[new] = previous.plan[old]
        self.fresh[new] = False
        for row, before in pairs:
            live = self.members[row][0].layers[0].live
            live.seen, live.held, live.row, live.leave = self.seen, self.held, row, functools.partial(self._leave, row)
            previous.hand_over(before)
        return plan

    def _read_row(self, row: int) -> None:
        """Row ``row``'s counters and fixed values from its cache, whose layers' counters
        then live in this batch's arrays."""
        cache = self.members[row][0]
        layer = cache.layers[0]
        self.seen[row], self.held[row] = layer.seen, layer.held
        self.pinned[row] = layer.pinned_slots
        if cache.policy.capacity is not None:
            self.capacity[row] = cache.policy.capacity
        self.rolling[row], self.size[row] = cache.rolling, layer.size
        self.spans_end[row] = max((end for _, end in cache.spans.ranges), default=0)
        live = LiveCounts(self.seen, self.held, row, functools.partial(self._leave, row))
        for each in cache.layers:
            each.live = live

    def row_of(self, cache: H2OCache) -> int | None:
        """``cache``'s batch row, where it is still one."""
        row = self._row_of.get(id(cache))
        return row if row is not None and self.members[row] is not None and self.members[row][0] is cache else None

    def hand_over(self, row: int) -> None:
        """Row ``row`` goes on in another batch, its counters with it."""
        self.members[row] = None
        self.real[row] = False
        self.live_rows -= 1
        self.stale = True

    def serves(self, caches: list[H2OCache]) -> bool:
        """Whether the next step of ``caches`` can go on from this batch."""
        return not self.stale and tuple(map(id, caches)) == self.ids

    def next_plan(self, tokens: list[int]) -> np.ndarray:
        """The plan of the next step, ``tokens[i]`` fed to the callers' ``caches[i]``."""
        last, plan = self.plan, np.zeros((len(self.members), FIELDS), dtype=np.int64)
        for seg in self.segments:  # padding rows: their one slot, never evicted, ranked as the others
            plan[seg.offset : seg.offset + seg.rows, RANKING] = min(seg.rankings)
        if last is None:
            slow = self.real.copy()
        else:
            seen, held, real = self.seen, self.held, self.real
            plan[:, START], plan[:, RANKING], plan[:, OPENED] = last[:, START], last[:, RANKING], last[:, OPENED]
            plan[real, POSITION], plan[real, SLOT] = seen[real], held[real]
            plan[real, ROPE] = np.where(self.rolling, held, seen)[real]
            # The recent window slides by one unpinned token, the sink stays.
            plan[real, END] = last[real, END] + 1
            plan[real, EVICTS] = (held + 1 - self.pinned > self.capacity)[real]
            sink_full = last[:, START] <= last[:, POSITION]
            clear = (self.spans_end <= last[:, END] + 1) & (last[:, END] > 0)
            slow = real & (self.fresh | ~(sink_full & clear & (held + 1 <= self.size)))
        self.fresh[:] = False
        plan[self.order, TOKEN] = tokens
        for row in np.flatnonzero(slow):
            cache, seg, index = self.members[row]
            if self.held[row] + 1 > self.size[row]:
                seg.pool.give_room(index, int(self.held[row]) + DECODE_ROOM)
                self.size[row] = cache.layers[0].size
            plan[row] = plan_row(cache, int(plan[row, TOKEN]))
        self.plan = plan
        return plan

    def settle(self, plan: np.ndarray) -> None:
        """After the step: every row's counters, as ``plan`` said."""
        self.seen += self.real
        self.held += self.real & (plan[:, EVICTS] == 0)

    def in_callers_order(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the callers' ``caches``, in their order."""
        if self._in_order:
            return logits
        if self._device_order is None:
            self._device_order = torch.from_numpy(self.order).to(logits.device)
        return logits.index_select(0, self._device_order)

    def let_go(self, cache: H2OCache | None = None) -> None:
        """Hand the counters back to ``cache``'s layers (None: every row's)."""
        if cache is None:
            for row in np.flatnonzero(self.real):
                self._leave(row)
        elif (row := self.row_of(cache)) is not None:
            self._leave(row)

    def _leave(self, row: int) -> None:
        member = self.members[row]
        if member is None:
            return
        cache = member[0]
        seen, held = int(self.seen[row]), int(self.held[row])
        self.hand_over(row)  # its counters are the layers' again
        for layer in cache.layers:
            layer.live = None
            layer.seen, layer.held = seen, held
