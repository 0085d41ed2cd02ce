"""Slot buffers shared by neighbouring layers, and the eviction kernel that runs over them.

A slot holds one cached token of one KV head: its key, value, accumulated score, absolute
position and flags. ``evict_slots`` is a plain function over such buffers; ``SlotGroup``
stacks the buffers of several layers so that one call evicts them all. A group talks to
its member layers only through ``SlotMember``.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from .memory import tensor_bytes
from .rope import RopeShifter
from .selection import kept_slots, lowest_slot, middle_slots, ranking_key
from .window import is_window, length, slot_buffers

# Each slot's bookkeeping beside its key and value, by buffer name.
SLOT_METADATA = {"scores": torch.float32, "positions": torch.long, "valid": torch.bool, "pinned": torch.bool}
ROLLING_METADATA = {"rotated_at": torch.long}  # the rank a key is rotated to, with rolling


def grown_size(size: int, slots: int, held: int, capacity: int | None, pinned: int) -> int:
    """Buffer size for ``slots`` slots. Geometric growth: a cache below its budget would
    otherwise reallocate and copy every buffer at every token. A bounded cache stops at
    its peak (budget, pinned slots and the incoming tokens) and never grows after that."""
    grown = max(slots, 2 * size)
    if capacity is not None:
        grown = max(slots, min(grown, capacity + pinned + slots - held))
    return grown


@dataclass(frozen=True)
class RowBounds:
    """What the eviction rule needs of a cache beside its slots, from the host (the same for
    every layer): pinned slots per head, tokens seen, and per batch row the windows
    ``[start, end)`` (``spans.ProtectedSpans.windows``) and the ranking (``RANK_*``), as
    ints or tensors of ``(batch, 1, 1)``; ``opened``: where the open turn begins
    (``turns.TurnMarks``)."""

    pinned: int
    seen: int
    start: int | torch.Tensor
    end: int | torch.Tensor
    ranking: int | torch.Tensor
    opened: int = 0


def evict_slots(buffers: dict[str, torch.Tensor], held: int, capacity: int | None, bounds: RowBounds,
                rope: RopeShifter | None) -> int:
    """Evict from ``buffers`` (``(batch, heads, size, ...)``, the first ``held`` slots in
    use) what the rule drops down to ``capacity`` unpinned slots, and return the new
    number of slots held. With rolling (a ``rotated_at`` buffer), kept keys get their new
    ranks, and ``rope`` rotates them there where they are rotated in place.

    ``heads`` may be the KV heads of one layer or of several stacked layers: the rule
    decides per head, so one call serves a whole ``SlotGroup``.
    """
    if capacity is None or held - bounds.pinned <= capacity:
        return held
    over = held - bounds.pinned - capacity
    held_slots = {name: buffer[:, :, :held] for name, buffer in buffers.items()}
    positions, pinned = held_slots["positions"], held_slots["pinned"]
    key = ranking_key(bounds.ranking, held_slots["scores"], positions, bounds.seen, opened=bounds.opened)
    middle = middle_slots(positions, pinned, bounds.start, bounds.end)
    if over == 1:  # as at every decode step: no sort
        drop_newest_into(held_slots, lowest_slot(key, positions, middle), held - 1, None, rope)
        return held - 1
    keep = kept_slots(key, positions, pinned, middle, capacity)
    new_held = held - over
    # Slots are not kept in temporal order: the kept slots past ``new_held`` move into the
    # dropped slots before it. Per head both are equally many, and ``nonzero`` lists them
    # in (row, head, slot) order, so the j-th hole of a head pairs with its j-th mover.
    holes = (~keep[..., :new_held]).nonzero(as_tuple=True)
    movers = keep[..., new_held:held].nonzero(as_tuple=True)
    movers = (movers[0], movers[1], movers[2] + new_held)
    for buffer in buffers.values():
        buffer[holes] = buffer[movers]
    if "rotated_at" in buffers:
        _roll_to_ranks(buffers, new_held, rope)
    return new_held


def drop_newest_into(buffers: dict[str, torch.Tensor], drop: torch.Tensor, newest: int | torch.Tensor,
                     evicts: torch.Tensor | None, rope: RopeShifter | None) -> None:
    """Per head, move slot ``newest`` into slot ``drop`` (``(..., 1)`` indices; ``newest``
    broadcasts to them), where ``evicts`` (None: everywhere) is set: the dropped slot
    is gone, and nothing else moves. ``buffers`` hold slots on the dimension after the
    leading ones of ``drop`` (``positions``' last). Elsewhere the newest slot moves onto
    itself. With rolling, every kept key newer than the dropped one moves down a rank."""
    slot_dim = drop.dim() - 1
    newest = torch.as_tensor(newest, device=drop.device).expand_as(drop)
    target = drop if evicts is None else torch.where(evicts, drop, newest)
    dropped_position = buffers["positions"].gather(slot_dim, target) if "rotated_at" in buffers else None
    for buffer in buffers.values():
        trailing = (1,) * (buffer.dim() - drop.dim())
        shape = (*target.shape, *buffer.shape[drop.dim():])
        moved = buffer.gather(slot_dim, newest.view(*newest.shape, *trailing).expand(shape))
        buffer.scatter_(slot_dim, target.view(*target.shape, *trailing).expand(shape), moved)
    if dropped_position is not None:
        _rank_down(buffers, dropped_position, evicts, rope)


def _rank_down(buffers: dict[str, torch.Tensor], dropped_position: torch.Tensor, evicts: torch.Tensor | None,
               rope: RopeShifter | None) -> None:
    """After one slot per head is dropped: every key newer than it is one rank lower, and
    is rotated there where keys are rotated in place."""
    lower = buffers["positions"] > dropped_position
    if evicts is not None:
        lower &= evicts
    rotated_at = buffers["rotated_at"]
    rotated_at.sub_(lower.to(rotated_at.dtype))
    if rope is not None:
        keys = buffers["keys"]
        keys.copy_(rope.shift(keys, -lower.to(torch.long)))


def _roll_to_ranks(buffers: dict[str, torch.Tensor], held: int, rope: RopeShifter | None) -> None:
    """Give every kept key its temporal rank among the held slots (``rotated_at``), and
    rotate it there with ``rope`` where keys are rotated in place (None: they are
    rotated when read)."""
    order = buffers["positions"][:, :, :held].argsort(dim=-1)
    ranks = torch.arange(held, device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    rotated_at = buffers["rotated_at"][:, :, :held]
    if rope is not None:
        keys = buffers["keys"][:, :, :held]
        keys.copy_(rope.shift(keys, rank - rotated_at))
    rotated_at.copy_(rank)


class SlotMember(Protocol):
    """What a ``SlotGroup`` needs of a member layer (``H2OLayer``)."""

    key_rotation: RopeShifter | None  # rotates kept keys in place when rolling moves them
    held: int  # slots in use: the first ``held`` of the layer's buffers

    @property
    def size(self) -> int: ...

    def eviction_rule(self) -> tuple[int | None, RowBounds]:
        """The unpinned slots kept at rest (None: unbounded) and what else the rule needs."""

    def held_slots(self) -> dict[str, torch.Tensor]:
        """The layer's buffers by name, ``(batch, kv_heads, held, ...)`` views."""

    def adopt(self, group: SlotGroup, buffers: dict[str, torch.Tensor], closes_group: bool) -> None:
        """Keep ``buffers`` (``(batch, kv_heads, size, ...)``, the layer's row of the
        group's) as its own; ``closes_group``: its attention call evicts the group."""


class SlotGroup:
    """The buffers of consecutive layers, stacked: ``(batch, layers, kv_heads, size, ...)``.

    Each member layer's buffers are views of its row. Beside the slots, the group holds
    the exact window's rings (``window.py``), which keep their length and are never
    evicted. After the last member's attention the whole group is evicted in one
    ``evict_slots`` call, with the layers' KV heads side by side; evicting layer by layer
    cost a few dozen small tensor ops per layer and per decoded token, which made H2O
    slower than sdpa at short contexts.

    A layer starts alone in a group of one; in a cache that evicts, ``H2OCache`` stacks
    neighbours on the same device once every layer has its first tokens.
    """

    def __init__(self, layers: list[SlotMember], buffers: dict[str, torch.Tensor]) -> None:
        # Weak: members point at their group, and a cycle would keep a dropped cache's
        # buffers alive until the garbage collector happens to run.
        self._members = [weakref.ref(layer) for layer in layers]
        self._adopt(buffers)

    @property
    def layers(self) -> list[SlotMember]:
        return [member() for member in self._members]

    def __len__(self) -> int:
        return len(self._members)

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers (of views into a pool: what they show)."""
        return tensor_bytes(self.buffers.values())

    def __deepcopy__(self, memo: dict) -> SlotGroup:
        # copy.deepcopy would keep the weak references pointing at the original layers.
        twin = SlotGroup.__new__(SlotGroup)
        memo[id(self)] = twin
        twin.buffers = copy.deepcopy(self.buffers, memo)
        twin._members = [weakref.ref(copy.deepcopy(layer, memo)) for layer in self.layers]
        return twin

    def _adopt(self, buffers: dict[str, torch.Tensor]) -> None:
        """Hold ``buffers`` and point every member at its row."""
        self.buffers = buffers
        layers = self.layers
        for index, layer in enumerate(layers):
            layer.adopt(self, {name: t[:, index] for name, t in buffers.items()},
                        closes_group=index == len(layers) - 1)

    @classmethod
    def alone(cls, layer: SlotMember, slots: dict[str, torch.Tensor], size: int,
              device: torch.device | None = None) -> SlotGroup:
        """A group of ``layer`` alone, holding ``slots`` (``(batch, kv_heads, n, ...)``
        by buffer name) in buffers with room for ``size`` slots, on ``device`` (default:
        where ``slots`` are); the exact window's rings as long as they are."""
        buffers = {}
        for name, t in slots.items():
            buffer = t.new_zeros((t.shape[0], 1, t.shape[1], length(name, t.shape[2], size), *t.shape[3:]),
                                 device=device)
            buffer[:, 0, :, : t.shape[2]] = t
            buffers[name] = buffer
        return cls([layer], buffers)

    @classmethod
    def stack(cls, layers: list[SlotMember]) -> SlotGroup:
        """One group holding what ``layers`` (initialized, alike in shape and device) hold."""
        size = max(layer.size for layer in layers)
        held = [layer.held_slots() for layer in layers]
        buffers = {}
        for name, t in held[0].items():
            stacked = t.new_zeros((t.shape[0], len(layers), t.shape[1], length(name, t.shape[2], size), *t.shape[3:]))
            for index, slots in enumerate(held):
                stacked[:, index, :, : slots[name].shape[2]] = slots[name]
            buffers[name] = stacked
        return cls(layers, buffers)

    def resize(self, size: int) -> None:
        """Give every member room for ``size`` slots, keeping what it holds."""
        def grow(name: str, t: torch.Tensor) -> torch.Tensor:
            if is_window(name):
                return t
            bigger = t.new_zeros((*t.shape[:3], size, *t.shape[4:]))
            kept = min(size, t.shape[3])
            bigger[:, :, :, :kept] = t[:, :, :, :kept]
            return bigger

        self._adopt({name: grow(name, t) for name, t in self.buffers.items()})

    def relocate(self, buffers: dict[str, torch.Tensor]) -> None:
        """Move what the group holds into ``buffers`` (shaped as its own but for the number
        of slots, e.g. a row of a ``RowPool``; room for every slot held) and keep those
        from now on."""
        for name, t in buffers.items():
            kept = min(t.shape[3], self.buffers[name].shape[3])
            t[:, :, :, :kept].copy_(self.buffers[name][:, :, :, :kept])
        self._adopt(buffers)

    def dissolve(self) -> None:
        """Give every member a group of its own (a copy of its row); a group of one
        already is one."""
        if len(self) == 1:
            return
        for index, layer in enumerate(self.layers):
            SlotGroup([layer], {name: t[:, index : index + 1].clone() for name, t in self.buffers.items()})

    def evict(self) -> None:
        """Evict every member down to budget, runs of members holding the same number of
        slots at once (all of them, unless a forward pass failed midway)."""
        layers, start = self.layers, 0
        for end in range(1, len(layers) + 1):
            if end < len(layers) and layers[end].held == layers[start].held:
                continue
            flat = {name: _side_by_side(t[:, start:end]) for name, t in slot_buffers(self.buffers).items()}
            capacity, bounds = layers[start].eviction_rule()
            held = evict_slots(flat, layers[start].held, capacity, bounds, layers[start].key_rotation)
            for layer in layers[start:end]:
                layer.held = held
            start = end


def _side_by_side(buffer: torch.Tensor) -> torch.Tensor:
    """``(batch, layers, kv_heads, size, ...)`` as ``(batch, layers * kv_heads, size, ...)``:
    a view (never a copy), so evicting it evicts the members. A ``RowPool``'s row cannot
    merge its layers and heads in a view: it shows its layers as the rows instead (every
    policy decides per head; a policy that tells rows apart is for multi-row caches,
    which are never pooled)."""
    if buffer.shape[0] == 1 and buffer.stride(1) != buffer.shape[2] * buffer.stride(2):
        return buffer[0]
    return buffer.view(buffer.shape[0], -1, *buffer.shape[3:])
