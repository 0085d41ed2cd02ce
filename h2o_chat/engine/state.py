"""Saving and resuming an ``H2OCache`` exactly: its held slots, scores and counters.

A state is a dict of CPU tensors named ``layers.<i>.<buffer>`` (the held slots of each
layer, in slot order) and a JSON-able dict: the cache's settings, its protected spans and
per-layer counters. A cache resumed from it continues bit for bit like the original.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from h2o_chat.config import quoted

from .quant import KVStorage
from .slots import ROLLING_METADATA, SLOT_METADATA

_COUNTERS = {"initialized": bool, "seen": int, "held": int, "size": int, "has_padding": bool}
_DTYPES = SLOT_METADATA | ROLLING_METADATA
_RING_DTYPES = (torch.float16, torch.bfloat16)  # the exact window's, by the model's dtype
# Settings a policy's ``describe()`` leaves out at their default value.
_IMPLIED = {"h2o": {"score_norm": "sum"}}
# A message lists this many differences at most (a hand-made file may name any number).
_MOST_LISTED = 8


@dataclass(frozen=True)
class SettingDifference:
    """One cache setting (``policy``, ``heavy``, ``rolling``, ...) where a saved state's
    value differs from a cache's; None where that side's policy does not use it."""

    name: str
    saved: Any
    ours: Any


def settings_differences(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> list[SettingDifference]:
    """Every setting where ``saved`` differs from ``ours`` (both as ``settings()`` gives
    them), the policy first. Where the policies differ, only the settings the saved
    policy uses count: taking the saved policy makes the others irrelevant."""
    if saved.get("policy") == ours.get("policy"):
        saved, ours = _in_full(saved), _in_full(ours)
        names = set(saved) | set(ours)
    else:
        names = set(saved)
    names = ["policy", *sorted(names - {"policy"})]
    return [SettingDifference(name, saved.get(name), ours.get(name))
            for name in names if saved.get(name) != ours.get(name)]


def describe_differences(differences: Sequence[SettingDifference], saved_where: str, ours_where: str) -> str:
    """The differences in one line, e.g. ``cache.heavy = 24 in the file, 16 in this
    cache; cache.rolling = True in the file, False in this cache``."""
    listed = [f"cache.{d.name} = {_shown(d.saved)} {saved_where}, {_shown(d.ours)} {ours_where}"
              for d in differences[:_MOST_LISTED]]
    more = len(differences) - _MOST_LISTED
    return "; ".join(listed) + (f"; and {more} more" if more > 0 else "")


def _in_full(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with the values its policy implies (a known policy's name is a str)."""
    policy = settings.get("policy")
    return (_IMPLIED.get(policy, {}) if isinstance(policy, str) else {}) | dict(settings)


def _shown(value: Any) -> str:
    return "not used" if value is None else quoted(value, 40)


class CacheStateMixin:
    """``state``/``load_state`` for ``H2OCache``, through its public members (``layers``,
    ``policy``, ``rolling``, ``spans``) and its layers' (``held_slots``, ``restore``, ...)."""

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What a fresh cache needs to continue exactly where this one is: tensors named
        ``layers.<i>.<buffer>`` (CPU, held slots only) and a JSON-able dict of the policy,
        rolling, protected spans and per-layer counters. Load it with ``load_state``."""
        tensors: dict[str, torch.Tensor] = {}
        layers = []
        for index, layer in enumerate(self.layers):
            initialized = layer.is_initialized
            tensors |= {f"layers.{index}.{name}": t.detach().cpu().contiguous()
                        for name, t in layer.held_slots().items()}
            layers.append({"initialized": initialized, "seen": layer.seen, "held": layer.held,
                           "size": layer.size if initialized else 0, "has_padding": layer.has_padding})
        info = {"settings": self.settings(), "protected": [list(span) for span in self.spans.ranges],
                "layers": layers}
        if self.policy.marks_turns:
            info["turns"] = {"starts": list(self.turns.starts), "opened": self.turns.opened}
        return tensors, info

    def settings(self) -> dict[str, int | str | bool]:
        """Policy, budgets, rolling and storage bits: what a saved state must match to be
        loaded (bits left at the model's dtype are left out, as in files saved before
        they existed)."""
        described = self.policy.describe() if self.byte_budget is None else \
            self.byte_budget.settings | {"budget_bytes": self.byte_budget.bytes}
        return described | {"rolling": self.rolling} | self.storage.describe()

    def check_settings(self, saved: dict, source: str = "the saved state") -> None:
        """ValueError naming every setting where ``saved`` differs from this cache's."""
        differences = settings_differences(saved, self.settings())
        if differences:
            raise ValueError(describe_differences(differences, f"in {source}", "in this cache"))

    def load_state(self, tensors: dict[str, torch.Tensor], info: dict, device: torch.device | str = "cpu") -> None:
        """Replace everything this cache holds with a ``state()``, onto ``device``.

        The state must come from a cache with the same ``settings()`` (else ValueError
        naming the setting, the state's value and this cache's); everything is checked
        before anything changes, so a refused state leaves this cache as it was.
        """
        self.check_settings(info["settings"])
        if len(info["layers"]) != len(self.layers):
            raise ValueError(f"the saved state has {len(info['layers'])} layers, this cache {len(self.layers)}")
        per_layer: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]
        for name, t in tensors.items():
            match = re.fullmatch(r"layers\.(\d+)\.(\w+)", name)
            if match is None or int(match[1]) >= len(self.layers):
                raise ValueError(f"unexpected tensor {name!r} in the saved state")
            per_layer[int(match[1])][match[2]] = t
        for index, (slots, counters) in enumerate(zip(per_layer, info["layers"])):
            _check_layer(slots, counters, self.rolling, self.storage, f"layer {index}")
        seen = {counters["seen"] for counters in info["layers"]}
        if len(seen) != 1:
            raise ValueError(f"the saved layers have seen different token counts {sorted(seen)}")
        spans = [(start, end) for start, end in info["protected"]]
        if not all(type(x) is int and x >= 0 for span in spans for x in span):
            raise ValueError(f"protected spans {info['protected']!r} must be pairs of integers >= 0")
        turns = _checked_turns(info.get("turns"), seen.pop()) if self.policy.marks_turns else None
        for layer, slots, counters in zip(self.layers, per_layer, info["layers"]):
            if counters["initialized"]:
                layer.restore(slots, counters["size"], counters["seen"], counters["has_padding"], device)
            else:
                layer.reset()
        self.spans.ranges[:] = spans  # in place: the layers share this object
        if turns is not None:
            self.turns.starts[:], self.turns.opened = turns  # in place, likewise
        self._fit_budget()


def _checked_turns(turns: Any, seen: int) -> tuple[list[int], int]:
    """A saved state's turn starts and open turn, checked: sorted distinct positions, the
    open turn's start one of them (or 0) and no later than the tokens seen."""
    if not isinstance(turns, dict) or set(turns) != {"starts", "opened"}:
        raise ValueError("the saved state has no turns ({'starts': [...], 'opened': n}), which its policy keeps")
    starts, opened = turns["starts"], turns["opened"]
    if (not isinstance(starts, list) or not all(type(x) is int and x >= 0 for x in starts)
            or starts != sorted(set(starts))):
        raise ValueError(f"turn starts {starts!r} must be increasing integers >= 0")
    if type(opened) is not int or not 0 <= opened <= seen or (opened and opened not in starts):
        raise ValueError(f"the open turn's start {opened!r} must be 0 or one of the turn starts, "
                         f"at most the tokens seen ({seen})")
    return starts, opened


def _stores_as(storage: KVStorage, channels: int, keys: torch.Tensor) -> bool:
    """Whether keys of ``channels`` channels are stored as ``keys``' last dimension."""
    try:
        return channels > 0 and storage.layout(channels, keys.dtype)["keys"][1] == keys.shape[-1]
    except ValueError:  # a number of channels the codec cannot pack
        return False


def _check_layer(slots: dict[str, torch.Tensor], counters: dict, rolling: bool, storage: KVStorage,
                 where: str) -> None:
    """Raise ValueError naming ``where`` if a layer could not be restored from this."""
    for key, kind in _COUNTERS.items():
        if type(counters.get(key)) is not kind:
            raise ValueError(f"{where}: {key} = {counters.get(key)!r} must be {kind.__name__}")
    if not counters["initialized"]:
        if slots or counters["seen"] or counters["held"]:
            raise ValueError(f"{where}: an empty layer must hold no tokens")
        return
    head_dim = slots["keys"].shape[-1] if "keys" in slots else 0
    stored = storage.layout(head_dim, torch.float32)  # names, and dtypes where quantized
    window = storage.window_layout(head_dim, torch.float32)  # names (the dtype is the model's)
    names = {*stored, *window, "scores", "positions", "valid", "pinned"} | ({"rotated_at"} if rolling else set())
    if set(slots) != names:
        raise ValueError(f"{where}: tensors {sorted(slots)}, expected {sorted(names)}")
    held, size, seen = counters["held"], counters["size"], counters["seen"]
    if not 0 <= held <= min(size, seen):
        raise ValueError(f"{where}: held = {held} must be within 0..min(size {size}, seen {seen})")
    keys = slots["keys"]
    if keys.dim() != 4 or keys.shape[2] != held or slots["values"].shape[:3] != keys.shape[:3]:
        raise ValueError(f"{where}: keys/values of shape {tuple(keys.shape)}/"
                         f"{tuple(slots['values'].shape)} do not hold {held} slots")
    for name in set(stored) - {"keys", "values"}:
        t, (dtype, _) = slots[name], stored[name]
        if t.dim() != 4 or t.shape[:3] != keys.shape[:3] or t.dtype != dtype:
            raise ValueError(f"{where}: {name} is {t.dtype} {tuple(t.shape)}, expected {dtype} "
                             f"{tuple(keys.shape[:3])} + one per group")
    for name in window:
        # A ring holds each token's channels as given, as many as the keys store codes for.
        t, lead = slots[name], (*keys.shape[:2], storage.exact_window)
        channels = t.shape[-1] if t.dim() == 4 else 0
        if t.shape[:3] != lead or t.dtype not in _RING_DTYPES or not _stores_as(storage, channels, keys):
            raise ValueError(f"{where}: {name} is {t.dtype} {tuple(t.shape)}, expected 16-bit floats {lead} + "
                             "the keys' channels")
    for name in names - set(stored) - set(window):
        t = slots[name]
        if t.shape != keys.shape[:3] or t.dtype != _DTYPES[name]:
            raise ValueError(f"{where}: {name} is {t.dtype} {tuple(t.shape)}, expected "
                             f"{_DTYPES[name]} {tuple(keys.shape[:3])}")
