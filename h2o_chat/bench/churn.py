"""What rows coming and going cost the scheduler's pass.

``python -m h2o_chat.bench churn [--threads 1] [--churn-rows 128,512] [--step-rounds 3]``

On a server a reply ends and another begins at most steps. Rows of a tiny random Llama
(2 layers, float32: steps of a few milliseconds, as a real model's on a GPU, where the
host's share of a step shows), each with ``HISTORY`` tokens of its own history already
fed to an h2o cache of 30 + 30 + 4 slots, decode through one ``BatchScheduler`` of
``rows`` rows at most. "steady": every row decodes on for the whole timed window.
"churn": the replies are staggered so that one ends at every pass, and a conversation
waiting its turn (its history fed too, so it joins as a decode row) takes its place at
the next. Both time the same number of passes; each way alternates with the other in one
process, and the table gives the median of the rounds. Nobody reads the replies (the
``readers`` bench measures what readers cost), so a pass is the worker's own work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from h2o_chat.engine.build import make_cache
from h2o_chat.generation import Generation
from h2o_chat.sampling import Sampling
from h2o_chat.scheduler import BatchScheduler, forward_one

from . import gpu_models, scheduled
from .report import md_table

HISTORY = 100  # tokens each conversation has read before it decodes
WARM = 8  # passes before the timed window: every row has joined and the pools have grown
# Passes the rows would go on as in the window after it: the window ends where the
# timing thread sees it has (a poll), a few passes late with passes shorter than a poll.
AFTER = 64
WAYS = ("steady", "churn")


def history_cache(model, seed: int):
    """An h2o cache that has read ``HISTORY`` tokens of its own (unlike its neighbours':
    each row keeps other positions), and the token it decodes from."""
    cache = make_cache(model, "h2o", heavy=30, recent=30, sink=4)
    tokens = torch.randint(model.config.vocab_size, (HISTORY + 1,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        forward_one(model, cache, tokens[None, :HISTORY])
        cache.fit_for_decoding()  # as a turn's prompt leaves it: buffers of its budget
    return cache, int(tokens[HISTORY])


def generation(cache, token: int, tokens: int) -> Generation:
    """A reply of exactly ``tokens`` tokens (greedy, never ending early) from ``cache``."""
    seen = cache.get_seq_length()
    sampling = Sampling(max_new_tokens=tokens, temperature=0, min_new_tokens=tokens)
    return Generation(cache, [0] * seen + [token], seen, sampling, chunk=1, reply=[])


def replies_of_churn(k: int, rows: int, passes: int) -> int:
    """The length of the ``k``-th reply of the churn way: the ``k``-th ends at pass ``WARM
    + 1 + k`` (passes count from 1), so one ends at every pass of the window; the first
    ``rows`` start at pass 1, each later one at the pass after the one that made room."""
    if k >= passes + AFTER:
        return WARM + passes + AFTER  # goes on past the window
    start = 1 if k < rows else WARM + 1 + (k - rows) + 1
    return WARM + 1 + k - start + 1


def time_passes(model, rows: int, passes: int, way: str) -> dict:
    """Milliseconds a pass of ``rows`` rows over ``passes`` passes, the way ``way`` says,
    and how many replies ended in them (churn: about one a pass; steady: none)."""
    lengths = [WARM + passes + AFTER] * rows  # past the window: closed after it
    if way == "churn":
        lengths = [replies_of_churn(k, rows, passes) for k in range(rows + passes + AFTER)]
    made = [history_cache(model, seed) for seed in range(len(lengths))]
    generations = [generation(cache, token, tokens) for (cache, token), tokens in zip(made, lengths)]
    del made
    scheduler = BatchScheduler(model, gather_s=scheduled.GATHER_S, max_batch=rows)
    streams = [scheduler.generate(g) for g in generations]  # kept: a stream let go stops its reply

    def ended() -> int:
        return sum(g.done.is_set() for g in generations)

    try:
        while scheduler.steps < WARM:
            time.sleep(scheduled.POLL_S)
        steps, ends, started = scheduler.steps, ended(), time.perf_counter()
        while scheduler.steps < steps + passes:
            time.sleep(scheduled.POLL_S)
        elapsed, steps, ends = time.perf_counter() - started, scheduler.steps - steps, ended() - ends
    finally:
        scheduler.close()
    del streams
    failed = [g for g in generations if g.finish == "failed"]
    if failed:
        raise RuntimeError(f"a row failed: {failed[0].error!r}")
    return dict(pass_ms=1000 * elapsed / steps, passes=steps, ended=ends)


def run(row_counts: list[int], passes: int, rounds: int, log: Callable[[str], None]) -> dict:
    shape = gpu_models.SHAPES["tiny"]
    model = gpu_models.build(shape, torch.device("cpu"), dtype=torch.float32)
    times: dict[tuple[int, str], list[dict]] = {}
    for round_ in range(rounds):
        for rows in row_counts:
            for way in WAYS:
                times.setdefault((rows, way), []).append(time_passes(model, rows, passes, way))
        log(f"churn: round {round_ + 1}/{rounds} done")
    results = []
    for rows in row_counts:
        steady = statistics.median(t["pass_ms"] for t in times[rows, "steady"])
        for way in WAYS:
            pass_ms = statistics.median(t["pass_ms"] for t in times[rows, way])
            ended, passes_run = (sum(t[key] for t in times[rows, way]) for key in ("ended", "passes"))
            results.append(dict(rows=rows, way=way, pass_ms=pass_ms, to_steady=pass_ms / steady, ended=ended,
                                passes=passes_run, times=[t["pass_ms"] for t in times[rows, way]]))
    return dict(model=f"{shape.label}, h2o 30 + 30 + 4 slots, {HISTORY} tokens of history", passes=passes,
                rounds=rounds, results=results)


def markdown(result: dict) -> str:
    head = (f"{result['model']}, float32 on the CPU; {result['passes']} passes timed each way; median of "
            f"{result['rounds']} alternating rounds.")
    table = md_table(["rows", "way", "replies ended a pass", "pass ms", "/ steady"],
                     [[r["rows"], r["way"], f"{r['ended'] / r['passes']:.2f}", f"{r['pass_ms']:.2f}",
                       f"{r['to_steady']:.2f}×"] for r in result["results"]])
    return f"{head}\n\n{table}"
