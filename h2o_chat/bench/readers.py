"""What the threads reading the replies cost the scheduler's worker.

``python -m h2o_chat.bench readers [--threads 1] [--reader-rows 16,64,128] [--step-rounds 5]``

Rows of a tiny random Llama (2 layers: steps of a few milliseconds, as a real model's
on a GPU, where the host's share of a step shows) decode in one ``BatchScheduler``, each
generation read by a thread of its own as a turn reads it. Per row count, three ways,
alternating in one process: nobody reading (the floor), each reader woken on every
token, and readers woken as the app wakes them (``scheduler.WAKE_PER_ROW_S``). Each way
times the steps while every row draws its tokens 20 to 220.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from h2o_chat.engine.build import make_cache
from h2o_chat.generation import Generation
from h2o_chat.sampling import Sampling
from h2o_chat.scheduler import WAKE_MAX_S, WAKE_PER_ROW_S, BatchScheduler

from . import gpu_models, scheduled
from .report import md_table

# Every row draws this many tokens; the steps in between these counts are timed.
TOKENS, TIMED_FROM, TIMED_TO = 300, 20, 220
# How each way wakes the readers: (per row, at most); None: nobody reads.
WAYS: dict[str, tuple[float, float] | None] = {
    "no readers": None,
    "woken every token": (0.0, 0.0),
    "woken as the app does": (WAKE_PER_ROW_S, WAKE_MAX_S),
}


def time_steps(model, rows: int, wake: tuple[float, float] | None) -> float:
    """Milliseconds a step while ``rows`` generations decode, read as ``wake`` says."""
    per_row, most = wake or (WAKE_PER_ROW_S, WAKE_MAX_S)
    scheduler = BatchScheduler(model, max_batch=rows, wake_per_row_s=per_row, wake_max_s=most)
    generator = torch.Generator().manual_seed(rows)
    vocab = model.config.vocab_size
    generations = [Generation(make_cache(model, "h2o", heavy=30, recent=30, sink=4),
                              torch.randint(0, vocab, (40 + row,), generator=generator).tolist(), 0,
                              Sampling(max_new_tokens=TOKENS, temperature=0, min_new_tokens=TOKENS),
                              chunk=256, reply=[]) for row in range(rows)]
    return scheduled.time_steps(scheduler, generations, TIMED_FROM, TIMED_TO, read=wake is not None)


def run(row_counts: list[int], rounds: int, log: Callable[[str], None]) -> dict:
    model = gpu_models.build(gpu_models.SHAPES["tiny"], torch.device("cpu"), dtype=torch.float32)
    times: dict[tuple[int, str], list[float]] = {}
    for round_ in range(rounds):
        for rows in row_counts:
            for way, wake in WAYS.items():
                times.setdefault((rows, way), []).append(time_steps(model, rows, wake))
        log(f"readers: round {round_ + 1}/{rounds} done")
    results = []
    for rows in row_counts:
        floor = statistics.median(times[rows, "no readers"])
        for way in WAYS:
            step_ms = statistics.median(times[rows, way])
            results.append(dict(rows=rows, way=way, step_ms=step_ms, times=times[rows, way],
                                to_floor=step_ms / floor))
    return dict(model=gpu_models.SHAPES["tiny"].label, rounds=rounds, wake_per_row_s=WAKE_PER_ROW_S,
                wake_max_s=WAKE_MAX_S, results=results)


def markdown(result: dict) -> str:
    head = (f"{result['model']}, float32 on the CPU; each reader woken at most once in "
            f"{1000 * result['wake_per_row_s']:.1f} ms per row (at most {1000 * result['wake_max_s']:.0f} ms) "
            f"as the app does; median of {result['rounds']} alternating rounds.")
    table = md_table(["rows", "readers", "step ms", "/ no readers"],
                     [[r["rows"], r["way"], f"{r['step_ms']:.2f}", f"{r['to_floor']:.2f}×"]
                      for r in result["results"]])
    return f"{head}\n\n{table}"
