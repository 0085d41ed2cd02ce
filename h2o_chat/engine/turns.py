"""Where a conversation's turns begin, and which turn is still open.

A turn-aware cache (``EvictionPolicy.marks_turns``) scores a slot only with the queries
of its own turn: once the next turn opens, what a turn's slots collected is final, so
later turns, which rarely look back, cannot let an early turn's scores fall behind the
scores of every newer one (the "nested compression" of multi-turn chat). Eviction still
ranks every middle slot together: a closed turn keeps its slots for as long as their
final scores stand up to the new ones.

Everything here is host arithmetic on a few integers; the cache and the decode step
read ``opened`` (the first position of the open turn: slots from there on still score).
"""

from __future__ import annotations

import bisect


class TurnMarks:
    """The first positions of a conversation's turns, and the turn now open."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted; may lie ahead of the tokens seen
        self.opened = 0  # slots from here on still collect scores

    def mark(self, position: int) -> None:
        """A turn begins at ``position`` (a token not seen yet)."""
        if position < self.opened:
            raise ValueError(f"a turn cannot begin at {position}, before the open turn's start {self.opened}")
        if position not in self.starts:
            bisect.insort(self.starts, position)

    def forget_from(self, position: int) -> None:
        """Drop the marks at ``position`` and after (their tokens were taken back)."""
        del self.starts[bisect.bisect_left(self.starts, position):]
        self.opened = min(self.opened, position)

    def start_at_or_before(self, position: int) -> int:
        """The start of the turn that ``position`` belongs to (0 before any mark)."""
        index = bisect.bisect_right(self.starts, position)
        return self.starts[index - 1] if index else 0

    def next_start_after(self, position: int) -> int | None:
        """The first turn start after ``position``, None if none is marked."""
        index = bisect.bisect_right(self.starts, position)
        return self.starts[index] if index < len(self.starts) else None
