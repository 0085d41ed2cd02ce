"""The decode step's choice of the slot to drop as one Triton kernel on CUDA: per layer,
row and KV head, the middle slot of lowest key, of equal keys the newest
(``selection.lowest_slot`` over ``ranking_key`` and ``middle_slots``), in one pass over
each slot's score, position and pin.

In torch the same takes about ten passes over every slot (the key, four comparisons
for the middle, a fill, a minimum, an equality, a fill of the positions, an arg-max),
most of them over 64-bit positions: at a large batch as many bytes as a fifth of the
keys and values attention reads (a 1B model's 64 channels of 16 bits, twice). Imported
only where Triton is (``kernels.load``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .batch import END, OPENED, POSITION, RANKING, SLOT, START
from .selection import RANK_MEAN, RANK_RECENCY, RANK_SCORE

BLOCK = 256


@triton.jit
def _lowest(scores, positions, pinned, plan, drop, slots,
            s_layer, s_row, s_head, q_layer, q_row, q_head, n_layer, n_row, n_head, d_layer, d_row, d_head, p_row,
            RANKING_OF_ALL: tl.constexpr, KINDS: tl.constexpr, TURNS: tl.constexpr,
            F_START: tl.constexpr, F_END: tl.constexpr, F_SLOT: tl.constexpr, F_POSITION: tl.constexpr,
            F_OPENED: tl.constexpr, F_RANKING: tl.constexpr,
            BY_MEAN: tl.constexpr, BY_RECENCY: tl.constexpr, BLOCK: tl.constexpr):
    layer = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    scores += layer * s_layer + row * s_row + head * s_head
    positions += layer * q_layer + row * q_row + head * q_head
    pinned += layer * n_layer + row * n_row + head * n_head
    plan += row * p_row
    start = tl.load(plan + F_START)
    end = tl.load(plan + F_END)
    live = tl.load(plan + F_SLOT) + 1
    seen = tl.load(plan + F_POSITION) + 1
    ranking = RANKING_OF_ALL
    if RANKING_OF_ALL < 0:
        ranking = tl.load(plan + F_RANKING)
    best_key = float("inf")
    best_position = tl.full([], -1, tl.int64)
    best_slot = tl.full([], 0, tl.int64)
    for begin in range(0, slots, BLOCK):
        slot = begin + tl.arange(0, BLOCK)
        exists = slot < slots
        score = tl.load(scores + slot, mask=exists, other=0.0)
        position = tl.load(positions + slot, mask=exists, other=-1)
        pin = tl.load(pinned + slot, mask=exists, other=1)
        middle = exists & (pin == 0) & (position >= start) & (position < end) & (slot < live)
        # ``selection.ranking_key``: higher stays.
        key = score
        if KINDS & ((1 << BY_MEAN) | (1 << BY_RECENCY)):
            age = (seen - position).to(tl.float32)
            if KINDS & (1 << BY_MEAN):
                mean = tl.math.div_rn(score, tl.maximum(age, 1.0))
                if TURNS:  # slots of closed turns hold final scores, made means already
                    mean = tl.where(position >= tl.load(plan + F_OPENED), mean, score)
                key = tl.where(ranking == BY_MEAN, mean, key)
            if KINDS & (1 << BY_RECENCY):
                key = tl.where(ranking == BY_RECENCY, -age, key)
        # ``selection.lowest_slot``: of the lowest keys the newest position, of equal
        # positions the first slot (arg-max's).
        key = tl.where(middle, key, float("inf"))
        lowest = tl.min(key, 0)
        candidate = exists & (key == lowest)
        newest = tl.max(tl.where(candidate, position, -1), 0)
        first = tl.min(tl.where(candidate & (position == newest), slot, slots), 0).to(tl.int64)
        better = (lowest < best_key) | ((lowest == best_key) & (newest > best_position))
        best_key = tl.where(better, lowest, best_key)
        best_position = tl.where(better, newest, best_position)
        best_slot = tl.where(better, first, best_slot)
    tl.store(drop + layer * d_layer + row * d_row + head * d_head, best_slot)


def lowest_slot(scores: torch.Tensor, positions: torch.Tensor, pinned: torch.Tensor, plan: torch.Tensor,
                rankings: frozenset[int], turns: bool) -> torch.Tensor:
    """``(layers, rows, kv_heads, 1)``: per layer, row and KV head of the step's slot
    buffers ``(layers, rows, kv_heads, slots)``, the slot ``selection.lowest_slot`` picks
    over ``ranking_key`` and ``middle_slots`` with each row's windows, live slots,
    ranking and open turn from the step's ``plan`` ``(rows, fields)``. ``rankings``:
    the kinds the rows rank by; ``turns``: whether closed turns' slots keep their scores."""
    layers, rows, heads, slots = scores.shape
    drop = torch.empty((layers, rows, heads, 1), dtype=torch.long, device=scores.device)
    kinds = sum(1 << kind for kind in rankings)
    _lowest[(layers, rows, heads)](
        scores, positions, pinned, plan, drop, slots, *scores.stride()[:3], *positions.stride()[:3],
        *pinned.stride()[:3], *drop.stride()[:3], plan.stride(0),
        RANKING_OF_ALL=next(iter(rankings)) if len(rankings) == 1 else -1, KINDS=kinds, TURNS=turns,
        F_START=START, F_END=END, F_SLOT=SLOT, F_POSITION=POSITION, F_OPENED=OPENED, F_RANKING=RANKING,
        BY_MEAN=RANK_MEAN, BY_RECENCY=RANK_RECENCY, BLOCK=BLOCK)
    return drop


def usable(*buffers: torch.Tensor) -> bool:
    """Whether the kernel reads these slot buffers (on a device ``kernels.load`` gave it
    for): slots contiguous."""
    return all(buffer.stride(-1) == 1 for buffer in buffers)


def probe(device: torch.device) -> None:
    """Build and run the kernel once on ``device`` (every ranking, turns or not)."""
    plan = torch.zeros((1, max(START, END, SLOT, POSITION, OPENED, RANKING) + 1), dtype=torch.long, device=device)
    shape = (1, 1, 1, 2)
    for rankings, turns in ((frozenset({RANK_SCORE}), False), (frozenset({RANK_SCORE, RANK_MEAN, RANK_RECENCY}), True)):
        lowest_slot(torch.zeros(shape, device=device), torch.zeros(shape, dtype=torch.long, device=device),
                    torch.zeros(shape, dtype=torch.bool, device=device), plan, rankings, turns)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
