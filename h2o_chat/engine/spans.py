"""Pinned (protected) token positions, and the windows a policy keeps around them.

Everything here is host arithmetic on a few ranges: the decode step asks it for every
row at every step, so it must cost no tensor op and no read of the device.
"""

from __future__ import annotations

import torch


class ProtectedSpans:
    """Half-open ranges of absolute token positions that are never evicted."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def merged(self, below: int | None = None) -> list[tuple[int, int]]:
        """The ranges as sorted disjoint ones, cut at ``below`` where given."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted(self.ranges):
            if below is not None:
                start, end = min(start, below), min(end, below)
            if start >= end:
                continue
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def covered(self, below: int | None = None) -> int:
        """Positions inside any range (below ``below`` where given), each counted once."""
        return sum(end - start for start, end in self.merged(below))

    def contains(self, positions: torch.Tensor) -> torch.Tensor:
        inside = torch.zeros_like(positions, dtype=torch.bool)
        for start, end in self.ranges:
            inside |= (positions >= start) & (positions < end)
        return inside

    def covers(self, position: int) -> bool:
        return any(start <= position < end for start, end in self.ranges)

    def windows(self, seen: int, sink: int, recent: int) -> tuple[int, int]:
        """``(start, end)``: of the positions ``0 .. seen - 1`` not pinned, the first ``sink``
        lie before ``start`` and the last ``recent`` from ``end`` on; the unpinned
        positions in ``[start, end)`` are the middle, ranked by the policy. A position is
        in a window by when it came, whether or not the cache still holds it (only
        pinning tokens after the fact can make a window hold fewer)."""
        pinned = self.merged(seen)
        return _after_free(pinned, sink, seen), _before_free(pinned, recent, seen)


def _after_free(pinned: list[tuple[int, int]], count: int, seen: int) -> int:
    """The position right after the ``count``-th unpinned one from 0 (``seen`` if fewer)."""
    if count == 0:
        return 0
    reached = 0
    for start, end in [*pinned, (seen, seen)]:
        free = start - reached  # unpinned positions reached .. start - 1
        if free >= count:
            return reached + count
        count -= free
        reached = end
    return seen


def _before_free(pinned: list[tuple[int, int]], count: int, seen: int) -> int:
    """The position of the ``count``-th unpinned one counted back from ``seen - 1`` (0 if
    fewer)."""
    if count == 0:
        return seen
    reached = seen
    for start, end in [*reversed(pinned), (0, 0)]:
        free = reached - end  # unpinned positions end .. reached - 1
        if free >= count:
            return reached - count
        count -= free
        reached = start
    return 0
