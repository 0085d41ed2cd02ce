"""How a slot's key or value is stored: as the model gives it, as another float type, or
quantized to 8 or 4 bits.

A codec owns one or more buffers per stored quantity (``keys``, or ``keys`` plus
``keys_scale`` and ``keys_min``), each ``(batch, heads, size, ...)`` with slots on dim 2,
so eviction, stacking, saving and resuming move them like any other slot buffer.

Quantization is per slot (one token of one KV head) in groups of ``group`` neighbouring
channels along the head dimension, asymmetric: ``x ≈ min + scale * code``, with
``code`` in ``0 .. 2**bits - 1`` and ``scale``/``min`` in float16. Per slot rather than per
channel because H2O evicts single slots: a slot must be readable without its
neighbours, which may be gone.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h2o_chat.config import STORAGE_BITS as BITS
from h2o_chat.config import check_field

from .window import window_name

# Float types a codec stores as, by bits, where the model's own dtype is not that wide.
_FLOAT_OF_BITS = {32: torch.float32, 16: torch.float16}
# Largest finite float16: a quantized value beyond it saturates there, as a float16
# cache's would.
_HALF_MAX = torch.finfo(torch.float16).max
QUANTIZED_BITS = (8, 4)
# Channels per scale and minimum: 4 bytes of them per 32 channels, an eighth of a byte
# per channel on top of the codes.
GROUP = 32


class SlotCodec:
    """Stores one quantity (keys or values) of ``dim`` channels per slot."""

    bits: int

    def empty(self, name: str, slots: tuple[int, ...], dim: int, device: torch.device,
              model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Zeroed buffers for ``name``: ``slots`` is ``(batch, heads, size)``."""
        return {key: torch.zeros((*slots, last), dtype=dtype, device=device)
                for key, (dtype, last) in self.layout(name, dim, model_dtype).items()}

    def write(self, buffers: dict[str, torch.Tensor], name: str, start: int, end: int, x: torch.Tensor) -> None:
        """Store ``x`` ``(batch, heads, end - start, dim)`` into slots ``start:end``."""
        self.write_at(buffers, name, (slice(None), slice(None), slice(start, end)), x)

    def write_at(self, buffers: dict[str, torch.Tensor], name: str, at: tuple, x: torch.Tensor) -> None:
        """Store ``x`` into the slots that index ``at`` selects of ``(batch, heads, size)``
        (e.g. one slot of each batch row): ``x`` is shaped as that selection, head
        dimension last."""
        raise NotImplementedError

    def read(self, held: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
        """The stored quantity of the ``held`` slot views, as ``dtype``: a copy of its own
        wherever the storage is not ``exact`` for ``dtype``."""
        raise NotImplementedError

    def exact(self, dtype: torch.dtype) -> bool:
        """Whether values of ``dtype`` are stored as they are (read back as views)."""
        return False

    def layout(self, name: str, dim: int, model_dtype: torch.dtype) -> dict[str, tuple[torch.dtype, int]]:
        """Each buffer's dtype and last-dimension length, by buffer name."""
        raise NotImplementedError


class FloatCodec(SlotCodec):
    """Slots stored as a float of ``bits`` bits; None keeps the model's own dtype."""

    def __init__(self, bits: int | None) -> None:
        self.bits = bits

    def _dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.bits is None or model_dtype.itemsize * 8 == self.bits:
            return model_dtype  # bfloat16 stays bfloat16 at 16 bits
        return _FLOAT_OF_BITS[self.bits]

    def write_at(self, buffers, name, at, x):
        buffers[name][at] = x.to(buffers[name].dtype)

    def read(self, held, name, dtype):
        return held[name].to(dtype)

    def exact(self, dtype):
        return self._dtype(dtype) == dtype

    def layout(self, name, dim, model_dtype):
        return {name: (self._dtype(model_dtype), dim)}


class GroupQuantCodec(SlotCodec):
    """``bits``-bit codes (4-bit ones packed two to a byte), a float16 scale and minimum
    per group of channels (``group``, or the largest divisor of the head dimension below
    it). Error bound: every value read is within ``scale / 2`` of the value written
    (``scale = (max - min) / (2**bits - 1)`` of its group, rounded up)."""

    def __init__(self, bits: int, group: int = GROUP) -> None:
        if bits not in (8, 4):
            raise ValueError(f"quantized slots take 8 or 4 bits, not {bits}")
        self.bits, self.group = bits, group
        self.levels = 2**bits - 1

    def group_size(self, dim: int) -> int:
        """Channels per scale for a head dimension of ``dim``."""
        if dim * self.bits % 8:
            raise ValueError(f"a head dimension of {dim} does not pack into whole bytes at {self.bits} bits")
        return math.gcd(dim, self.group)

    def layout(self, name, dim, model_dtype):
        groups = dim // self.group_size(dim)
        return {name: (torch.uint8, dim * self.bits // 8), f"{name}_scale": (torch.float16, groups),
                f"{name}_min": (torch.float16, groups)}

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(..., dim)`` as (codes ``(..., dim * bits / 8)`` uint8, scale, min)."""
        grouped = x.float().unflatten(-1, (-1, self.group_size(x.shape[-1]))).clamp(-_HALF_MAX, _HALF_MAX)
        low, high = torch.aminmax(grouped, dim=-1)
        # float16 minimum rounded down and scale rounded up, so that every value of the
        # group lies within min .. min + levels * scale and rounds to its nearest code.
        minimum = low.half()
        lowest = minimum.float()
        minimum = torch.nextafter(minimum, torch.where(lowest > low, _limit(minimum, -_HALF_MAX), minimum))
        lowest = minimum.float()
        span = (high - lowest) / self.levels
        scale = span.half()
        scale = torch.nextafter(scale, torch.where(scale.float() < span, _limit(scale, _HALF_MAX), scale))
        safe = scale.float().clamp_(min=torch.finfo(torch.float16).tiny)
        codes = ((grouped - lowest[..., None]) / safe[..., None]).round_().clamp_(0, self.levels)
        codes = codes.to(torch.uint8).flatten(-2)
        if self.bits == 4:
            # Byte j holds channel j (low nibble) and channel j + dim/2 (high): decoding
            # then writes two contiguous halves instead of interleaving.
            low_half, high_half = codes.chunk(2, dim=-1)
            codes = low_half | (high_half << 4)
        return codes, scale, minimum

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        read = _dequantize_on(codes.device) if codes.is_cuda else dequantize
        return read(codes, scale, minimum, self.bits, dtype)

    def write_at(self, buffers, name, at, x):
        codes, scale, minimum = self.encode(x)
        buffers[name][at] = codes
        buffers[f"{name}_scale"][at] = scale
        buffers[f"{name}_min"][at] = minimum

    def read(self, held, name, dtype):
        return self.decode(held[name], held[f"{name}_scale"], held[f"{name}_min"], dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """``GroupQuantCodec.decode``'s arithmetic."""
    if bits == 4:
        # Low nibbles are channels 0 .. dim/2, high ones the rest (see ``encode``). Shifts
        # by a scalar and in-place float arithmetic: on the CPU a broadcast shift or
        # addcmul runs several times slower than these (benchmarks 8c).
        codes = torch.cat((codes & 15, codes >> 4), dim=-1)
    # In float32 whatever ``dtype``: a bfloat16 scale would lose the float16 one's bits.
    # The float16 scale and minimum are widened as they are read (exactly, as ``.float()``
    # would): two operations fewer per read than widening them first.
    grouped = codes.to(torch.float32).unflatten(-1, (scale.shape[-1], -1))
    values = grouped.mul_(scale[..., None]).add_(minimum[..., None]).flatten(-2)
    return values if dtype == torch.float32 else values.to(dtype)


# Layouts ``compiled_dequantize`` may compile for, per bits and dtype: the compiler
# specialises sizes of 1 even when told every size may change, and the buffers its
# inputs are views of come as a pool's (one row or many) or a cache's own. Its default
# limit, 8 for all of them together, was reached on a GPU, leaving the rest eager.
COMPILED_LAYOUTS = 64


@functools.cache
def compiled_dequantize(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``dequantize`` compiled into one kernel (by ``backend``; the tests trace with
    ``eager``, which needs no compiler). Eagerly its four passes over every slot dominate
    a batched step on a GPU: on an H200, a layer's 8-bit keys of 512 rows took 2.2 ms
    eagerly and 0.22 compiled (docs/benchmarks.md, "The GPU check")."""
    compiled = torch.compile(dequantize, dynamic=True, backend=backend)
    return torch._dynamo.config.patch(recompile_limit=COMPILED_LAYOUTS)(compiled)


@functools.cache
def _dequantize_on(device: torch.device) -> Callable[..., torch.Tensor]:
    """``compiled_dequantize`` where torch's compiler builds it for ``device`` (it needs
    Triton, which CUDA builds of torch bring, and a C compiler), else ``dequantize``,
    after one warning where building failed."""
    if importlib.util.find_spec("triton") is None:
        return dequantize
    compiled = compiled_dequantize()
    try:  # sizes above 1: what is compiled here serves every shape
        compiled(torch.zeros((2, 2, 2), dtype=torch.uint8, device=device),
                 torch.ones((2, 2, 1), dtype=torch.float16, device=device),
                 torch.zeros((2, 2, 1), dtype=torch.float16, device=device), 8, torch.float32)
    except Exception as err:  # whatever the compiler raises where it cannot build
        warnings.warn(f"compiled dequantization cannot run on {device} ({type(err).__name__}: {err}); "
                      "reading eagerly instead", RuntimeWarning, stacklevel=2)
        return dequantize
    return compiled


@functools.cache
def _constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def _limit(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a scalar tensor like ``like`` (made once per dtype and device)."""
    return _constant(value, like.dtype, like.device)


def make_codec(bits: int | None) -> SlotCodec:
    """The codec for ``bits`` (one of ``BITS``; None: the model's dtype)."""
    if bits is not None and bits not in BITS:
        raise ValueError(f"bits = {bits!r}: must be one of {', '.join(map(str, BITS))} or None")
    return GroupQuantCodec(bits) if bits in QUANTIZED_BITS else FloatCodec(bits)


@dataclass(frozen=True)
class KVStorage:
    """Storage precision of a cache's keys and of its values (None: the model's dtype),
    and how many of the newest tokens are also kept as the model gave them beside
    quantized slots (``exact_window``, ``window.py``; 0: none)."""

    key_bits: int | None = None
    value_bits: int | None = None
    exact_window: int = 0

    def __post_init__(self) -> None:
        make_codec(self.key_bits), make_codec(self.value_bits)  # refuse bad bits early
        check_field("cache.exact_window", self.exact_window)

    @property
    def keys(self) -> SlotCodec:
        return make_codec(self.key_bits)

    @property
    def values(self) -> SlotCodec:
        return make_codec(self.value_bits)

    def layout(self, head_dim: int, model_dtype: torch.dtype) -> dict[str, tuple[torch.dtype, int]]:
        """Every key and value buffer's dtype and last-dimension length."""
        return self.keys.layout("keys", head_dim, model_dtype) | self.values.layout("values", head_dim, model_dtype)

    def slot_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes one slot's key and value take, scales included."""
        return sum(dtype.itemsize * last for dtype, last in self.layout(head_dim, model_dtype).values())

    def window_layout(self, head_dim: int, model_dtype: torch.dtype) -> dict[str, tuple[torch.dtype, int]]:
        """The exact window's ring buffers, ``(batch, heads, exact_window, head_dim)`` at
        16 bits (``window.py``): one for each quantity stored quantized."""
        if not self.exact_window:
            return {}
        ring = make_codec(16).layout("ring", head_dim, model_dtype)["ring"]
        return {window_name(name): ring for name, bits in (("keys", self.key_bits), ("values", self.value_bits))
                if bits in QUANTIZED_BITS}

    def window_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes the exact window takes per layer and KV head."""
        return self.exact_window * sum(dtype.itemsize * last
                                       for dtype, last in self.window_layout(head_dim, model_dtype).values())

    @property
    def rotates_keys_in_place(self) -> bool:
        """Whether rolling rotates stored keys in place: only where they are kept at
        least as precise as the model's (float32 or its own dtype); narrower ones are
        stored unrotated and rotated when read, so moving them adds no rounding."""
        return self.key_bits in (None, 32)

    def describe(self) -> dict[str, int]:
        """The bits set and the exact window, for settings and stats (left out at the
        model's dtype and at no window, as in files saved before they existed)."""
        described = {name: bits for name, bits in (("key_bits", self.key_bits), ("value_bits", self.value_bits))
                     if bits is not None}
        return described | ({"exact_window": self.exact_window} if self.exact_window else {})
