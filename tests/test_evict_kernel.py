"""The decode step's eviction kernel (engine/evict_kernel.py) against the rule it fuses
(selection.ranking_key, middle_slots, lowest_slot). It runs on CUDA only; here it runs in
Triton's interpreter on the CPU (`make test` adds Triton to a CPU build of torch). On a
GPU, `python -m h2o_chat.bench gpu` checks the step that uses it (kept positions equal
the CPU rule, batched rows equal each alone)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

# Slots over more than one block of the kernel; few distinct scores (ties, which the
# newest breaks); pins; windows; rows with spare slots past their live ones, a row with
# one live slot; every ranking, alone and mixed, with and without an open turn.
PROGRAM = """
import torch
from h2o_chat.engine import evict_kernel
from h2o_chat.engine.batch import END, FIELDS, OPENED, POSITION, RANKING, SLOT, START
from h2o_chat.engine.selection import RANK_MEAN, RANK_RECENCY, RANK_SCORE, lowest_slot, middle_slots, ranking_key

torch.manual_seed(0)
layers, rows, heads, slots = 2, 5, 3, 300
plan = torch.zeros(rows, FIELDS, dtype=torch.long)
plan[:, SLOT] = torch.tensor([299, 250, 40, 0, 180])
plan[:, POSITION] = plan[:, SLOT] + torch.tensor([900, 0, 7, 0, 3000])
plan[:, START] = torch.tensor([4, 0, 2, 0, 4])
plan[:, END] = plan[:, POSITION] - torch.tensor([32, 16, 8, 0, 64])
plan[:, OPENED] = plan[:, POSITION] - torch.tensor([100, 20, 5, 0, 900])
plan[:, RANKING] = torch.tensor([RANK_SCORE, RANK_MEAN, RANK_RECENCY, RANK_MEAN, RANK_SCORE])
# Distinct positions among each head's live slots, scattered as eviction leaves them.
positions = torch.stack([torch.randperm(slots + 9)[:slots] for _ in range(layers * rows * heads)])
positions = (plan[:, POSITION].view(1, rows, 1, 1) - positions.view(layers, rows, heads, slots)).clamp(min=-1)
scores = (torch.randint(1, 6, (layers, rows, heads, slots + 4)) / 4.0)[..., :slots]
pinned = (torch.rand(layers, rows, heads, slots + 4) < 0.1)[..., :slots]
live = torch.arange(slots) < (plan[:, SLOT] + 1)[:, None]


def per_row(field):
    return plan[:, field].view(1, -1, 1, 1)


for rankings, turns in (({RANK_SCORE}, False), ({RANK_MEAN}, True), ({RANK_SCORE, RANK_MEAN, RANK_RECENCY}, True),
                        ({RANK_SCORE, RANK_RECENCY}, False)):
    rankings = frozenset(rankings)
    ranking = next(iter(rankings)) if len(rankings) == 1 else per_row(RANKING)
    key = ranking_key(ranking, scores, positions, per_row(POSITION) + 1, rankings, per_row(OPENED) if turns else 0)
    middle = middle_slots(positions, pinned, per_row(START), per_row(END), live[None, :, None, :])
    want = lowest_slot(key, positions, middle)
    got = evict_kernel.lowest_slot(scores, positions, pinned, plan, rankings, turns)
    assert got.shape == want.shape == (layers, rows, heads, 1) and got.dtype == torch.long
    assert middle.any(-1).sum() > 20 and (~middle.any(-1)).sum() > 0
    assert torch.equal(got, want), (rankings, turns, (got != want).nonzero())
    print("same", sorted(rankings), turns)
"""


def test_eviction_kernel_picks_the_slot_the_rule_picks_in_the_interpreter() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=os.environ | {"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:-1] == ["same [0] False", "same [1] True", "same [0, 1, 2] True",
                                              "same [0, 2] False"]
