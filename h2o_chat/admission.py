"""One admission for every door: at most ``limit`` turns generate at once on the model,
page turns and API turns together, and the others wait in the order they asked.

A turn asks with ``request`` and gets a ``Ticket``; a ticket granted at once runs now,
else it waits until a running turn's ``Ticket.done`` hands it the slot. Threads (the
page's handlers) wait with ``Ticket.wait``; the event loop (the API) passes a callback
that resolves a future. Leaving the queue and ending a turn are the same call, so a
turn that gives up never leaks a slot, whenever it gives up.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

# How often a waiting thread looks at its stop event (a Stop pressed while it waits).
_STOP_POLL_S = 0.05


class Ticket:
    """One turn's place: waiting, then granted (holding a slot), then done."""

    def __init__(self, admission: Admission, granted: Callable[[], None]) -> None:
        self._admission, self._on_granted = admission, granted
        self._granted = threading.Event()
        self.state = "waiting"  # waiting | granted | done; changed under the admission's lock

    @property
    def granted(self) -> bool:
        return self._granted.is_set()

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Block until granted (True), or until ``stop`` is set (False: the ticket is
        done, out of the queue)."""
        while not self._granted.wait(_STOP_POLL_S):
            if stop is not None and stop.is_set():
                self.done()  # granted meanwhile: the slot goes on to the next
                return False
        return True

    def done(self) -> None:
        """Leave the queue, or hand the slot on; once is enough, more is harmless."""
        self._admission.leave(self)

    def grant(self) -> None:
        self._granted.set()
        try:
            self._on_granted()
        except RuntimeError:  # the waiter's event loop closed: the server is shutting down
            pass


class Admission:
    """At most ``limit`` turns hold a slot at once; the others wait, first come first in."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit = {limit}: must be >= 1")
        self.limit = limit
        self._lock = threading.Lock()
        self._running = 0
        self._waiting: deque[Ticket] = deque()

    def request(self, granted: Callable[[], None] = lambda: None) -> Ticket:
        """A ticket, granted at once when a slot is free and nobody waits; else ``granted``
        is called (from the thread that frees the slot) when its turn comes."""
        ticket = Ticket(self, granted)
        with self._lock:
            self._waiting.append(ticket)
            handed = self._hand_over()
        for each in handed:
            each.grant()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.state == "waiting":
                self._waiting.remove(ticket)
            elif ticket.state == "granted":
                self._running -= 1
            ticket.state = "done"
            handed = self._hand_over()
        for each in handed:
            each.grant()

    def load(self) -> tuple[int, int]:
        """Turns holding a slot, and turns waiting for one, now."""
        with self._lock:
            return self._running, len(self._waiting)

    def _hand_over(self) -> list[Ticket]:
        handed = []
        while self._running < self.limit and self._waiting:
            ticket = self._waiting.popleft()
            ticket.state = "granted"
            self._running += 1
            handed.append(ticket)
        return handed
