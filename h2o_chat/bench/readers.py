"""What the threads reading the replies cost the scheduler's worker.

``python -m h2o_chat.bench readers [--threads 1] [--reader-rows 16,64,128] [--step-rounds 5]``

Chats on a tiny random Llama with SmolLM2's vocabulary and tokenizer (2 layers: steps of
a few milliseconds, as a real model's on a GPU, where the host's share of a step shows)
decode in one ``BatchScheduler``, each ``ChatSession.send`` read by a thread of its own as
a turn reads it (its text decoded, streamed piece by piece). Per row count, alternating
in one process: readers woken only at the first token and the end (the floor), on every
token, at most once in 0.3 ms per row (session 44's rule), and as the app wakes them
(``scheduler.WAKE_PER_ROW_S``). Each way times the steps while every row draws its
tokens 20 to 220.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections.abc import Callable

import torch

from h2o_chat.engine.build import make_cache
from h2o_chat.scheduler import WAKE_MAX_S, WAKE_PER_ROW_S, BatchScheduler
from h2o_chat.sessions import ChatSession

from . import gpu_models, scheduled
from .report import md_table

# Every reply is this many tokens; the steps in between these counts are timed.
TOKENS, TIMED_FROM, TIMED_TO = 260, 20, 220
# How each way wakes the readers: (per row, at most). The first is the floor.
WAYS: dict[str, tuple[float, float]] = {
    "woken at the first token and the end": (3600.0, 3600.0),
    "woken every token": (0.0, 0.0),
    "0.3 ms a row, 100 ms at most": (0.0003, 0.1),
    "woken as the app does": (WAKE_PER_ROW_S, WAKE_MAX_S),
}


def time_steps(model, tokenizer, rows: int, wake: tuple[float, float]) -> float:
    """Milliseconds a step while ``rows`` chats decode, their readers woken as ``wake`` says."""
    scheduler = BatchScheduler(model, gather_s=scheduled.GATHER_S, max_batch=rows, wake_per_row_s=wake[0], wake_max_s=wake[1])
    sessions = [ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=30, recent=30, sink=4),
                            runner=scheduler) for _ in range(rows)]

    def chat(index: int) -> None:
        for _ in sessions[index].send(f"Question {index}: what do you know about rivers?", temperature=0,
                                      max_new_tokens=TOKENS, min_new_tokens=TOKENS):
            pass

    turns = [threading.Thread(target=chat, args=(index,)) for index in range(rows)]
    step_ms = scheduled.time_turns(scheduler, turns, lambda: [len(s.reply) for s in sessions], TIMED_FROM, TIMED_TO)
    early = [s for s in sessions if s.finish_reason != "length"]
    if early:
        raise RuntimeError(f"a reply ended early ({early[0].finish_reason})")
    return step_ms


def run(tokenizer, row_counts: list[int], rounds: int, log: Callable[[str], None]) -> dict:
    shape = dataclasses.replace(gpu_models.SHAPES["tiny"], vocab=len(tokenizer))
    model = gpu_models.build(shape, torch.device("cpu"), dtype=torch.float32)
    times: dict[tuple[int, str], list[float]] = {}
    for round_ in range(rounds):
        for rows in row_counts:
            for way, wake in WAYS.items():
                times.setdefault((rows, way), []).append(time_steps(model, tokenizer, rows, wake))
        log(f"readers: round {round_ + 1}/{rounds} done")
    results = []
    floor_way = next(iter(WAYS))
    for rows in row_counts:
        floor = statistics.median(times[rows, floor_way])
        for way in WAYS:
            step_ms = statistics.median(times[rows, way])
            results.append(dict(rows=rows, way=way, step_ms=step_ms, times=times[rows, way],
                                to_floor=step_ms / floor))
    return dict(model=f"{shape.label}, SmolLM2's vocabulary and tokenizer", rounds=rounds,
                wake_per_row_s=WAKE_PER_ROW_S, wake_max_s=WAKE_MAX_S, results=results)


def markdown(result: dict) -> str:
    head = (f"{result['model']}, float32 on the CPU; chats read as turns read them; the app wakes each reader "
            f"at most once in {1000 * result['wake_per_row_s']:.1f} ms per row (at most "
            f"{1000 * result['wake_max_s']:.0f} ms); median of {result['rounds']} alternating rounds.")
    table = md_table(["rows", "readers", "step ms", "/ first token and end only"],
                     [[r["rows"], r["way"], f"{r['step_ms']:.2f}", f"{r['to_floor']:.2f}×"]
                      for r in result["results"]])
    return f"{head}\n\n{table}"
