"""One limit on the bytes every conversation's caches hold together, page and API alike.

The other limits count conversations and tokens, but a cache's bytes depend on its
settings: a full cache grows with its conversation (388 MB at the embedded model's 8k
context, float32; megabytes here are 10^6 bytes, as for ``cache.budget_mb``), a bounded
one stops at its budget. ``CacheMemory`` keeps, per cache, what it held when its last
turn ended, and while a turn runs the most its caches may reach (``H2OCache.peak_bytes``).
A turn is admitted only if that sum stays within the limit; idle conversations that can
be rebuilt (the API's) are freed first, least recently used first, before a turn is
refused.

Counted are the caches' own buffers and what a decode step's shared rows (``RowPool``)
hold beyond them (spare rows and slots, as of the last step: ``add_overhead``). The
brief copy while buffers grow comes on top, for the few turns generating at once.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .config import MEGABYTE as MB  # as cache.budget_mb counts them
from .engine.cache import H2OCache
from .inputs import InputError

SETTING = "server.max_cache_mb"


class CacheMemoryFull(InputError):
    """A turn the limit cannot take: ``now`` when other conversations hold the room
    (it may fit later), else the turn alone needs more than the limit."""

    def __init__(self, message: str, field: str, now: bool) -> None:
        super().__init__(message, field)
        self.now = now


def _mb(count: int) -> str:
    return f"{count / MB:,.1f} MB"


class CacheMemory:
    """The ledger of one model's caches under ``limit`` bytes (None: no limit, counted all
    the same). Each callback of ``add_reclaimer`` frees one idle conversation that can be
    rebuilt, and says whether it freed one."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit = {limit}: must be >= 1 byte")
        self.limit = limit
        self._lock = threading.Lock()
        # What each cache holds at rest, or may reach during its turn: a cache dropped
        # with its conversation leaves the ledger with it.
        self._bytes: weakref.WeakKeyDictionary[H2OCache, int] = weakref.WeakKeyDictionary()
        self._reclaimers: list[Callable[[], bool]] = []
        self._overheads: list[Callable[[], int]] = []

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        self._reclaimers.append(reclaim)

    def add_overhead(self, bytes_now: Callable[[], int]) -> None:
        """Count ``bytes_now()`` too: memory the caches share that none of them counts
        (a decode step's spare rows). Called under the ledger's lock: it must not wait."""
        self._overheads.append(bytes_now)

    def track(self, cache: H2OCache) -> None:
        """Count what ``cache`` holds now (a cache restored from a file holds its slots
        before its first turn). Call it from the thread that owns the cache."""
        with self._lock:
            self._bytes[cache] = cache.allocated_bytes()

    @property
    def held(self) -> int:
        """Bytes counted now: caches at rest, and the most of those in a turn."""
        with self._lock:
            return sum(self._bytes.values()) + self._overhead()

    def check(self, needs: dict[H2OCache, int]) -> None:
        """Refuse (``CacheMemoryFull``) a turn whose caches may reach ``needs`` bytes if it
        would not fit now; nothing is reserved."""
        self._fit(needs, reserve=False)

    @contextmanager
    def claim(self, needs: dict[H2OCache, int]) -> Iterator[None]:
        """Hold room for a turn whose caches may reach ``needs`` bytes while it runs;
        after it, count what they really hold. Refused as ``check`` refuses."""
        self._fit(needs, reserve=True)
        try:
            yield
        finally:
            with self._lock:
                for cache in needs:
                    self._bytes[cache] = cache.allocated_bytes()

    def _fit(self, needs: dict[H2OCache, int], reserve: bool) -> None:
        with self._lock:  # a cache never needs less than it holds
            needs = {cache: max(count, self._bytes.get(cache, 0)) for cache, count in needs.items()}
        turn = sum(needs.values())
        if self.limit is not None and turn > self.limit:
            raise CacheMemoryFull(
                f"this turn's caches may take up to {_mb(turn)}, past what all conversations' caches may hold "
                f"({SETTING} = {self.limit // MB:,}): start a new conversation, use a bounded cache (the h2o, "
                "turns, recent or sink policy) or a smaller budget, or raise the limit", "messages", now=False)
        if self._take(needs, reserve):
            return
        # Idle conversations that can be rebuilt go first, least recently used first; then
        # what only a reference cycle still keeps.
        for free in [*self._reclaimers, _collect_garbage]:
            while True:
                freed = free()
                if self._take(needs, reserve):
                    return
                if not freed:
                    break
        with self._lock:
            others = self._others(needs)
        raise CacheMemoryFull(
            f"the server's caches hold {_mb(others)} of the {self.limit // MB:,} MB all "
            f"conversations' caches may hold ({SETTING}), and this turn's may take up to {_mb(turn)}: close "
            "chats or tabs you no longer use, or retry once other conversations have ended", SETTING, now=True)

    def _take(self, needs: dict[H2OCache, int], reserve: bool) -> bool:
        """Whether ``needs`` fits beside the other caches; if so and ``reserve``, counted."""
        with self._lock:
            if self.limit is not None and self._others(needs) + sum(needs.values()) > self.limit:
                return False
            if reserve:
                self._bytes.update(needs)
            return True

    def _others(self, needs: dict[H2OCache, int]) -> int:
        return sum(count for cache, count in self._bytes.items() if cache not in needs) + self._overhead()

    def _overhead(self) -> int:
        return sum(bytes_now() for bytes_now in self._overheads)


def _collect_garbage() -> bool:
    gc.collect()
    return False
