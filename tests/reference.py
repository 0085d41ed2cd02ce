"""A plain reference implementation of the eviction rule, written for clarity, not speed.

It keeps every key and value (a stock ``DynamicCache``) and a per-(layer, row, KV head)
list of alive positions; attention is computed over all positions with the dead ones
masked out, and the rule is applied with Python lists and ``sorted``. The engine must
keep the same positions and produce the same logits.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from h2o_chat.engine.quant import QUANTIZED_BITS, KVStorage

REFERENCE_NAME = "h2o_reference"


class ReferenceRule:
    """State of the rule: alive flags and accumulated scores, per layer."""

    def __init__(self, heavy: int, recent: int, sink: int, protected: tuple[int, int] | None = None,
                 norm: str = "sum", turns: tuple[int, ...] = ()):
        self.heavy, self.recent, self.sink, self.norm = heavy, recent, sink, norm
        self.protected = protected
        # Turn starts (the turns policy): a slot scores only with its own turn's queries,
        # and with the mean norm its score becomes its mass per query when its turn closes.
        self.turns = turns
        self.opened: dict[int, int] = {}  # layer -> the open turn's start
        self.alive: dict[int, torch.Tensor] = {}  # layer -> (batch, kv_heads, T) bool
        self.score: dict[int, torch.Tensor] = {}  # layer -> (batch, kv_heads, T) float32

    def is_protected(self, position: int) -> bool:
        return self.protected is not None and self.protected[0] <= position < self.protected[1]

    def kept_positions(self, layer: int) -> list[list[list[int]]]:
        alive = self.alive[layer]
        return [
            [[p for p in range(alive.shape[-1]) if alive[b, h, p]] for h in range(alive.shape[1])]
            for b in range(alive.shape[0])
        ]

    def attend(self, layer: int, query, key, value, mask, scaling):
        batch, q_heads, q_len, _ = query.shape
        kv_heads, total = key.shape[1], key.shape[2]
        groups = q_heads // kv_heads
        grow = total - (self.alive[layer].shape[-1] if layer in self.alive else 0)
        new_alive = torch.ones(batch, kv_heads, grow, dtype=torch.bool)
        new_score = torch.zeros(batch, kv_heads, grow)
        self.alive[layer] = torch.cat([self.alive.get(layer, new_alive[..., :0]), new_alive], -1)
        self.score[layer] = torch.cat([self.score.get(layer, new_score[..., :0]), new_score], -1)
        first = total - q_len  # this pass's first position
        opened = max([start for start in self.turns if start <= first], default=0)
        if opened > self.opened.get(layer, 0):
            for p in range(self.opened.get(layer, 0), first):
                if self.norm == "mean":
                    self.score[layer][..., p] /= first - p
            self.opened[layer] = opened

        # Standard causal mask over absolute positions, and dead slots masked for each head.
        if mask is None:
            visible = torch.ones(q_len, total, dtype=torch.bool).tril(total - q_len)[None, None]
        else:
            visible = mask
        visible = visible & self.alive[layer].repeat_interleave(groups, dim=1)[:, :, None, :]
        keys = key.repeat_interleave(groups, dim=1).float()
        values = value.repeat_interleave(groups, dim=1).float()
        logits = (query.float() @ keys.transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        output = (probs @ values).transpose(1, 2).to(query.dtype)

        received = probs.view(batch, kv_heads, groups, q_len, total).sum(dim=(2, 3))
        scoring = self.alive[layer] & (torch.arange(total) >= self.opened.get(layer, 0))
        self.score[layer] += received * scoring
        self.evict(layer)
        return output.contiguous(), probs

    def evict(self, layer: int) -> None:
        alive, score = self.alive[layer], self.score[layer]
        budget = self.sink + self.heavy + self.recent
        for b in range(alive.shape[0]):
            for h in range(alive.shape[1]):
                candidates = [
                    p for p in range(alive.shape[-1]) if alive[b, h, p] and not self.is_protected(p)
                ]
                if len(candidates) <= budget:
                    continue
                seen = alive.shape[-1]  # position p has had the queries of p .. seen - 1
                # The windows: the first sink and the last recent unprotected tokens seen.
                free = [p for p in range(seen) if not self.is_protected(p)]
                windows = set(free[: self.sink]) | set(free[len(free) - self.recent :] if self.recent else ())
                keep = {p for p in candidates if p in windows}
                middle = [p for p in candidates if p not in windows]

                def rank(p: int) -> float:
                    final = p < self.opened.get(layer, 0)  # its turn closed
                    return float(score[b, h, p]) / ((seen - p) if self.norm == "mean" and not final else 1)

                by_score = sorted(middle, key=lambda p: (-rank(p), p))
                keep |= set(by_score[: budget - len(keep)])
                for p in candidates:
                    if p not in keep:
                        alive[b, h, p] = False
                        score[b, h, p] = 0.0


class StoredAsCache(DynamicCache):
    """A stock cache keeping every key and value as ``storage`` would read them back: each
    token's are written and read through the storage's codecs on arrival (a slot's
    storage depends on that slot alone, so this is what the engine holds for it). The
    pass that brings tokens attends them as the model gave them; later passes read them
    stored, but for the newest ``storage.exact_window`` tokens of a quantized quantity,
    read as the model gave them rounded to float16."""

    def __init__(self, config, storage: KVStorage = KVStorage()) -> None:
        super().__init__(config=config)
        self.storage = storage
        self.rounded = DynamicCache(config=config)  # every key and value at float16

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(self._stored(self.storage.keys, key_states),
                                      self._stored(self.storage.values, value_states), layer_idx, *args, **kwargs)
        rounded = self.rounded.update(key_states.half().to(key_states.dtype),
                                      value_states.half().to(value_states.dtype), layer_idx)
        new = key_states.shape[2]
        read = []
        for stored, half, given, bits in zip((keys, values), rounded, (key_states, value_states),
                                             (self.storage.key_bits, self.storage.value_bits)):
            window = max(new, self.storage.exact_window if bits in QUANTIZED_BITS else 0)
            read.append(torch.cat([stored[:, :, :-window], half[:, :, -window:-new], given], dim=2))
        return tuple(read)

    @staticmethod
    def _stored(codec, x):
        slots = x.shape[:3]
        buffers = codec.empty("x", slots, x.shape[-1], x.device, x.dtype)
        codec.write(buffers, "x", 0, slots[2], x)
        return codec.read(buffers, "x", x.dtype)


_active_rule: list[ReferenceRule] = []


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return _active_rule[0].attend(module.layer_idx, query, key, value, attention_mask, scaling)


def register_reference() -> None:
    AttentionInterface.register(REFERENCE_NAME, _reference_attention)
    AttentionMaskInterface.register(REFERENCE_NAME, sdpa_mask)


class use_rule:
    """Context manager: route the reference attention to ``rule``."""

    def __init__(self, rule: ReferenceRule):
        self.rule = rule

    def __enter__(self):
        _active_rule.append(self.rule)
        return self.rule

    def __exit__(self, *exc):
        _active_rule.remove(self.rule)


def nucleus_by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus (top-p) filtering the plain way: the whole vocabulary sorted, the smallest
    prefix whose mass reaches ``top_p`` kept, everything else zeroed."""
    ranked, order = probs.sort(descending=True)
    ranked[ranked.cumsum(-1) - ranked >= top_p] = 0
    return torch.zeros_like(probs).scatter_(-1, order, ranked)
