"""Rows decoding through the app's own scheduler, each read by a thread of its own as a
turn reads its reply: what a bench that calls the decode step directly leaves out
(the scheduler's host work per row: settling each row's pass, drawing its token, waking
its reader)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from h2o_chat.generation import Generation
from h2o_chat.scheduler import BatchScheduler

# How often the timing thread looks at the rows' counts: short beside the tens of steps
# timed, and long enough not to compete for the interpreter with the worker.
POLL_S = 0.002
# Rows started together wait this long for each other (``BatchScheduler.gather_s``), so
# all decode in one batch from their first step.
GATHER_S = 1.0


def time_steps(scheduler: BatchScheduler, generations: list[Generation], timed_from: int, timed_to: int) -> float:
    """Milliseconds a step of ``scheduler`` while every one of ``generations`` draws its
    tokens ``timed_from`` to ``timed_to``, each read by a thread of its own (see
    ``time_turns``); raises where one ended before its ``max_new_tokens``."""
    streams = [scheduler.generate(generation) for generation in generations]
    step_ms = time_turns(scheduler, [threading.Thread(target=_read, args=(stream,)) for stream in streams],
                         lambda: [g.generated for g in generations], timed_from, timed_to)
    early = [g for g in generations if g.finish != "length"]
    if early:
        raise RuntimeError(f"a row ended early ({early[0].finish}): {early[0].error!r}")
    return step_ms


def time_turns(scheduler: BatchScheduler, turns: list[threading.Thread], counts: Callable[[], list[int]],
               timed_from: int, timed_to: int) -> float:
    """Start ``turns`` (threads whose rows decode on ``scheduler``) and give the
    milliseconds a step while every one of ``counts()`` (the tokens each row has drawn)
    goes from ``timed_from`` to ``timed_to``. Waits for the turns to end, then closes
    ``scheduler`` (made for this run: its worker then holds none of their rows)."""
    for turn in turns:
        turn.start()

    def wait_for(count: int) -> None:
        while any(n < count and turn.is_alive() for n, turn in zip(counts(), turns)):
            time.sleep(POLL_S)

    try:
        wait_for(timed_from)
        steps, started = scheduler.steps, time.perf_counter()
        wait_for(timed_to)
        step_ms = 1000 * (time.perf_counter() - started) / max(scheduler.steps - steps, 1)
        for turn in turns:
            turn.join()
    finally:
        scheduler.close()
        for turn in turns:
            turn.join()
    return step_ms


def _read(stream) -> None:
    for _ in stream:
        pass
