"""Scored decode attention as one Triton kernel on CUDA: the output and each slot's
received attention mass of one new token per row, reading every key and value once.

Measured on an H200 (docs/benchmarks.md, "The GPU check"): at 512 rows of 820 slots a
layer took 0.78 ms through batched matrix products, an explicit float32 softmax and
their casts (matrix products of four query rows per KV head run far below the memory's
speed), against 0.45 ms here. Imported only where Triton is (``attention.py`` asks).

Per (row, KV head) one program walks the row's live slots in blocks with an online
softmax (the running maximum and sum of each query head of the group), accumulating
the output, and writes the raw logits aside; a second kernel turns those into the
probabilities' column sums with the final maxima and sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Slots per block. ``tl.dot`` takes at least 16 rows: a group's query heads are padded to it.
BLOCK = 64
MIN_ROWS = 16


@triton.jit
def _attend(query, keys, values, lengths, out, logits, lse,
            q_row, q_head, q_group, k_row, k_head, k_slot, v_row, v_head, v_slot,
            o_row, o_head, o_group, l_row, l_head, l_group, scaling,
            GROUPS: tl.constexpr, PADDED: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    live = tl.load(lengths + row)
    group = tl.arange(0, PADDED)
    dim = tl.arange(0, DIM)
    in_group = group < GROUPS
    q = tl.load(query + row * q_row + head * q_head + group[:, None] * q_group + dim[None, :],
                mask=in_group[:, None], other=0.0)
    top = tl.full([PADDED], float("-inf"), tl.float32)
    total = tl.zeros([PADDED], tl.float32)
    acc = tl.zeros([PADDED, DIM], tl.float32)
    for start in range(0, live, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        held = slot < live
        k = tl.load(keys + row * k_row + head * k_head + slot[:, None] * k_slot + dim[None, :],
                    mask=held[:, None], other=0.0)
        x = tl.dot(q, tl.trans(k)) * scaling
        x = tl.where(held[None, :], x, float("-inf"))
        tl.store(logits + row * l_row + head * l_head + group[:, None] * l_group + slot[None, :], x,
                 mask=in_group[:, None] & held[None, :])
        new_top = tl.maximum(top, tl.max(x, 1))
        kept = tl.exp(top - new_top)
        p = tl.exp(x - new_top[:, None])
        total = total * kept + tl.sum(p, 1)
        v = tl.load(values + row * v_row + head * v_head + slot[:, None] * v_slot + dim[None, :],
                    mask=held[:, None], other=0.0)
        acc = acc * kept[:, None] + tl.dot(p.to(v.dtype), v)
        top = new_top
    # A row with no live slot (a padding row) reads nothing: zeros, and no mass below.
    total = tl.where(total == 0.0, 1.0, total)
    tl.store(out + row * o_row + head * o_head + group[:, None] * o_group + dim[None, :], acc / total[:, None],
             mask=in_group[:, None])
    tl.store(lse + (row * tl.num_programs(1) + head) * GROUPS + group, top + tl.log(total), mask=in_group)


@triton.jit
def _received(logits, lse, lengths, received, l_row, l_head, l_group, r_row, r_head, slots,
              GROUPS: tl.constexpr, PADDED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    live = tl.load(lengths + row)
    group = tl.arange(0, PADDED)
    in_group = group < GROUPS
    held = slot < live
    norm = tl.load(lse + (row * tl.num_programs(1) + head) * GROUPS + group, mask=in_group, other=0.0)
    x = tl.load(logits + row * l_row + head * l_head + group[:, None] * l_group + slot[None, :],
                mask=in_group[:, None] & held[None, :], other=float("-inf"))
    mass = tl.sum(tl.exp(x - norm[:, None]), 0)
    tl.store(received + row * r_row + head * r_head + slot, tl.where(held, mass, 0.0), mask=slot < slots)


def probe(device: torch.device) -> None:
    """Build and run the kernels once on ``device``: raises where Triton cannot build
    them there (it compiles a launcher with the system's C compiler, which a slim image
    may lack)."""
    one = torch.zeros((1, 1, 1, MIN_ROWS), dtype=torch.bfloat16, device=device)
    scored_decode(one, one, one, torch.ones(1, dtype=torch.int32, device=device), 1.0)
    torch.cuda.synchronize(device)


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel computes this call: half precision on CUDA, one query token, a
    power-of-two head dimension (Triton's block shapes), channels contiguous."""
    dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype
            and query.shape[2] == 1 and dim >= 16 and dim & (dim - 1) == 0 and key.stride(-1) == 1
            and value.dtype == query.dtype and value.stride(-1) == 1)


def scored_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` ``(rows, q_heads, 1, dim)`` over ``key``/``value`` ``(rows, kv_heads,
    slots, dim)`` of which each row's first ``lengths[row]`` are live: the output
    ``(rows, 1, q_heads, dim)`` and the float32 mass each slot received ``(rows, kv_heads,
    slots)``, summed over the group's query heads (zero past a row's live slots)."""
    rows, q_heads, _, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    padded = max(MIN_ROWS, triton.next_power_of_2(groups))
    grouped = query.reshape(rows, kv_heads, groups, dim)
    lengths = lengths.to(torch.int32)
    out = torch.empty((rows, kv_heads, groups, dim), dtype=torch.float32, device=query.device)
    logits = torch.empty((rows, kv_heads, groups, slots), dtype=torch.float32, device=query.device)
    lse = torch.empty((rows, kv_heads, groups), dtype=torch.float32, device=query.device)
    _attend[(rows, kv_heads)](grouped, key, value, lengths, out, logits, lse,
                              *grouped.stride()[:3], *key.stride()[:3], *value.stride()[:3],
                              *out.stride()[:3], *logits.stride()[:3], scaling,
                              GROUPS=groups, PADDED=padded, DIM=dim, BLOCK=BLOCK)
    received = torch.empty((rows, kv_heads, slots), dtype=torch.float32, device=query.device)
    _received[(rows, kv_heads, triton.cdiv(slots, BLOCK))](logits, lse, lengths, received,
                                                           *logits.stride()[:3], *received.stride()[:2], slots,
                                                           GROUPS=groups, PADDED=padded, BLOCK=BLOCK)
    output = out.view(rows, q_heads, 1, dim).transpose(1, 2).to(query.dtype)
    return output, received
