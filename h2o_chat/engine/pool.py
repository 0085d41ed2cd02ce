"""The caches of conversations decoding together, kept as the rows of one set of buffers.

A batched step attends over every row's held slots in one call. With each cache in
buffers of its own, that call first copies all rows' keys and values into one stacked
tensor, every layer of every step: at 32 rows a fifth of the step on the development
machine. A ``RowPool`` holds the bounded caches of a batch as rows ``0..n-1`` of one
buffer per quantity, ``(layers, rows, kv_heads, size, ...)``, each cache's ``SlotGroup``
pointing at its row, so attention reads the rows where they lie. Layers first: one
layer's rows are then one strided batch that matmul reads in place.

Nothing else changes for a cache in the pool: it updates, scores and evicts its own row
as it would its own buffers. A cache joins when it first decodes in a batch (one copy of
what it holds) and leaves when its turn ends (one copy back, into buffers of its own), so
between turns a conversation owns its memory again. Only caches whose layers all share one
``SlotGroup`` and alike buffers are pooled: bounded caches once they hold their first
tokens, whose buffers never grow again. A cache that reallocates while pooled (a new
prefill chunk, a reset) simply owns its new buffers; the pool notices and frees the row.
"""

from __future__ import annotations

import weakref

import torch

from .cache import H2OCache
from .memory import return_freed_memory
from .slots import SlotGroup


def _signature(group: SlotGroup) -> tuple:
    """What two groups must share to be rows of one pool: the shapes of their buffers
    ``(1, layers, kv_heads, size, ...)`` but the number of slots, and dtypes and device."""
    return tuple((name, t.dtype, t.device, t.shape[1:3], t.shape[4:]) for name, t in sorted(group.buffers.items()))


def _size(group: SlotGroup) -> int:
    return group.buffers["keys"].shape[3]


class RowPool:
    """Rows ``0..len-1`` hold the members' slot buffers (see the module docstring). A
    row has room for the most slots a member has; a member sees as many as its own
    buffers had."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # (layers, rows, kv_heads, size, ...)
        self._signature: tuple | None = None  # the members' groups'
        self._members: list[weakref.ref[H2OCache]] = []  # by row

    def __len__(self) -> int:
        return len(self._members)

    def rows_of(self, caches: list[H2OCache]) -> list[int] | None:
        """Each cache's row, the caches joining where they are not members yet; None when
        they cannot be the pool's rows (not all bounded and alike, or members beside them
        still in the pool), and then the pool is as it was."""
        self._forget_departed()
        groups = [_whole_group(cache) for cache in caches]
        if any(group is None for group in groups):
            return None
        signature = _signature(groups[0])
        if any(_signature(group) != signature for group in groups[1:]):
            return None
        if self._members and self._signature != signature:
            return None
        rows = {id(member()): row for row, member in enumerate(self._members)}
        joining = [cache for cache in caches if id(cache) not in rows]
        if len(rows) + len(joining) != len(caches):
            return None  # members beside this batch: their rows would be attended too
        self._reserve(len(caches), max(_size(group) for group in groups), groups[0])
        for cache in joining:
            rows[id(cache)] = len(self._members)
            self._members.append(weakref.ref(cache))
            self._point(rows[id(cache)])
            # Its own buffers are free now. glibc would keep them (32 caches joining left
            # the pool's whole size of freed buffers in the process); handed back one by
            # one, the join never holds the pool and all of them at once (a trim costs
            # well under a millisecond).
            return_freed_memory()
        return [rows[id(cache)] for cache in caches]

    def rows(self, name: str, layer: int, count: int) -> torch.Tensor:
        """Buffer ``name`` of ``layer`` for rows ``0..count-1``: ``(count, kv_heads, size, ...)``."""
        return self.buffers[name][layer, :count]

    def release(self, cache: H2OCache) -> None:
        """``cache`` leaves, into buffers of its own holding what its row holds. A cache
        that is no member is left as it is."""
        self._forget_departed()
        for row, member in enumerate(self._members):
            if member() is cache:
                group = _whole_group(cache)
                group.relocate({name: torch.empty_like(t) for name, t in group.buffers.items()})
                self._drop_row(row)
                self._shrink()
                return

    def _reserve(self, rows: int, size: int, like: SlotGroup) -> None:
        """Room for ``rows`` rows of ``size`` slots of buffers like ``like``'s."""
        room, held = self._room()
        if rows > room or size > held:
            # Half as many rows again at least: joining one by one, rows do not move at
            # every join; and at most that, since spare rows hold memory no cache counts.
            self._resize(max(rows, room + room // 2), max(size, held), like)

    def _room(self) -> tuple[int, int]:
        """Rows and slots per row the buffers have room for."""
        if not self.buffers:
            return 0, 0
        shape = self.buffers["keys"].shape
        return shape[1], shape[3]

    def _resize(self, rows: int, size: int, like: SlotGroup) -> None:
        """New buffers of ``rows`` rows of ``size`` slots, alike ``like``'s: every member
        moves into them."""
        self.buffers = {name: t.new_zeros((t.shape[1], rows, t.shape[2], size, *t.shape[4:]))
                        for name, t in like.buffers.items()}
        self._signature = _signature(like)
        for row in range(len(self._members)):
            self._point(row)

    def _point(self, row: int) -> None:
        """Move the member of ``row`` (its group's content, its number of slots) into that row."""
        group = _whole_group(self._members[row]())
        size = _size(group)
        group.relocate({name: t[:, row : row + 1, :, :size].transpose(0, 1) for name, t in self.buffers.items()})

    def _drop_row(self, row: int) -> None:
        """Free ``row`` (its member gone or moved out); the last member moves into it."""
        last = len(self._members) - 1
        self._members[row] = self._members[last]
        self._members.pop()
        if row != last:
            self._point(row)

    def _shrink(self) -> None:
        """Let go of spare rows once most are unused; of all buffers once none is used.
        Only after every member left is known: a resize moves every member."""
        room, held = self._room()
        if not self._members:
            self.buffers, self._signature = {}, None  # an idle pool holds no memory
        elif len(self._members) <= room // 4:
            self._resize(room // 2, held, _whole_group(self._members[0]()))

    def _forget_departed(self) -> None:
        """Free the rows of caches gone (collected) or that left on their own (their group
        reallocated, was reset or dissolved). From the last row, so a row's mover is always
        a checked member."""
        for row in reversed(range(len(self._members))):
            cache = self._members[row]()
            if cache is None or not self._holds(cache, row):
                self._drop_row(row)
        self._shrink()

    def _holds(self, cache: H2OCache, row: int) -> bool:
        group = _whole_group(cache)
        return (group is not None and group.buffers.keys() == self.buffers.keys()
                and all(group.buffers[name].data_ptr() == t[0, row].data_ptr() for name, t in self.buffers.items()))


def _whole_group(cache: H2OCache) -> SlotGroup | None:
    """The one group holding all of a one-row ``cache``'s layers, else None. Quantized
    keys are read dequantized, never where they lie: such a cache gains nothing here."""
    group = cache.whole_group() if isinstance(cache, H2OCache) else None
    if group is None or group.buffers["keys"].shape[0] != 1 or not group.buffers["keys"].is_floating_point():
        return None
    return group
