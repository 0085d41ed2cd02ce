"""Generations decoding through the app's own scheduler, each read by a thread of its own
as a turn reads its reply: what a bench that calls the decode step directly leaves out
(the scheduler's host work per row: settling each row's pass, drawing its token, waking
its reader)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from h2o_chat.generation import Generation
from h2o_chat.scheduler import BatchScheduler

# How often the timing thread looks at the rows' counts: short beside the tens of steps
# timed, and long enough not to compete for the interpreter with the worker.
POLL_S = 0.002


def time_steps(scheduler: BatchScheduler, generations: list[Generation], timed_from: int, timed_to: int,
               read: bool = True) -> float:
    """Milliseconds a step of ``scheduler`` while every one of ``generations`` draws its
    tokens ``timed_from`` to ``timed_to`` (each read by a thread of its own unless
    ``read`` is False). Waits for every generation to end, then closes ``scheduler`` (made
    for this run: its worker then holds none of them); raises where one ended before its
    ``max_new_tokens``."""
    streams = [scheduler.generate(generation) for generation in generations]
    readers = [threading.Thread(target=_read, args=(stream,)) for stream in streams] if read else []
    for reader in readers:
        reader.start()
    try:
        step_ms = step_ms_between(scheduler, lambda: [math.inf if g.done.is_set() else g.generated
                                                      for g in generations], timed_from, timed_to)
        for generation in generations:
            generation.done.wait()
    finally:
        scheduler.close()
        for reader in readers:
            reader.join()
    early = [g for g in generations if g.finish != "length"]
    if early:
        raise RuntimeError(f"a row ended early ({early[0].finish}): {early[0].error!r}")
    return step_ms


def step_ms_between(scheduler: BatchScheduler, counts: Callable[[], list[float]], timed_from: int,
                    timed_to: int) -> float:
    """Milliseconds a step of ``scheduler`` while every one of ``counts()`` (the tokens
    each row has drawn) goes from ``timed_from`` to ``timed_to``."""
    def wait_for(count: int) -> None:
        while min(counts()) < count:
            time.sleep(POLL_S)

    wait_for(timed_from)
    steps, started = scheduler.steps, time.perf_counter()
    wait_for(timed_to)
    return 1000 * (time.perf_counter() - started) / max(scheduler.steps - steps, 1)


def _read(stream) -> None:
    for _ in stream:
        pass
