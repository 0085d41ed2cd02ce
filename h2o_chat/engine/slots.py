"""Slot buffers shared by neighbouring layers, and the eviction kernel that runs over them.

A slot holds one cached token of one KV head: its key, value, accumulated score, absolute
position and flags. ``evict_slots`` is a plain function over such buffers; ``SlotGroup``
stacks the buffers of several layers so that one call evicts them all. A group talks to
its member layers only through ``SlotMember``.
"""

from __future__ import annotations

import copy
import weakref
from typing import Protocol

import torch

from .policies import EvictionPolicy
from .rope import RopeShifter

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


def evict_slots(buffers: dict[str, torch.Tensor], held: int, policy: EvictionPolicy,
                rope: RopeShifter | None) -> int:
    """Evict the slots ``policy`` drops from ``buffers`` (``(batch, heads, size, ...)``,
    the first ``held`` slots in use) and return the new number of slots held. With
    rolling (a ``rotated_at`` buffer), kept keys get their new ranks, and ``rope`` rotates
    them there where they are rotated in place.

    ``heads`` may be the KV heads of one layer or of several stacked layers: the policy
    decides per head, so one call serves a whole ``SlotGroup``.
    """
    capacity = policy.capacity
    if capacity is None:
        return held
    pinned = buffers["pinned"][:, :, :held]
    n_pinned = int(pinned[0, 0].sum())
    n_free = held - n_pinned
    if n_free <= capacity:
        return held
    positions = buffers["positions"][:, :, :held]
    scores = buffers["scores"][:, :, :held]
    drop = policy.drop_one(scores, positions) if n_pinned == 0 and n_free == capacity + 1 else None
    if drop is not None:
        # The last slot moves into the dropped one (onto itself where it is the one).
        for buffer in buffers.values():
            index = drop.view(*drop.shape, *[1] * (buffer.dim() - 3)).expand(*drop.shape, *buffer.shape[3:])
            buffer.scatter_(2, index, buffer[:, :, held - 1 : held].clone())
        if "rotated_at" in buffers:
            _roll_to_ranks(buffers, held - 1, rope)
        return held - 1
    # The policy sees the evictable slots oldest first (pinned ones sort last).
    order_key = positions.masked_fill(pinned, torch.iinfo(torch.long).max)
    free = order_key.argsort(dim=-1)[..., :n_free]
    chosen = policy.keep(scores.gather(-1, free), positions.gather(-1, free))
    chosen = free.gather(-1, chosen.expand(*free.shape[:-1], -1))
    keep = pinned.scatter(-1, chosen, True)
    new_held = held - (n_free - capacity)
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

    policy: EvictionPolicy
    key_rotation: RopeShifter | None  # rotates kept keys in place when rolling moves them
    held: int  # slots in use: the first ``held`` of the layer's buffers

    @property
    def size(self) -> int: ...

    def held_slots(self) -> dict[str, torch.Tensor]:
        """The layer's buffers by name, ``(batch, kv_heads, held, ...)`` views."""

    def adopt(self, group: SlotGroup, buffers: dict[str, torch.Tensor], closes_group: bool) -> None:
        """Keep ``buffers`` (``(batch, kv_heads, size, ...)``, the layer's row of the
        group's) as its own; ``closes_group``: its attention call evicts the group."""


class SlotGroup:
    """The buffers of consecutive layers, stacked: ``(batch, layers, kv_heads, size, ...)``.

    Each member layer's buffers are views of its row. After the last member's attention
    the whole group is evicted in one ``evict_slots`` call, with the layers' KV heads side
    by side; evicting layer by layer cost a few dozen small tensor ops per layer and per
    decoded token, which made H2O slower than sdpa at short contexts.

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
        where ``slots`` are)."""
        buffers = {}
        for name, t in slots.items():
            buffer = t.new_zeros((t.shape[0], 1, t.shape[1], size, *t.shape[3:]), device=device)
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
            stacked = t.new_zeros((t.shape[0], len(layers), t.shape[1], size, *t.shape[3:]))
            for index, slots in enumerate(held):
                stacked[:, index, :, : slots[name].shape[2]] = slots[name]
            buffers[name] = stacked
        return cls(layers, buffers)

    def resize(self, size: int) -> None:
        """Give every member room for ``size`` slots, keeping what it holds."""
        def grow(t: torch.Tensor) -> torch.Tensor:
            bigger = t.new_zeros((*t.shape[:3], size, *t.shape[4:]))
            kept = min(size, t.shape[3])
            bigger[:, :, :, :kept] = t[:, :, :, :kept]
            return bigger

        self._adopt({name: grow(t) for name, t in self.buffers.items()})

    def relocate(self, buffers: dict[str, torch.Tensor]) -> None:
        """Move what the group holds into ``buffers`` (shaped as its own, e.g. a row of a
        ``RowPool``) and keep those from now on."""
        for name, t in buffers.items():
            t.copy_(self.buffers[name])
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
            flat = {name: _side_by_side(t[:, start:end]) for name, t in self.buffers.items()}
            held = evict_slots(flat, layers[start].held, layers[start].policy, layers[start].key_rotation)
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
