"""The rows of the decode step, kept from one step to the next: which pool row each
conversation sits in, and its plan (what the host tells the device about each row).

Planning a row from its cache (``plan_row``: its counters, pins and policy) takes a few
microseconds a row, which at thousands of rows is more than a GPU's whole step. Between
two steps of the same conversations nothing but the step changes their caches, so the
next plan follows from the last by arithmetic over every row at once (numpy), and the
counters that each row's layers would advance live in the step's arrays meanwhile
(``layer.LiveCounts``). A row is planned from its cache again only where arithmetic does
not tell: its recent window meets a pinned span, its sink is not filled yet, it needs
more room (a cache that never evicts), or it has just joined.

Those arrays (``Records``) hold each conversation under a number it keeps while it
decodes (its record), whichever batch row it is in: when rows come and go, the next
batch maps its rows to records and the others carry on untouched, so a change of rows
costs about what the rows that come and go cost, not what every row does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
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
    signature: tuple  # the pool's (``pool.pool_signature``)

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


def _records_of(by_id: dict[int, int], ids: Iterable[int], count: int) -> np.ndarray:
    """The record of each of ``ids`` (``Records.by_id``), -1 where it has none."""
    return np.fromiter(map(by_id.get, ids, itertools.repeat(-1)), dtype=np.int64, count=count)


class Records:
    """What the decode step keeps of each conversation decoding (see the module
    docstring), by record: its counters (its layers' ``LiveCounts`` read them here), what
    arithmetic planning needs of it (fixed while it decodes), its last plan and its batch
    row. A record is taken as a conversation joins and given back as it leaves."""

    def __init__(self) -> None:
        self.batch: StepBatch | None = None  # the batch whose rows the records are
        self.caches: list[H2OCache | None] = []  # by record
        # Each conversation's record by its id: a conversation holding one is kept alive
        # (``caches``), so no other can have its id meanwhile.
        self.by_id: dict[int, int] = {}
        self._free: list[int] = []
        self.seen = self.held = self.pinned = self.size = self.spans_end = self.row = np.zeros(0, dtype=np.int64)
        self.capacity = np.zeros(0, dtype=np.int64)
        self.rolling = self.fresh = np.zeros(0, dtype=bool)
        self.plan = np.zeros((0, FIELDS), dtype=np.int64)

    def of(self, cache: H2OCache) -> int | None:
        """``cache``'s record, where it has one here."""
        return self.by_id.get(id(cache))

    def take(self, cache: H2OCache) -> int:
        """A record for ``cache``, read from it; its layers' counters live here from now."""
        if not self._free:
            self._grow()
        record = self._free.pop()
        layer = cache.layers[0]
        self.seen[record], self.held[record] = layer.seen, layer.held
        self.pinned[record] = layer.pinned_slots
        capacity = cache.policy.capacity
        self.capacity[record] = np.iinfo(np.int64).max if capacity is None else capacity
        self.rolling[record], self.size[record] = cache.rolling, layer.size
        self.spans_end[record] = max((end for _, end in cache.spans.ranges), default=0)  # the last pin's end
        self.fresh[record] = True  # planned from its cache at its first step
        self.caches[record] = cache
        self.by_id[id(cache)] = record
        live = LiveCounts(self, record)
        for each in cache.layers:
            each.live = live
        return record

    def leave(self, record: int) -> None:
        """Record ``record``'s counters go back to its cache's layers, and the batch whose
        row it was is stale (the next step builds one anew); nothing if it was left."""
        cache = self.caches[record]
        if cache is None:
            return
        self.caches[record] = None
        del self.by_id[id(cache)]
        seen, held = int(self.seen[record]), int(self.held[record])
        for layer in cache.layers:
            layer.live = None
            layer.seen, layer.held = seen, held
        self._free.append(record)
        if self.batch is not None:
            self.batch.stale = True
            self.batch.members[self.row[record]] = None  # nor keeps the cache alive

    def _grow(self) -> None:
        old = len(self.caches)
        new = max(16, 2 * old)
        for name in ("seen", "held", "pinned", "size", "spans_end", "row", "capacity", "rolling", "fresh", "plan"):
            before = getattr(self, name)
            after = np.zeros((new, *before.shape[1:]), dtype=before.dtype)
            after[:old] = before
            setattr(self, name, after)
        self.caches += [None] * (new - old)
        self._free += reversed(range(old, new))


class StepBatch:
    """The rows of ``segments``, ``caches`` in the callers' order (see the module docstring).
    ``previous``: the last step's batch, whose rows still decoding carry on from where it
    left them (their records: no cache read); its others leave."""

    def __init__(self, segments: list[Segment], caches: list[H2OCache], previous: StepBatch | None = None) -> None:
        self.segments, self.ids = segments, tuple(map(id, caches))
        records = self.records = previous.records if previous is not None else Records()
        rows = sum(seg.rows for seg in segments)
        self.members: list[tuple[H2OCache, Segment, int] | None] = [None] * rows  # by batch row
        record = np.full(rows, -1, dtype=np.int64)
        # Padding rows: their one slot, never evicted, ranked as their segment's rows.
        self.padding_plan = np.zeros((rows, FIELDS), dtype=np.int64)
        self.segment_of_row = np.full(rows, -1, dtype=np.int64)  # by batch row: its segment's index
        for number, seg in enumerate(segments):
            start, stop = seg.offset, seg.offset + len(seg.caches)
            self.members[start:stop] = zip(seg.caches, itertools.repeat(seg), itertools.count())
            record[start:stop] = _records_of(records.by_id, map(id, seg.caches), len(seg.caches))
            self.segment_of_row[start:stop] = number
            self.padding_plan[seg.offset : seg.offset + seg.rows, RANKING] = min(seg.rankings)
        for row in np.flatnonzero(record < 0):
            if self.members[row] is not None:  # joining
                record[row] = records.take(self.members[row][0])
        self.rows = np.flatnonzero(record >= 0)  # the conversations' batch rows
        self.records_of_rows = record[self.rows]
        if previous is not None:  # its rows not carried on leave
            here = np.zeros(len(records.caches), dtype=bool)
            here[self.records_of_rows] = True
            for left in previous.records_of_rows[~here[previous.records_of_rows]]:
                records.leave(int(left))
        records.row[self.records_of_rows] = self.rows
        records.batch = self
        # Every cache of the step has a record by now: a missing one raises, as it must.
        callers = np.fromiter(map(records.by_id.__getitem__, self.ids), dtype=np.int64, count=len(caches))
        self.order = records.row[callers]
        self._in_order = len(caches) == rows and bool((self.order == np.arange(rows)).all())
        self._device_order: torch.Tensor | None = None
        self.stale = False  # some row left: the next step builds a batch anew

    def carried(self, ids: list[int]) -> list[int]:
        """For each of the caches of ``ids``, the index in ``segments`` of the segment it
        still is a row of, -1 where none: in C over every id, for thousands at every
        change of rows."""
        if self.records.batch is not self:
            return [-1] * len(ids)
        record = _records_of(self.records.by_id, ids, len(ids))
        found = record >= 0
        index = np.full(len(ids), -1, dtype=np.int64)
        # A record here is a row of this batch (records leave as their rows do).
        index[found] = self.segment_of_row[self.records.row[record[found]]]
        return index.tolist()

    @property
    def live_rows(self) -> int:
        return len(self.records.by_id)

    def serves(self, caches: list[H2OCache]) -> bool:
        """Whether the next step of ``caches`` can go on from this batch."""
        return not self.stale and tuple(map(id, caches)) == self.ids

    def next_plan(self, tokens: list[int]) -> np.ndarray:
        """The plan of the next step, ``tokens[i]`` fed to the callers' ``caches[i]``."""
        records, rows, record = self.records, self.rows, self.records_of_rows
        plan = self.padding_plan.copy()
        last, seen, held = records.plan[record], records.seen[record], records.held[record]
        mine = np.zeros_like(last)
        mine[:, START], mine[:, RANKING], mine[:, OPENED] = last[:, START], last[:, RANKING], last[:, OPENED]
        mine[:, POSITION], mine[:, SLOT] = seen, held
        mine[:, ROPE] = np.where(records.rolling[record], held, seen)
        # The recent window slides by one unpinned token, the sink stays.
        mine[:, END] = last[:, END] + 1
        mine[:, EVICTS] = held + 1 - records.pinned[record] > records.capacity[record]
        sink_full = last[:, START] <= last[:, POSITION]
        clear = (records.spans_end[record] <= last[:, END] + 1) & (last[:, END] > 0)
        slow = records.fresh[record] | ~(sink_full & clear & (held + 1 <= records.size[record]))
        plan[rows] = mine
        plan[self.order, TOKEN] = tokens
        for at in np.flatnonzero(slow):
            row, each = rows[at], record[at]
            cache, seg, index = self.members[row]
            if records.held[each] + 1 > records.size[each]:
                seg.pool.give_room(index, int(records.held[each]) + DECODE_ROOM)
                records.size[each] = cache.layers[0].size
            plan[row] = plan_row(cache, int(plan[row, TOKEN]))
        records.fresh[record] = False
        records.plan[record] = plan[rows]
        return plan

    def settle(self, plan: np.ndarray) -> None:
        """After the step: every row's counters, as ``plan`` said."""
        record = self.records_of_rows
        self.records.seen[record] += 1
        self.records.held[record] += plan[self.rows, EVICTS] == 0

    def in_callers_order(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the callers' ``caches``, in their order."""
        if self._in_order:
            return logits
        if self._device_order is None:
            self._device_order = torch.from_numpy(self.order).to(logits.device)
        return logits.index_select(0, self._device_order)

    def let_go(self, cache: H2OCache) -> None:
        """Hand the counters back to ``cache``'s layers, where it is a row here."""
        record = self.records.of(cache)
        if record is not None:
            self.records.leave(record)
