"""Scored decode attention as one Triton kernel on CUDA: the output and each slot's
received attention mass of one new token per row, reading every key and value once.

Measured on an H200 (docs/benchmarks.md, "The GPU check"): at 512 rows of 820 slots a
layer took 0.78 ms through batched matrix products, an explicit float32 softmax and
their casts (matrix products of four query rows per KV head run far below the memory's
speed), against 0.45 ms here. Imported only where Triton is (``attention.py`` asks).

Per (row, KV head) one program walks the row's live slots in blocks with an online
softmax (the running maximum and sum of each query head of the group), accumulating
the output, and writes the raw logits aside; a second kernel turns those into the
probabilities' column sums with the final maxima and sums and adds them to the slots'
scores (a pass and a kernel fewer per layer than returning them). Where rows are few,
each (row, KV head)'s slots are split among several programs (as flash-decoding does),
each writing its part of the output with its log-sum-exp, and the second kernel weighs
the parts together: one row of 8 KV heads would otherwise run 8 programs on a GPU of
132 multiprocessors, each walking every slot. Slots are read as
``StoredSlots`` holds them: floats, or 8- and 4-bit codes decoded in registers (eagerly,
dequantizing a layer's 8-bit keys of 512 rows into a copy took 2.2 ms on the H200,
compiled 0.22 ms, and the copy was then read again), then the exact window's ring and
the row's new token written over their slots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .quant import make_codec
from .stored import StoredSlots
from .window import window_name

# Slots per block. ``tl.dot`` takes at least 16 rows: a group's query heads are padded to it.
BLOCK = 64
MIN_ROWS = 16


@triton.jit
def _read(data, scale, minimum, ring, new, entry, slot, held, newest, dim, d_slot, s_slot, r_entry,
          BITS: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr, RING: tl.constexpr, NEW: tl.constexpr,
          BLOCK: tl.constexpr):
    """A block of slots of one (row, KV head), as ``StoredSlots.read`` gives them; the
    pointers are already at the row and head. Floats come as stored; anything decoded or
    written over comes in float32 (the caller casts, as the reference casts its copy)."""
    if BITS == 0:
        x = tl.load(data + slot[:, None] * d_slot + dim[None, :], mask=held[:, None], other=0.0)
    else:
        # Each byte, scale and minimum loaded once, then widened to the channels in
        # registers: indexing them per channel compiled to one 2-byte load per channel
        # for the scales and minima (128 a thread a block for K8/V4 at 64 channels).
        if BITS == 8:
            code = tl.load(data + slot[:, None] * d_slot + dim[None, :], mask=held[:, None], other=0)
        else:  # byte j: channel j in its low nibble, channel j + DIM/2 in its high one
            byte = tl.load(data + slot[:, None] * d_slot + tl.arange(0, DIM // 2)[None, :], mask=held[:, None],
                           other=0)
            code = tl.reshape(tl.permute(tl.join(byte & 15, byte >> 4), (0, 2, 1)), (BLOCK, DIM))
        groups = tl.arange(0, DIM // GROUP)
        step = tl.load(scale + slot[:, None] * s_slot + groups[None, :], mask=held[:, None], other=0.0)
        low = tl.load(minimum + slot[:, None] * s_slot + groups[None, :], mask=held[:, None], other=0.0)
        x = (tl.reshape(code, (BLOCK, DIM // GROUP, GROUP)).to(tl.float32) * step.to(tl.float32)[:, :, None]
             + low.to(tl.float32)[:, :, None])
        x = tl.reshape(x, (BLOCK, DIM))
    if RING:
        from_ring = held & (entry >= 0)
        exact = tl.load(ring + entry[:, None] * r_entry + dim[None, :], mask=from_ring[:, None], other=0.0)
        x = tl.where(from_ring[:, None], exact.to(tl.float32), x.to(tl.float32))
    if NEW:
        given = tl.load(new + dim)
        x = tl.where((slot == newest)[:, None], given[None, :].to(tl.float32), x.to(tl.float32))
    return x


@triton.jit
def _attend(query, lengths, slot_entry, out, parts, logits, lse,
            k_data, k_scale, k_min, k_ring, k_new, v_data, v_scale, v_min, v_ring, v_new,
            q_row, q_head, q_group, e_row, e_head,
            kd_row, kd_head, kd_slot, ks_row, ks_head, ks_slot, kr_row, kr_head, kr_entry, kn_row, kn_head,
            vd_row, vd_head, vd_slot, vs_row, vs_head, vs_slot, vr_row, vr_head, vr_entry, vn_row, vn_head,
            o_row, o_head, o_group, l_row, l_head, l_group, p_row, p_head, p_split, p_group, scaling, span,
            K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_RING: tl.constexpr, K_NEW: tl.constexpr,
            V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_RING: tl.constexpr, V_NEW: tl.constexpr,
            ENTRIES: tl.constexpr, GROUPS: tl.constexpr, PADDED: tl.constexpr, DIM: tl.constexpr,
            BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    # 64-bit offsets: a large pool's layer passes 2**31 elements (4,096 rows of 8 KV heads
    # of 820 slots of 128 channels).
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    live = tl.load(lengths + row)
    group = tl.arange(0, PADDED)
    dim = tl.arange(0, DIM)
    in_group = group < GROUPS
    q = tl.load(query + row * q_row + head * q_head + group[:, None] * q_group + dim[None, :],
                mask=in_group[:, None], other=0.0)
    # Each quantity's pointers at this row and head.
    k_data += row * kd_row + head * kd_head
    k_scale += row * ks_row + head * ks_head
    k_min += row * ks_row + head * ks_head
    k_ring += row * kr_row + head * kr_head
    k_new += row * kn_row + head * kn_head
    v_data += row * vd_row + head * vd_head
    v_scale += row * vs_row + head * vs_head
    v_min += row * vs_row + head * vs_head
    v_ring += row * vr_row + head * vr_head
    v_new += row * vn_row + head * vn_head
    top = tl.full([PADDED], float("-inf"), tl.float32)
    total = tl.zeros([PADDED], tl.float32)
    acc = tl.zeros([PADDED, DIM], tl.float32)
    for start in range(split * span, tl.minimum(split * span + span, live), BLOCK):
        slot = start + tl.arange(0, BLOCK)
        held = slot < live
        entry = slot  # unused without a ring
        if ENTRIES:
            entry = tl.load(slot_entry + row * e_row + head * e_head + slot, mask=held, other=-1)
        k = _read(k_data, k_scale, k_min, k_ring, k_new, entry, slot, held, live - 1, dim, kd_slot, ks_slot,
                  kr_entry, K_BITS, K_GROUP, DIM, K_RING, K_NEW, BLOCK).to(q.dtype)
        x = tl.dot(q, tl.trans(k)) * scaling
        x = tl.where(held[None, :], x, float("-inf"))
        tl.store(logits + row * l_row + head * l_head + group[:, None] * l_group + slot[None, :], x,
                 mask=in_group[:, None] & held[None, :])
        new_top = tl.maximum(top, tl.max(x, 1))
        kept = tl.exp(top - new_top)
        p = tl.exp(x - new_top[:, None])
        total = total * kept + tl.sum(p, 1)
        v = _read(v_data, v_scale, v_min, v_ring, v_new, entry, slot, held, live - 1, dim, vd_slot, vs_slot,
                  vr_entry, V_BITS, V_GROUP, DIM, V_RING, V_NEW, BLOCK).to(q.dtype)
        acc = acc * kept[:, None] + tl.dot(p.to(q.dtype), v)
        top = new_top
    # A row or split with no live slot (a padding row) reads nothing: zeros, weighing nothing.
    total = tl.where(total == 0.0, 1.0, total)
    if SPLIT:  # a part of the output, in float32, for ``_finish`` to weigh against the others
        tl.store(parts + row * p_row + head * p_head + split * p_split + group[:, None] * p_group + dim[None, :],
                 acc / total[:, None], mask=in_group[:, None])
    else:
        tl.store(out + row * o_row + head * o_head + group[:, None] * o_group + dim[None, :],
                 (acc / total[:, None]).to(out.dtype.element_ty), mask=in_group[:, None])
    tl.store(lse + ((row * tl.num_programs(1) + head) * tl.num_programs(2) + split) * GROUPS + group,
             top + tl.log(total), mask=in_group)


@triton.jit
def _finish(logits, lse, parts, out, lengths, scores, counted, splits, l_row, l_head, l_group,
            p_row, p_head, p_split, p_group, o_row, o_head, o_group, s_row, s_head, s_slot, c_row, c_head,
            GROUPS: tl.constexpr, PADDED: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
            COUNTED: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    block = tl.program_id(2)
    slot = block * BLOCK + tl.arange(0, BLOCK)
    live = tl.load(lengths + row)
    group = tl.arange(0, PADDED)
    in_group = group < GROUPS
    held = slot < live
    # Each query head's log-sum-exp over its splits' parts; 0 where no part holds a slot
    # (a padding row), which weighs every part at nothing.
    part_lse = lse + (row * tl.num_programs(1) + head) * splits * GROUPS + group
    top = tl.full([PADDED], float("-inf"), tl.float32)
    for part in range(0, splits):
        top = tl.maximum(top, tl.load(part_lse + part * GROUPS, mask=in_group, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([PADDED], tl.float32)
    for part in range(0, splits):
        total += tl.exp(tl.load(part_lse + part * GROUPS, mask=in_group, other=float("-inf")) - top)
    norm = top + tl.log(tl.where(total == 0.0, 1.0, total))
    if SPLIT:
        if block == 0:  # one program a (row, KV head) writes its output
            dim = tl.arange(0, DIM)
            acc = tl.zeros([PADDED, DIM], tl.float32)
            for part in range(0, splits):
                weight = tl.exp(tl.load(part_lse + part * GROUPS, mask=in_group, other=float("-inf")) - norm)
                acc += weight[:, None] * tl.load(
                    parts + row * p_row + head * p_head + part * p_split + group[:, None] * p_group + dim[None, :],
                    mask=in_group[:, None], other=0.0)
            tl.store(out + row * o_row + head * o_head + group[:, None] * o_group + dim[None, :],
                     acc.to(out.dtype.element_ty), mask=in_group[:, None])
    x = tl.load(logits + row * l_row + head * l_head + group[:, None] * l_group + slot[None, :],
                mask=in_group[:, None] & held[None, :], other=float("-inf"))
    mass = tl.sum(tl.exp(x - norm[:, None]), 0)
    if COUNTED:
        mass = tl.where(tl.load(counted + row * c_row + head * c_head + slot, mask=held, other=0) != 0, mass, 0.0)
    # Each slot is one program's: no other adds to it.
    at = scores + row * s_row + head * s_head + slot * s_slot
    tl.store(at, tl.load(at, mask=held, other=0.0) + mass, mask=held)


def probe(device: torch.device) -> None:
    """Build and run the kernels once on ``device``, reading floats whole and in two
    parts, and reading codes (8-bit keys, 4-bit values, a ring, a new token: every branch
    of ``_read``): raises where Triton cannot build them there (it compiles a launcher
    with the system's C compiler, which a slim image may lack)."""
    lengths = torch.ones(1, dtype=torch.long, device=device)
    scores = torch.zeros((1, 1, BLOCK + 1), dtype=torch.float32, device=device)
    slots = torch.zeros((1, 1, BLOCK + 1, MIN_ROWS), dtype=torch.bfloat16, device=device)
    for splits in (1, 2):
        scored_decode(slots[:, :, :1], StoredSlots.plain(slots), StoredSlots.plain(slots), lengths, 1.0, scores,
                      torch.ones((1, 1, BLOCK + 1), dtype=torch.bool, device=device), splits=splits)
    query, at = torch.zeros((1, 1, 1, 32), dtype=torch.bfloat16, device=device), (0, slice(None), 0)
    coded = []
    for bits, name in ((8, "keys"), (4, "values")):
        codec = make_codec(bits)
        buffers = codec.empty(name, (1, 1, 1), 32, device, torch.bfloat16) | {
            window_name(name): torch.zeros((1, 1, 1, 32), dtype=torch.bfloat16, device=device)}
        coded.append(StoredSlots(codec, buffers, name, torch.zeros((1, 1, 1), dtype=torch.long, device=device),
                                 query[:, :, 0], at))
    scored_decode(query, *coded, lengths, 1.0, scores[:, :, :1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def usable(query: torch.Tensor, keys: StoredSlots, values: StoredSlots) -> bool:
    """Whether the kernel computes this call (on a device ``kernels.load`` gave it for):
    half precision, one query token, a power-of-two head dimension (Triton's block
    shapes), channels contiguous, floats stored in the query's dtype or 8- and 4-bit
    codes, no rotation when read."""
    dim = query.shape[-1]
    return (query.dtype in (torch.float16, torch.bfloat16) and query.shape[2] == 1
            and dim >= 16 and dim & (dim - 1) == 0
            and all(_readable(stored, query.dtype) for stored in (keys, values)))


def _readable(stored: StoredSlots, dtype: torch.dtype) -> bool:
    data = stored.data
    return (stored.rotation is None and data.stride(-1) == 1 and (stored.bits or data.dtype == dtype)
            and (not stored.bits or stored.scale.stride() == stored.minimum.stride()))


def _operand(stored: StoredSlots, like: torch.Tensor) -> tuple[list, list, dict]:
    """One quantity's pointers, strides and constants for ``_attend``; a tensor that is
    absent is stood in for by ``like`` (never read)."""
    data, scale, ring, new = stored.data, stored.scale, stored.ring, stored.new
    pointers = [data, like if scale is None else scale, like if scale is None else stored.minimum,
                like if ring is None else ring, like if new is None else new]
    strides = [*data.stride()[:3], *(scale.stride()[:3] if scale is not None else (0, 0, 0)),
               *(ring.stride()[:3] if ring is not None else (0, 0, 0)), *(new.stride()[:2] if new is not None else (0, 0))]
    constants = {"BITS": stored.bits, "GROUP": stored.group, "RING": ring is not None, "NEW": new is not None}
    return pointers, strides, constants


def scored_decode(query: torch.Tensor, keys: StoredSlots, values: StoredSlots, lengths: torch.Tensor,
                  scaling: float, scores: torch.Tensor, counted: torch.Tensor | None = None,
                  launch: dict | None = None, splits: int | None = None) -> torch.Tensor:
    """``query`` ``(rows, q_heads, 1, dim)`` over ``keys``/``values`` ``(rows, kv_heads,
    slots, ...)`` of which each row's first ``lengths[row]`` are live, read as
    ``StoredSlots.read`` gives them (the new token at slot ``lengths[row] - 1``): the
    output ``(rows, 1, q_heads, dim)`` in the query's dtype. The mass each live slot
    received, summed over its group's query heads, is added to ``scores`` ``(rows,
    kv_heads, slots)`` float32 where ``counted`` (a boolean of that shape; None: every slot).
    Each row's slots are read in ``splits`` parts at once (None: ``split_count``'s)."""
    rows, q_heads, _, dim = query.shape
    kv_heads, slots = keys.data.shape[1], keys.slots
    groups = q_heads // kv_heads
    padded = max(MIN_ROWS, triton.next_power_of_2(groups))
    span = BLOCK * triton.cdiv(slots, BLOCK * (splits or split_count(rows, kv_heads, slots,
                                                                     processors(query.device))))
    splits = triton.cdiv(slots, span)  # none past the last slot
    grouped = query.reshape(rows, kv_heads, groups, dim)
    entries = keys.entries if keys.entries is not None else values.entries
    slot_entry = lengths if entries is None else ring_entries(entries, slots)
    # Written in the query's dtype, laid out as the model's (rows, 1, q_heads, dim).
    out = torch.empty((rows, kv_heads, groups, dim), dtype=query.dtype, device=query.device)
    parts = out if splits == 1 else torch.empty((rows, kv_heads, splits, groups, dim), dtype=torch.float32,
                                                device=query.device)
    part_strides = parts.stride()[:4] if splits > 1 else (0, 0, 0, 0)
    logits = torch.empty((rows, kv_heads, groups, slots), dtype=torch.float32, device=query.device)
    lse = torch.empty((rows, kv_heads, splits, groups), dtype=torch.float32, device=query.device)
    k_pointers, k_strides, k_constants = _operand(keys, query)
    v_pointers, v_strides, v_constants = _operand(values, query)
    _attend[(rows, kv_heads, splits)](
        grouped, lengths, slot_entry, out, parts, logits, lse, *k_pointers, *v_pointers,
        *grouped.stride()[:3], *(slot_entry.stride()[:2] if entries is not None else (0, 0)),
        *k_strides, *v_strides, *out.stride()[:3], *logits.stride()[:3], *part_strides, scaling, span,
        **{f"K_{name}": value for name, value in k_constants.items()},
        **{f"V_{name}": value for name, value in v_constants.items()},
        ENTRIES=entries is not None, GROUPS=groups, PADDED=padded, DIM=dim, BLOCK=BLOCK, SPLIT=splits > 1,
        **(launch or {}))
    _finish[(rows, kv_heads, triton.cdiv(slots, BLOCK))](
        logits, lse, parts, out, lengths, scores, scores if counted is None else counted, splits,
        *logits.stride()[:3], *part_strides, *out.stride()[:3], *scores.stride(),
        *(counted.stride()[:2] if counted is not None else (0, 0)),
        GROUPS=groups, PADDED=padded, DIM=dim, BLOCK=BLOCK, COUNTED=counted is not None, SPLIT=splits > 1)
    return out.view(rows, q_heads, 1, dim).transpose(1, 2)


def split_count(rows: int, kv_heads: int, slots: int, processors: int) -> int:
    """In how many parts each (row, KV head) reads its slots on a GPU of ``processors``
    multiprocessors: one where the rows' programs already give each two, else as many as
    do, at most a block of slots each. Few rows of many slots would otherwise leave most
    of the GPU idle while a few programs walk every slot."""
    return max(1, min(triton.cdiv(slots, BLOCK), triton.cdiv(2 * processors, rows * kv_heads)))


@functools.cache
def processors(device: torch.device) -> int:
    """``device``'s multiprocessors; 0 off CUDA (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def ring_entries(entries: torch.Tensor, slots: int) -> torch.Tensor:
    """Per slot the ring entry holding its token, -1 for none, ``(rows, kv_heads, slots)``
    int32, from ``entries`` (per entry its slot, ``window.entry_slots``). Entries whose
    token is gone all name the newest slot, which reads the new token anyway."""
    index = torch.arange(entries.shape[-1], dtype=torch.int32, device=entries.device)
    found = torch.full((*entries.shape[:-1], slots), -1, dtype=torch.int32, device=entries.device)
    return found.scatter_(-1, entries, index.expand(entries.shape))
