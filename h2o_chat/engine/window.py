"""The exact window: the newest tokens' keys and values as the model gave them (to 16
bits), beside their quantized slots.

Quantized slots lose most where attention looks hardest, at the newest tokens (the
storage study, ``bench/storage_designs.py``: 4-bit keys cost 4.3% perplexity, 0.6% with
the newest 16 tokens exact). So a cache that quantizes keeps, per layer, a ring of the
newest ``R`` tokens' keys and values at 16 bits, ``(batch, kv_heads, R, head_dim)``, the
token at position ``p`` in entry ``p % R``: in the model's own dtype where it has 16
bits, else float16, which loses nothing measurable (the full cache at float16 reads
1.000x the float32 perplexity, benchmarks 8) at half the bytes. Slots do not change: every
token is still written quantized, so eviction, pooling and stacking move only slots;
reading a layer dequantizes as before and then writes each ring entry over the slot
holding its token (found by position, since eviction scatters the newest tokens over
the slots).

A ring buffer sits beside the slot buffers under the name ``window_<quantity>``, with
the same leading dimensions, so a ``SlotGroup`` and a ``RowPool`` hold and move it with
them; only its third dimension is ``R`` rather than the slots, and nothing evicts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # quant.py names the rings from here
    from .quant import SlotCodec

PREFIX = "window_"


def window_name(quantity: str) -> str:
    """The ring buffer of ``quantity`` (``keys`` or ``values``)."""
    return PREFIX + quantity


def is_window(name: str) -> bool:
    """Whether buffer ``name`` is a ring of the exact window rather than slots."""
    return name.startswith(PREFIX)


def length(name: str, own: int | None, slots: int | None) -> int | None:
    """Buffer ``name``'s length on the slot dimension where slot buffers have ``slots``:
    a ring keeps its ``own``, whatever the slots."""
    return own if is_window(name) else slots


def slot_buffers(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``buffers`` without the rings: what eviction moves."""
    return {name: t for name, t in buffers.items() if not is_window(name)}


def as_ring(x: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """``x`` in ``ring``'s dtype, saturating at its largest finite value (as quantized
    slots do) rather than becoming infinite."""
    largest = torch.finfo(ring.dtype).max
    return x.clamp(-largest, largest).to(ring.dtype)


def write_newest(ring: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
    """Keep ``x`` ``(batch, heads, n, dim)``, the tokens at consecutive ``positions``
    ``(n,)``, in ``ring`` ``(batch, heads, R, dim)``: the last ``R`` of them, each at its
    position modulo ``R``."""
    size = ring.shape[2]
    ring[:, :, positions[-size:] % size] = as_ring(x[:, :, -size:], ring)


def entry_slots(buffers: dict[str, torch.Tensor], seen: int | torch.Tensor,
                newest_slot: int | torch.Tensor) -> torch.Tensor | None:
    """Per ring entry, the slot holding its token, among one layer's slot ``buffers``
    (``(..., slots)`` positions); None where the layer keeps no ring. ``seen``: tokens
    seen, the pass's included, an int or per row a tensor broadcasting to the slots;
    ``newest_slot``: the last slot in use (the pass's newest token's), likewise. An entry
    whose token no slot holds (evicted, or not seen yet) names ``newest_slot``, whose read
    the pass replaces with its own token as given anyway. Slots past ``newest_slot`` (stale
    ones of a pool's row) are never named."""
    ring = next((t for name, t in buffers.items() if is_window(name)), None)
    if ring is None:
        return None
    size, positions = ring.shape[-2], buffers["positions"]
    slot = torch.arange(positions.shape[-1], device=positions.device)
    # Each slot whose token is in the window names its entry, position modulo the size;
    # every other slot names a spare entry past the ring, dropped after. A live slot holds
    # a position at most once, so no two slots name one entry of the ring.
    in_window = (positions >= seen - size) & (slot <= newest_slot)
    entry = torch.where(in_window, positions % size, size)
    named = torch.full((*positions.shape[:-1], size + 1), -1, dtype=slot.dtype, device=slot.device)
    named = named.scatter_(-1, entry, slot.expand_as(entry))[..., :size]
    return torch.where(named >= 0, named, newest_slot)


def entry_rows(slots: torch.Tensor, size: int) -> torch.Tensor:
    """Where ring entries go in a read: ``slots`` ``(..., rows, heads, R)`` names per entry
    a slot of a read ``(rows, heads, size, dim)`` (one read per leading index, e.g. per
    layer); the result ``(..., rows * heads * R)`` names the same slot as a row of that
    read viewed as ``(rows * heads * size, dim)``. Made once for every layer of a step."""
    rows, heads = slots.shape[-3:-1]
    first = torch.arange(0, rows * heads * size, size, device=slots.device).view(rows, heads, 1)
    return (slots + first).flatten(-3)


def read_slots(codec: SlotCodec, buffers: dict[str, torch.Tensor], name: str, dtype: torch.dtype,
               rows: torch.Tensor | None) -> torch.Tensor:
    """Quantity ``name`` of one layer's slot ``buffers`` (``(batch, heads, slots, dim)``) as
    attention reads it, in ``dtype``: as ``codec`` reads it back, then each ring entry
    written over the slot holding its token, ``rows`` (``entry_rows`` of ``entry_slots``):
    R copies, where gathering the ring for every slot cost as much as dequantizing them
    all again."""
    read = codec.read(buffers, name, dtype)
    ring = buffers.get(window_name(name))
    if ring is None:
        return read
    # One copy of whole rows of the read, flattened to (slots of every head, dim): on the
    # CPU three times faster than scattering along the slot dimension. ``read`` is the
    # codec's fresh copy (only quantized quantities have a ring), so it can be viewed so.
    read = read.contiguous()
    read.view(-1, read.shape[-1]).index_copy_(0, rows, ring.to(dtype).flatten(0, -2))
    return read
