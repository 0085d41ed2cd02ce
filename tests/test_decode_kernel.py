"""The decode step's fused attention kernel (engine/decode_kernel.py) against the plain
scored attention. The kernel runs on CUDA only; here it runs in Triton's interpreter
(which executes it on the CPU, in float16: the interpreter mishandles bfloat16). CUDA
builds of torch bring Triton; on a CPU build `make test` adds it. On a GPU,
`python -m h2o_chat.bench gpu` checks the kernel itself (gpu_checks.fused_decode_equals_reference)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

# Rows of unlike lengths (a padding row with none, one slot, a block's edge, past it),
# slots read through a pool-like view whose rows have spare slots; stored as floats, or
# as 8- and 4-bit codes with the exact window's ring over the newest slots and each row's
# new token as the model gave it.
PROGRAM = """
import sys
import torch
from h2o_chat.engine import decode_kernel
from h2o_chat.engine.attention import scored_attention
from h2o_chat.engine.quant import make_codec
from h2o_chat.engine.stored import StoredSlots

torch.manual_seed(0)
rows, kv_heads, groups, dim, slots, ring = 5, 2, 3, 32, 150, 6
lengths = torch.tensor([150, 64, 65, 1, 0])
newest = (lengths - 1).clamp(min=0)
at = (torch.arange(rows), slice(None), newest)
# Per ring entry the slot of its token: the newest slots in a shuffled order (eviction
# scatters them); entries of tokens no slot holds name the newest slot.
back = torch.randperm(ring)
entries = (newest[:, None, None] - back).expand(rows, kv_heads, ring)
entries = torch.where(entries >= 0, entries, newest[:, None, None]).contiguous()


def stored(bits, name, windowed):
    x = torch.randn(rows, kv_heads, slots, dim) * 3
    if bits is None:
        return StoredSlots.plain(torch.randn(rows, kv_heads, slots + 7, dim, dtype=torch.float16)[:, :, :slots])
    codec = make_codec(bits)
    buffers = codec.empty(name, (rows, kv_heads, slots + 7), dim, torch.device("cpu"), torch.float16)
    buffers = {key: t[:, :, :slots] for key, t in buffers.items()}
    codec.write(buffers, name, 0, slots, x)
    if windowed:
        buffers["window_" + name] = torch.randn(rows, kv_heads, ring, dim, dtype=torch.float16)
    new = torch.randn(rows, kv_heads, 1, dim, dtype=torch.float16)[:, :, 0]
    return StoredSlots(codec, buffers, name, entries if windowed else None, new, at)


# Read whole, and in 3 parts of 64 slots (a row's live slots may end before its last
# parts begin, or hold none of them).
for key_bits, value_bits, windowed, splits in ((None, None, False, 1), (None, None, False, 3), (8, 4, True, 1),
                                               (8, 4, True, 3), (4, 8, False, 2)):
    keys, values = stored(key_bits, "keys", windowed), stored(value_bits, "values", windowed)
    query = torch.randn(rows, kv_heads * groups, 1, dim, dtype=torch.float16)
    live = torch.arange(slots) < lengths[:, None]
    # Scores as a pool's views; a turns row counts only some slots.
    scores = torch.rand(rows, kv_heads, slots + 7)[:, :, :slots]
    before = scores.clone()
    counted = torch.rand(rows, kv_heads, slots) < 0.7 if windowed else None
    output = decode_kernel.scored_decode(query, keys, values, lengths, dim ** -0.5, scores, counted, splits=splits)
    want, probabilities = scored_attention(query.float(), keys.read(torch.float16).float(),
                                           values.read(torch.float16).float(), live[:, None, None, :], dim ** -0.5)
    received = scores - before
    mass = probabilities.sum(dim=(2, 3)) * (1 if counted is None else counted)
    assert output.shape == (rows, 1, kv_heads * groups, dim) and output.dtype == torch.float16
    torch.testing.assert_close(output[:4].float(), want[:4], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(received, torch.where(live[:, None, :], mass, 0.0), atol=1e-5, rtol=1e-5)
    assert not output[4].any() and not received[4].any()
    if counted is None:
        torch.testing.assert_close(received.sum(-1)[:4], torch.full((4, kv_heads), float(groups)))
    print("same", key_bits, value_bits, windowed, splits)
"""


def test_fused_decode_kernel_equals_scored_attention_in_the_interpreter() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=os.environ | {"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:-1] == ["same None None False 1", "same None None False 3", "same 8 4 True 1",
                                              "same 8 4 True 3", "same 4 8 False 2"]


def test_rows_too_few_to_fill_the_gpu_split_their_slots() -> None:
    from h2o_chat.engine.decode_kernel import BLOCK, split_count

    # An H200's 132 multiprocessors, a 1B model's 8 KV heads, 820 slots (h2o 20% of 4,096).
    assert split_count(1, 8, 820, 132) == 13  # every block of slots its own program
    assert split_count(16, 8, 820, 132) == 3  # 384 programs for 264 wanted
    assert split_count(33, 8, 820, 132) == 1  # 264 programs: two a multiprocessor already
    assert split_count(1, 8, BLOCK, 132) == 1  # one block: nothing to split
    assert split_count(1, 8, 820, 0) == 1  # off CUDA
