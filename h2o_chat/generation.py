"""One turn's work for the model's runner, as plain data in and token ids out.

A ``Generation`` names a cache, the conversation's tokens (of which the cache has seen
``tokens[:fed]``) and how to sample. The runner feeds the unseen tokens in chunks, samples
each next token from the logits of the pass that predicts it, appends it to ``tokens``
and feeds it back in its next step, until the reply ends: the caller never stands
between two forward passes. The caller reads what was sampled from ``stream()``.

The last sampled token always stays unfed, so when a generation ends the cache has seen
exactly ``tokens[:fed]``, whatever ended it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

import torch

from .engine.cache import H2OCache
from .sampling import Draw, Sampling


# Why a generation ended: "end" (the model ended its turn), "length" (it reached
# max_new_tokens; a generation that only feeds ends so too), "stopped" (its stop event,
# or its stream closed before the end) or "failed" (a forward pass raised).
FinishReason = Literal["end", "length", "stopped", "failed"]

# Called in the runner's thread after each pass that ends a chunk, before the next pass:
# the conversation's tokens, the span [start, end) of it just fed, the logits of its last.
PassObserver = Callable[[list[int], int, int, torch.Tensor], None]


class Generation:
    """A turn's request to the runner and its progress (see the module docstring).

    ``sampling`` None only feeds: it ends once every token is fed. ``end_ids`` end the
    reply (never sampled before ``sampling.min_new_tokens``); ``never`` are token ids never
    sampled. ``lock`` is held by the runner while it changes the cache or ``tokens``:
    whoever reads them during the turn takes it too. ``reply`` receives each sampled
    token as ``tokens`` does."""

    def __init__(self, cache: H2OCache, tokens: list[int], fed: int, sampling: Sampling | None, *,
                 chunk: int, reply: list[int], end_ids: frozenset[int] = frozenset(),
                 never: torch.Tensor | None = None, stop: threading.Event | None = None,
                 lock: threading.RLock | None = None, observer: PassObserver | None = None) -> None:
        if fed >= len(tokens):  # a runner would never end it, and the caller wait for ever
            raise ValueError("a generation needs at least one token to feed")
        if chunk < 1:
            raise ValueError(f"chunk = {chunk}: must be >= 1")
        self.cache, self.tokens, self.fed, self.sampling = cache, tokens, fed, sampling
        self.chunk, self.reply, self.end_ids, self.never = chunk, reply, end_ids, never
        self.stop = stop if stop is not None else threading.Event()
        self.lock = lock if lock is not None else threading.RLock()
        self.observer = observer
        self.chunk_start = fed  # where the chunk being fed began
        self.generated = 0
        self.finish: FinishReason | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        # Set by the runner while the cache holds something of the runner's (a pool row):
        # called as the generation ends, before its caller hears of it.
        self.on_end: Callable[[], None] | None = None
        self._cancelled = False  # its stream was closed: end, without touching ``stop``
        self._told = len(reply)  # the reply's length as the caller last heard it
        self._woken_at = -float("inf")  # when the caller was last woken (time.monotonic)
        self._out: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._end_tensor = torch.tensor(sorted(end_ids), dtype=torch.long)

    # ---- for the runner ---------------------------------------------------------------------

    @property
    def chunk_end(self) -> int:
        """Where the chunk being fed ends: the cache evicts only there. A chunk ends where a
        turn begins, too, so a turn-aware cache can close the turn before it there."""
        end = min(self.chunk_start + self.chunk, len(self.tokens))
        if end - self.chunk_start == 1:  # no turn begins inside one token (asked of every row, every step)
            return end
        turn = self.cache.turn_start_after(self.chunk_start)
        return end if turn is None else min(end, turn)

    @property
    def is_decode(self) -> bool:
        """Its next pass feeds one token and ends a chunk: a row of a batched step."""
        return self.chunk_end - self.chunk_start == 1

    @property
    def stopping(self) -> bool:
        return self.stop.is_set() or self._cancelled

    def fed_to(self, end: int, logits: torch.Tensor, row: int = 0) -> Draw | None:
        """The runner fed ``tokens[fed:end]``; row ``row`` of ``logits`` ``(rows, vocab)`` is
        its last's. At a chunk's end the observer sees it; after the last unfed token the
        runner must draw the next (returned: what to draw; ``take`` it), else None."""
        self.fed = end
        if end < self.chunk_end:
            return None
        if self.observer is not None:
            self.observer(self.tokens, self.chunk_start, end, logits[row])
        self.chunk_start = end
        if end < len(self.tokens):
            return None
        if not self.generated:  # the prompt is in: one token a pass from now on
            self.cache.fit_for_decoding()
        if self.sampling is None or self.generated == self.sampling.max_new_tokens:
            self.end("length")
            return None
        return Draw(self.sampling, self.generated, self._banned())

    def take(self, token: int, quiet_s: float = 0.0) -> None:
        """The token the runner drew for the draw ``fed_to`` asked for. The caller is woken
        for it unless it was woken less than ``quiet_s`` ago (it then reads this token
        with the next); the generation's end always wakes it."""
        self.tokens.append(token)
        self.reply.append(token)
        self.generated += 1
        if token in self.end_ids:
            self.end("end")
        elif self.generated == self.sampling.max_new_tokens:
            self.end("length")
        elif (now := time.monotonic()) - self._woken_at >= quiet_s:
            self._woken_at = now
            self._wake()

    def _wake(self) -> None:
        """Hand the caller the reply's length, if it grew since the caller last heard."""
        if len(self.reply) != self._told:
            self._told = len(self.reply)
            self._out.put(self._told)

    def _banned(self) -> torch.Tensor | None:
        """Token ids the next draw must skip: ``never``, and the end-of-turn ids before
        ``min_new_tokens``."""
        if self.generated < self.sampling.min_new_tokens:
            return self._end_tensor if self.never is None else torch.cat([self._end_tensor, self.never])
        return self.never

    def end(self, reason: FinishReason, error: BaseException | None = None) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            try:
                on_end()
            except BaseException as err:  # the caller must hear of the end all the same
                reason, error = "failed", error or err
        self.error = error
        self.finish = reason
        self._wake()
        self._out.put(None)
        self.done.set()

    # ---- for the caller ---------------------------------------------------------------------

    def stream(self) -> Iterator[int]:
        """The length of ``reply`` each time the runner wakes the caller: after each token
        sampled, or after several (see ``take``), and at the end; raises what failed a
        pass. Closed early, the generation ends after the runner's step under way."""
        try:
            while (count := self._out.get()) is not None:
                yield count
            if self.error is not None:
                raise self.error
        finally:
            if not self.done.is_set():
                self._cancelled = True
                self.done.wait()

    def ready(self) -> Iterator[int]:
        """What ``stream`` would give now without waiting (for a runner in the caller's
        own thread)."""
        while True:
            try:
                count = self._out.get_nowait()
            except queue.Empty:
                return
            if count is None:
                if self.error is not None:
                    raise self.error
                return
            yield count
