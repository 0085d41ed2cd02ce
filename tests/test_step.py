"""The decode step's work does not grow row by row: counted with torch.profiler, which is
deterministic (never timed)."""

import pytest
import torch

from h2o_chat import make_cache
from h2o_chat.bench.step import profile_step
from h2o_chat.engine.step import DecodeStep
from h2o_chat.sampling import Draw, Sampling, draw_tokens
from h2o_chat.scheduler import forward_one

PRECISIONS = {"float32": {}, "K8/V4": dict(key_bits=8, value_bits=4)}


def stepping(model, rows: int, storage: dict):
    """A step of ``rows`` unlike conversations as the scheduler runs it (rows past their
    budgets, pinned system prompts, two policies), warmed up: a function running one."""
    generator = torch.Generator().manual_seed(rows)
    caches = []
    with torch.inference_mode():
        for row in range(rows):
            policy = dict(policy="h2o", heavy=8, recent=6, sink=2) if row % 3 else dict(policy="sink", sink=2, recent=12)
            cache = make_cache(model, **policy, **storage)
            cache.protect(0, 5)
            forward_one(model, cache, torch.randint(0, 128, (1, 30 + row), generator=generator))
            cache.fit_for_decoding()
            caches.append(cache)
    step, tokens = DecodeStep(), [1] * rows
    draws = [Draw(Sampling(temperature=0))] * rows

    def run() -> None:
        with torch.inference_mode():
            tokens[:] = draw_tokens(step(model, caches, tokens), list(range(rows)), draws)

    for _ in range(3):  # the rows join their pools; the plan goes on by arithmetic
        run()
    return run


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_step_of_16_rows_issues_at_most_one_and_a_half_times_the_operations_of_one(tiny_model, precision):
    one = profile_step(stepping(tiny_model, 1, PRECISIONS[precision]), torch.device("cpu"))
    many = profile_step(stepping(tiny_model, 16, PRECISIONS[precision]), torch.device("cpu"))
    assert many["ops"] <= 1.5 * one["ops"], (one, many)
    # Nothing reads a device value one element at a time (the tokens come back in one read).
    assert one["host_reads"] == many["host_reads"] == 0


def test_a_step_issues_the_same_operations_whatever_the_rows_hold(tiny_model):
    """Past their first steps, 4 and 16 rows issue the very same operations: nothing is
    done per row."""
    assert profile_step(stepping(tiny_model, 4, {}), torch.device("cpu"))["ops"] == \
        profile_step(stepping(tiny_model, 16, {}), torch.device("cpu"))["ops"]


def test_drawing_seeded_and_unseeded_rows_issues_the_same_operations_at_any_row_count():
    """Sampled rows draw on the device every row at once, seeded or not, and so do the
    rows whose nucleus reaches past the candidates: 4 rows and 32 issue the very same
    operations, and nothing reads the device an element at a time. Where no row is
    seeded, the draw skips the seeds' hash: fewer operations."""
    def costs(rows: int, seeded: bool) -> dict:
        logits = torch.randn(rows, 3000, generator=torch.Generator().manual_seed(rows)) * 6
        logits[0] *= 0.001  # flat: its nucleus goes past the candidates
        draws = [Draw(Sampling(temperature=1.0, top_p=0.9, seed=row if seeded and row % 2 else None), index=row)
                 for row in range(rows)]
        return profile_step(lambda: draw_tokens(logits, list(range(rows)), draws), torch.device("cpu"))

    for seeded in (True, False):
        few, many = costs(4, seeded), costs(32, seeded)
        assert few["ops"] == many["ops"] and few["host_reads"] == many["host_reads"] == 0, (seeded, few, many)
    assert costs(32, False)["ops"] < costs(32, True)["ops"]
