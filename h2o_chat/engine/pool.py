"""The caches of conversations decoding together, kept as the rows of one set of buffers.

A ``RowPool`` holds the caches of a batch as rows ``0..n-1`` of one buffer per quantity,
``(layers, rows, kv_heads, size, ...)``, each cache's ``SlotGroup`` pointing at its row,
so the decode step (``step.py``) writes, attends, scores and evicts every row where it
lies, one operation for all rows. Layers first: one layer's rows are then one strided
batch that matmul reads in place.

Nothing changes for a cache in the pool but where its buffers are: its layers' views
show its row. A cache joins when it first decodes in a batch (one copy of what it holds)
and leaves when its turn ends (one copy back, into buffers of its own), so between turns
a conversation owns its memory again. Caches of one pool share their buffers' layout:
storage precision, rolling, model shapes, and whether they are bounded (a cache that
never evicts grows, and the pool with it). A cache that reallocates while pooled (a
reset) simply owns its new buffers; the pool notices and frees the row.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .cache import H2OCache
from .memory import freed, tensor_bytes
from .slots import SlotGroup
from .window import length

_serials = itertools.count()


def pool_signature(cache: H2OCache) -> tuple | None:
    """What caches must share to be rows of one pool (None: ``cache`` cannot be a row):
    the layout of their buffers ``(1, layers, kv_heads, size, ...)`` but the number of
    slots, dtypes, device, and whether they are bounded."""
    group = cache.stacked()
    if group is None or group.buffers["keys"].shape[0] != 1:
        return None
    # A ring's length (the exact window) is part of the layout; the slots are not.
    layout = tuple((name, t.dtype, t.device, t.shape[1:3], length(name, t.shape[3], None), t.shape[4:])
                   for name, t in sorted(group.buffers.items()))
    return layout, cache.policy.capacity is not None


def _size(group: SlotGroup) -> int:
    return group.buffers["keys"].shape[3]


class RowPool:
    """Rows ``0..len-1`` hold the members' slot buffers (see the module docstring). A
    row has room for ``size`` slots; a member sees as many as its own buffers had, or
    more once it needs them (``give_room``)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # (layers, rows, kv_heads, size, ...)
        self.serial = next(_serials)  # tells pools apart for as long as the process runs
        # Bumped whenever the buffers are replaced: whatever holds on to them (a captured
        # CUDA graph of the decode step) is stale then.
        self.generation = 0
        self._members: list[weakref.ref[H2OCache]] = []  # by row
        # Each member's row by its id, so rows coming and going cost the same at any pool
        # size; an id outlives its member (``_row``), so each row keeps its member's.
        self._row_of: dict[int, int] = {}
        self._ids: list[int] = []  # by row
        # Bytes of the buffers no member's slots take (spare rows, each row's slots past
        # its member's), kept as rows or buffers change from the bytes each row shows its
        # member; the members' own are theirs to count (``H2OCache.allocated_bytes``).
        self.spare_bytes = 0
        self._buffer_bytes = 0
        self._shown: list[int] = []  # by row: the bytes of the views its member sees

    def __len__(self) -> int:
        return len(self._members)

    @property
    def size(self) -> int:
        return self.buffers["keys"].shape[3] if self.buffers else 0

    @property
    def room(self) -> int:
        """Rows the buffers have room for."""
        return self.buffers["keys"].shape[1] if self.buffers else 0

    def holds(self, cache: H2OCache) -> bool:
        """Whether ``cache`` lies in this pool's buffers (a member that has not moved out)."""
        row = self._row(cache)
        return row is not None and self._holds(cache, row)

    def join(self, caches: list[H2OCache], rows: int,
             intact: frozenset[int] = frozenset()) -> tuple[list[H2OCache], list[tuple[int, H2OCache]]]:
        """The members in row order (``caches``, the ones not yet members joining), with
        room for ``rows`` rows (``>= len(caches)``: spare ones a step may compute), and the
        row of each that joined now. Members beside ``caches`` leave first: every member is
        a row of every step. ``intact``: the ids of members the caller knows still lie in
        their rows (nothing changed them since they last did), which are not looked at
        again: at thousands of rows, looking cost a step with one row coming and one going
        more than the step itself. What goes over every row is a set operation or a
        lookup a row: no row is checked, stacked or copied but those that come and go."""
        self._forget_departed(intact)
        ids = list(map(id, caches))
        # Every member now is alive and lies in its row, so each id is one member's.
        gone = set(self._ids).difference(ids)
        for member in [self._members[row]() for row in sorted(map(self._row_of.__getitem__, gone))]:
            self.release(member)
        joining = [cache for cache, key in zip(caches, ids) if key not in intact]
        groups = [cache.stacked() for cache in joining]
        like = groups[0] if groups else self._members[0]().whole_group()
        self._reserve(rows, max(map(_size, groups), default=0), like)
        for cache, group in zip(joining, groups):
            self.admit(cache, rows, group)
        # Rows read once every cache has joined: a join may move another member's row.
        row_of = self._row_of
        return [member() for member in self._members], [(row_of[id(cache)], cache) for cache in joining]

    def admit(self, cache: H2OCache, rows: int, group: SlotGroup | None = None) -> int:
        """``cache``'s row, joining now if it is no member yet, in buffers with room for
        ``rows`` rows: a batch filled one conversation at a time holds each one's own
        buffers only until it joins, never all of them beside the pool. ``group``: its
        ``stacked()``, where the caller has it."""
        row = self._row(cache)
        if row is not None:
            if self._holds(cache, row):
                return row
            self._drop_row(row)  # it left on its own since: it joins anew
        group = group or cache.stacked()
        own = group.nbytes
        self._reserve(max(rows, len(self._members) + 1), _size(group), group)
        row = len(self._members)
        self._members.append(weakref.ref(cache))
        self._shown.append(0)
        self._ids.append(id(cache))
        self._row_of[id(cache)] = row
        self._point(row, _size(group))
        # Its own buffers are free now. glibc would keep them (32 caches joining left the
        # pool's whole size of freed buffers in the process); handed back as they add up,
        # the join never holds the pool and all of them at once.
        freed(own)
        self._recount()
        return row

    def give_room(self, row: int, slots: int) -> None:
        """Let the member of ``row`` hold ``slots`` slots, growing the pool if it must
        (by a sixteenth at least, so a growing cache does not move at every token)."""
        group = self._members[row]().whole_group()
        if _size(group) >= slots:
            return
        if slots > self.size:
            self._resize(self.room, max(slots, self.size + max(64, self.size // 16)), group)
        self._point(row, slots)
        self._recount()

    def release(self, cache: H2OCache) -> None:
        """``cache`` leaves, into buffers of its own holding what its row holds. A cache
        that is no member is left as it is."""
        row = self._row(cache)
        if row is None:
            return
        if self._holds(cache, row):
            group = cache.whole_group()
            if cache.policy.capacity is None and len(group) > 1:
                cache.unstack()  # a group per layer again, each copied out of the row
            else:
                group.relocate({name: torch.empty_like(t) for name, t in group.buffers.items()})
        self._drop_row(row)  # else it left on its own: its row is simply free
        self._shrink()
        self._recount()

    def _reserve(self, rows: int, size: int, like: SlotGroup) -> None:
        """Room for ``rows`` rows of ``size`` slots of buffers like ``like``'s."""
        if rows > self.room or size > self.size:
            # Half as many rows again at least: joining one by one, rows do not move at
            # every join; and at most that, since spare rows hold memory no cache counts.
            self._resize(max(rows, self.room + self.room // 2), max(size, self.size), like)

    def _resize(self, rows: int, size: int, like: SlotGroup) -> None:
        """New buffers of ``rows`` rows of ``size`` slots, alike ``like``'s: every member
        moves into them."""
        self.buffers = {name: t.new_zeros((t.shape[1], rows, t.shape[2], length(name, t.shape[3], size),
                                           *t.shape[4:]))
                        for name, t in like.buffers.items()}
        self._buffer_bytes = tensor_bytes(self.buffers.values())
        self.generation += 1
        for row, member in enumerate(self._members):
            self._point(row, _size(member().whole_group()))

    def _point(self, row: int, size: int) -> None:
        """Move the member of ``row`` (its group's content, ``size`` slots of it) into that row."""
        group = self._members[row]().whole_group()
        views = {name: t[:, row : row + 1, :, : length(name, None, size)].transpose(0, 1)
                 for name, t in self.buffers.items()}
        group.relocate(views)
        self._shown[row] = tensor_bytes(views.values())

    def _drop_row(self, row: int) -> None:
        """Free ``row`` (its member gone or moved out); the last member moves into it,
        once the last rows of members gone or moved out are freed (a mover must lie in
        its row)."""
        self._forget(row)
        while len(self._members) - 1 > row and not self._lies_in_row(len(self._members) - 1):
            self._forget(len(self._members) - 1)
            self._pop()
        last = len(self._members) - 1
        self._members[row], self._shown[row], self._ids[row] = self._members[last], self._shown[last], self._ids[last]
        self._pop()
        if row != last:
            mover = self._members[row]()
            self._row_of[self._ids[row]] = row
            self._point(row, _size(mover.whole_group()))

    def _forget(self, row: int) -> None:
        """``row``'s member is no member any more (its row still to be freed)."""
        key = self._ids[row]
        if self._row_of.get(key) == row:
            del self._row_of[key]
        self._shown[row] = 0

    def _pop(self) -> None:
        self._members.pop()
        self._shown.pop()
        self._ids.pop()

    def _row(self, cache: H2OCache) -> int | None:
        """``cache``'s row, where it is a member (a member gone may have left its id to another)."""
        row = self._row_of.get(id(cache))
        return row if row is not None and self._members[row]() is cache else None

    def _lies_in_row(self, row: int) -> bool:
        member = self._members[row]()
        return member is not None and self._holds(member, row)

    def _shrink(self) -> None:
        """Let go of spare rows once most are unused; of all buffers once none is used.
        Only after every member left is known: a resize moves every member."""
        if not self._members:
            self.buffers = {}  # an idle pool holds no memory
            self._buffer_bytes = 0
            self.generation += 1
        elif len(self._members) <= self.room // 4:
            self._resize(self.room // 2, self.size, self._members[0]().whole_group())

    def _forget_departed(self, intact: frozenset[int]) -> None:
        """Free the rows of caches gone (collected) or that left on their own (their group
        reallocated, was reset or dissolved), but those of ``intact`` (see ``join``). From
        the last row, so a row's mover is always a checked member."""
        # An intact id's row is the one the id points at: a row of a member gone whose id
        # a joiner has taken since is not that row, so it is checked.
        kept = set(map(self._row_of.get, intact))
        for row in sorted(set(range(len(self._members))).difference(kept), reverse=True):
            if not self._lies_in_row(row):
                self._drop_row(row)
        self._shrink()
        self._recount()

    def _recount(self) -> None:
        """``spare_bytes`` from the numbers kept (no tensor operation: a step's cost must
        not grow with its rows)."""
        self.spare_bytes = self._buffer_bytes - sum(self._shown)

    def _holds(self, cache: H2OCache, row: int) -> bool:
        """Whether ``cache``'s slots lie in ``row``: every buffer of a group moves at once
        (``SlotGroup.relocate``), so its keys tell."""
        group = cache.whole_group()
        if group is None or "keys" not in self.buffers:
            return False
        keys = self.buffers["keys"]
        return group.buffers["keys"].data_ptr() == keys.data_ptr() + row * keys.stride(1) * keys.element_size()
