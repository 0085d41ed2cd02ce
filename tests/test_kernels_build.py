"""The engine's Triton kernels build for the GPUs they are meant for (Hopper: H100/H200,
Ampere: A100), here, on a machine without one: each launch the engine would make is
caught with the very arguments it passes, then compiled ahead of time down to the GPU's
machine code (Triton's compiler and the ``ptxas`` its wheel brings).

The interpreter tests (test_decode_kernel.py, test_evict_kernel.py, test_step_kernels.py)
check what the kernels compute but not that they compile: on a GPU a kernel that does
not build is only a warning (``kernels.load`` falls back to torch's path), and the GPU
check would then measure the slow path without saying why."""

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from h2o_chat.bench.gpu_kernels import LAUNCHES  # noqa: E402
from h2o_chat.engine import decode_kernel, evict_kernel  # noqa: E402
from h2o_chat.engine.batch import END, OPENED, POSITION, RANKING, SLOT, START  # noqa: E402
from h2o_chat.engine.quant import make_codec  # noqa: E402
from h2o_chat.engine.selection import RANK_MEAN, RANK_RECENCY, RANK_SCORE  # noqa: E402
from h2o_chat.engine.stored import StoredSlots  # noqa: E402
from h2o_chat.engine.window import window_name  # noqa: E402

CAPABILITIES = {"Hopper (sm_90)": 90, "Ampere (sm_80)": 80}
# Shared memory a block may take (the opt-in maximum Triton checks at load): H100/H200, A100.
SHARED_MEMORY = {90: 232_448, 80: 166_912}
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*i1"}


class Launches:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the call."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def build(kernel, args: tuple, kwargs: dict, capability: int):
    """``kernel`` compiled for CUDA compute ``capability`` from one recorded launch."""
    bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}  # num_warps, num_stages
    # As a launch on the GPU machine builds it: its Triton (3.6) fuses multiplies and adds
    # by default, which 3.9 keeps only with a warning and 3.10 will not.
    options.setdefault("enable_fp_fusion", True)
    signature = {p.name: "constexpr" if p.is_constexpr else argument_type(bound[p.name]) for p in kernel.params}
    constants = {p.name: bound[p.name] for p in kernel.params if p.is_constexpr}
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", capability, 32),
                          options=options)


def stored(bits: int | None, name: str, shape: tuple, dim: int, dtype: torch.dtype, ring: int,
           new: torch.Tensor) -> StoredSlots:
    """Slots as a pool holds them: floats in the model's dtype, or codes with the exact
    window's ring, and the rows' new token over the newest slot."""
    rows, heads, slots = shape
    if bits is None:
        return StoredSlots.plain(torch.zeros(rows, heads, slots, dim, dtype=dtype))
    codec = make_codec(bits)
    buffers = codec.empty(name, shape, dim, torch.device("cpu"), dtype)
    entries = None
    if ring:
        buffers[window_name(name)] = torch.zeros(rows, heads, ring, dim, dtype=dtype)
        entries = torch.zeros(rows, heads, ring, dtype=torch.long)
    at = (torch.arange(rows), slice(None), torch.zeros(rows, dtype=torch.long))
    return StoredSlots(codec, buffers, name, entries, new, at)


# (key bits, value bits, exact window, dtype, head dim, query heads per KV head, turns):
# the designs the engine stores, at the shapes of the models the GPU check runs
# (Llama 3 1B and 8B: 64 and 128 channels, 4 query heads per KV head) and SmolLM2's 3.
ATTENTION = [
    (None, None, 0, torch.bfloat16, 64, 4, False),
    (None, None, 0, torch.float16, 128, 4, True),
    (8, 4, 0, torch.bfloat16, 64, 4, False),
    (4, 4, 16, torch.bfloat16, 128, 4, True),
    (8, 8, 16, torch.float16, 64, 3, False),
]


def attention_launches(monkeypatch, key_bits, value_bits, ring, dtype, dim, groups, turns,
                       launch: dict | None = None, splits: int = 1) -> list:
    """The (kernel, arguments, keywords) of each launch one scored decode makes."""
    rows, kv_heads, slots = 3, 2, 100
    attend, finish = Launches(decode_kernel._attend), Launches(decode_kernel._finish)
    monkeypatch.setattr(decode_kernel, "_attend", attend)
    monkeypatch.setattr(decode_kernel, "_finish", finish)
    query = torch.zeros(rows, kv_heads * groups, 1, dim, dtype=dtype)
    new = torch.zeros(rows, kv_heads, dim, dtype=dtype)
    keys, values = (stored(bits, name, (rows, kv_heads, slots), dim, dtype, ring, new)
                    for bits, name in ((key_bits, "keys"), (value_bits, "values")))
    assert decode_kernel.usable(query, keys, values)
    scores = torch.zeros(rows, kv_heads, slots)
    counted = torch.ones(rows, kv_heads, slots, dtype=torch.bool) if turns else None
    decode_kernel.scored_decode(query, keys, values, torch.full((rows,), slots), dim**-0.5, scores, counted,
                                launch=launch, splits=splits)
    return [(launches.kernel, *call) for launches in (attend, finish) for call in launches.calls]


@pytest.mark.parametrize("capability", CAPABILITIES.values(), ids=CAPABILITIES.keys())
@pytest.mark.parametrize("key_bits, value_bits, ring, dtype, dim, groups, turns", ATTENTION)
def test_the_fused_decode_attention_builds_for_the_gpu(monkeypatch, capability, key_bits, value_bits, ring, dtype,
                                                      dim, groups, turns):
    launches = attention_launches(monkeypatch, key_bits, value_bits, ring, dtype, dim, groups, turns)
    assert [kernel.fn.__name__ for kernel, _, _ in launches] == ["_attend", "_finish"]
    for kernel, args, kwargs in launches:
        assert build(kernel, args, kwargs, capability).asm["cubin"]


@pytest.mark.parametrize("capability", CAPABILITIES.values(), ids=CAPABILITIES.keys())
@pytest.mark.parametrize("key_bits, value_bits, ring, dtype, dim, groups, turns", [ATTENTION[0], ATTENTION[3]])
def test_the_fused_decode_attention_in_parts_builds_for_the_gpu(monkeypatch, capability, key_bits, value_bits, ring,
                                                               dtype, dim, groups, turns):
    launches = attention_launches(monkeypatch, key_bits, value_bits, ring, dtype, dim, groups, turns, splits=2)
    assert [kwargs["SPLIT"] for _, _, kwargs in launches] == [True, True]
    for kernel, args, kwargs in launches:
        assert build(kernel, args, kwargs, capability).asm["cubin"]


@pytest.mark.parametrize("capability", CAPABILITIES.values(), ids=CAPABILITIES.keys())
@pytest.mark.parametrize("warps, stages", LAUNCHES)
def test_every_launch_setting_the_gpu_check_tries_fits_the_gpus_shared_memory(monkeypatch, capability, warps,
                                                                              stages):
    # The heaviest reads: 8B's 128 channels, 8-bit keys and 4-bit values with the ring.
    (kernel, args, kwargs), _ = attention_launches(monkeypatch, 8, 4, 16, torch.bfloat16, 128, 4, False,
                                                   launch=dict(num_warps=warps, num_stages=stages))
    built = build(kernel, args, kwargs, capability)
    assert (built.metadata.num_warps, built.metadata.num_stages) == (warps, stages)
    assert 0 < built.metadata.shared <= SHARED_MEMORY[capability]


@pytest.mark.parametrize("capability", CAPABILITIES.values(), ids=CAPABILITIES.keys())
@pytest.mark.parametrize("rankings, turns", [({RANK_SCORE}, False), ({RANK_SCORE, RANK_MEAN, RANK_RECENCY}, True)])
def test_the_eviction_kernel_builds_for_the_gpu(monkeypatch, capability, rankings, turns):
    lowest = Launches(evict_kernel._lowest)
    monkeypatch.setattr(evict_kernel, "_lowest", lowest)
    shape = (4, 3, 2, 300)  # layers, rows, KV heads, slots: more slots than one block
    plan = torch.zeros(3, max(START, END, SLOT, POSITION, OPENED, RANKING) + 1, dtype=torch.long)
    evict_kernel.lowest_slot(torch.zeros(shape), torch.zeros(shape, dtype=torch.long),
                             torch.zeros(shape, dtype=torch.bool), plan, frozenset(rankings), turns)
    (args, kwargs), = lowest.calls
    assert build(lowest.kernel, args, kwargs, capability).asm["cubin"]
