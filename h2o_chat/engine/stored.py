"""One layer's keys or values as the decode step's attention reads them, before they are
read: the stored slot buffers, the exact window's ring written over the slots holding
its tokens, the rows' new tokens as the model gave them, and, with rolling, the rotation
of keys stored unrotated.

``read`` builds the float copy the reference attention takes; the fused kernel
(``decode_kernel``) reads the same from the buffers themselves, codes included, so a
quantized cache is never copied out at all on a GPU.
"""

from __future__ import annotations

import torch

from .quant import FloatCodec, GroupQuantCodec, SlotCodec, make_codec
from .rope import RopeShifter
from .window import entry_rows, read_slots, window_name


class StoredSlots:
    """Quantity ``name`` of one layer's slot ``buffers`` ``(rows, kv_heads, slots, ...)``
    as ``codec`` stores it. ``entries``: per ring entry the slot holding its token
    (``window.entry_slots``), None without a ring; ``new``: each row's new token
    ``(rows, kv_heads, dim)``, read in its newest slot ``at`` instead of what is stored
    there; ``rotation``: rope and the rank each key is rotated to when read (rolling);
    ``entry_rows``: ``window.entry_rows`` of ``entries`` where already made (the decode
    step makes them once for every layer)."""

    def __init__(self, codec: SlotCodec, buffers: dict[str, torch.Tensor], name: str,
                 entries: torch.Tensor | None = None, new: torch.Tensor | None = None, at: tuple | None = None,
                 rotation: tuple[RopeShifter, torch.Tensor] | None = None,
                 entry_rows: torch.Tensor | None = None) -> None:
        self.codec, self.buffers, self.name = codec, buffers, name
        self.entries, self.new, self.at, self.rotation = entries, new, at, rotation
        self.entry_rows = entry_rows

    @classmethod
    def plain(cls, x: torch.Tensor) -> StoredSlots:
        """Slots held as ``x`` is, nothing over them."""
        return cls(FloatCodec(None), {"slots": x}, "slots")

    @classmethod
    def encode(cls, x: torch.Tensor, bits: int | None, name: str) -> StoredSlots:
        """``x`` ``(rows, kv_heads, slots, dim)`` stored through the codec of ``bits``
        (None: as it is), nothing over it."""
        if bits is None:
            return cls.plain(x)
        codec = make_codec(bits)
        buffers = codec.empty(name, x.shape[:3], x.shape[-1], x.device, x.dtype)
        codec.write(buffers, name, 0, x.shape[2], x)
        return cls(codec, buffers, name)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The slots as attention reads them, in ``dtype`` ``(rows, kv_heads, slots, dim)``:
        a copy wherever anything is decoded, rotated or written over."""
        rows = self.entry_rows
        if rows is None and self.entries is not None:
            rows = entry_rows(self.entries, self.slots)
        read = read_slots(self.codec, self.buffers, self.name, dtype, rows)
        if self.rotation is not None:
            rope, rotated_at = self.rotation
            read = rope.shift(read, rotated_at)
        if self.new is not None:
            read[self.at] = self.new
        return read

    # What the fused kernel reads in place of ``read``.

    @property
    def data(self) -> torch.Tensor:
        """The stored slots: floats, or codes where ``bits``."""
        return self.buffers[self.name]

    @property
    def bits(self) -> int:
        """Bits of the codes, 0 where stored as floats."""
        return self.codec.bits if isinstance(self.codec, GroupQuantCodec) else 0

    @property
    def group(self) -> int:
        """Channels per scale and minimum (quantized only)."""
        return self.codec.group_size(self.dim) if self.bits else 0

    @property
    def scale(self) -> torch.Tensor | None:
        return self.buffers[f"{self.name}_scale"] if self.bits else None

    @property
    def minimum(self) -> torch.Tensor | None:
        return self.buffers[f"{self.name}_min"] if self.bits else None

    @property
    def ring(self) -> torch.Tensor | None:
        """The exact window's ring ``(rows, kv_heads, R, dim)``, None without one."""
        return self.buffers.get(window_name(self.name))

    @property
    def dim(self) -> int:
        data = self.data
        return data.shape[-1] * 8 // self.bits if self.bits else data.shape[-1]

    @property
    def slots(self) -> int:
        return self.data.shape[2]
