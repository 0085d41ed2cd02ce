"""What a bounded cache forgot: a full-cache shadow fed the same tokens, compared per step.

A ``FidelityProbe`` attaches to a session as its observer. After each forward pass of the
session, before its next, it feeds the same tokens to its own full cache
(teacher forcing: the shadow never samples, so both read exactly the same conversation,
and the same model weights serve both) and records, for the token the session predicts
next, whether the two caches' most likely tokens agree, KL(full || bounded) of their
next-token distributions, and which tokens the bounded cache no longer held although the
full cache's newest query attended to them most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from .engine.build import make_cache
from .engine.cache import H2OCache
from .scheduler import forward_one
from .sessions import Session

TOP_FORGOTTEN = 8  # forgotten tokens kept per step, heaviest first


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter one's length if
    one is a prefix of the other); None when they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Forgotten:
    """A token the bounded cache lacked at one step, in some layers and KV heads."""

    position: int  # in the conversation
    # Attention the full cache's newest query gave it where the bounded cache lacked it,
    # as a share of all its attention (averaged over layers and query heads).
    mass: float
    pairs: int  # (layer, KV head) pairs of the bounded cache that lacked it


@dataclass(frozen=True)
class FidelityPoint:
    """One forward pass of the bounded session: the prediction of token ``position``."""

    position: int  # index in the conversation of the token being predicted
    agree: bool  # both caches' most likely next token is the same
    kl: float  # KL(full || bounded) of the next-token distributions, nats
    full_top: int  # the full cache's most likely next token
    bounded_top: int
    lost_mass: float  # share of the newest query's attention on tokens the bounded lacked
    forgotten: tuple[Forgotten, ...]  # the heaviest of them (at most TOP_FORGOTTEN)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(softmax(reference) || softmax(other)) in nats, from two logit vectors."""
    ref, oth = reference.float().log_softmax(-1), other.float().log_softmax(-1)
    # Rounding can leave a hair below zero for identical distributions.
    return max(0.0, float((ref.exp() * (ref - oth)).sum()))


def held_positions(cache: H2OCache) -> torch.Tensor | None:
    """Copy of the positions every layer holds, ``(layers, kv_heads, held)`` for batch
    row 0 (every layer holds equally many slots); None before the first token."""
    if not cache.layers[0].is_initialized:
        return None
    return torch.stack([layer.positions[0] for layer in cache.layers])


def _keep_newest_attention(store: list[torch.Tensor | None], index: int, probabilities: torch.Tensor) -> None:
    """Store at ``index`` what the newest query gave each slot, ``(batch, kv_heads, held)``
    float32, summed over the query heads of the slot's KV head."""
    store[index] = probabilities[:, :, :, -1].sum(dim=2)


class FidelityProbe:
    """A full-cache shadow of one session; ``points`` holds one ``FidelityPoint`` per
    forward pass of the session since it was attached."""

    def __init__(self, session: Session, top_k: int = TOP_FORGOTTEN) -> None:
        self.session = session
        self.top_k = top_k
        self.shadow = make_cache(session.model, "full")
        # Per shadow layer, the mass each slot got from the newest query at the latest
        # step. The observers hold this list, not the probe: no cycle keeps the shadow's
        # buffers alive after the probe is dropped.
        self._newest_attention: list[torch.Tensor | None] = [None] * len(self.shadow.layers)
        for index, layer in enumerate(self.shadow.layers):
            layer.attention_observer = partial(_keep_newest_attention, self._newest_attention, index)
        self.shadow_tokens: list[int] = []  # what the shadow has read
        self._predicted_from: list[int] = []  # the conversation the points are about
        self.points: list[FidelityPoint] = []
        self.full_logits: torch.Tensor | None = None  # the shadow's, at the latest step
        self._held_at = (0, None)  # (tokens fed, bounded positions held right then)

    def attach(self) -> FidelityProbe:
        """Observe the session from its next forward pass on."""
        if self.session.observer not in (None, self.observe):
            raise RuntimeError("the session already has an observer")
        # What the bounded cache holds before the next pass: the tokens its query can see.
        self._held_at = (self.session.fed, held_positions(self.session.cache))
        self.session.observer = self.observe
        self.session.followers = (self.shadow,)
        return self

    def detach(self) -> None:
        if self.session.observer == self.observe:
            self.session.observer = None
            self.session.followers = ()

    def observe(self, tokens: list[int], start: int, end: int, logits: torch.Tensor) -> None:
        """The session just fed ``tokens[start:end]`` and predicted from ``logits``."""
        self._forget_changed(tokens)
        with torch.inference_mode():
            self._catch_up(tokens, start)
            self.full_logits = self._feed(tokens[start:end])
            # A session refilling its cache (after a failed pass) replays tokens it has
            # read before: the record keeps what happened the first time.
            if end > len(self._predicted_from):
                visible = self._visible_before(start, end)
                self.points.append(self._point(end, logits, self.full_logits, visible))
        self._predicted_from += tokens[len(self._predicted_from) : end]
        self._held_at = (end, held_positions(self.session.cache))

    # ---- internals --------------------------------------------------------------------------

    def _feed(self, ids: Sequence[int]) -> torch.Tensor:
        chunk = torch.tensor([list(ids)], device=self.session.model.device)
        # Called from the session's pass observer, in the thread that runs the model's
        # passes: the shadow's pass runs there too, between the session's two steps.
        logits = forward_one(self.session.model, self.shadow, chunk)
        self.shadow_tokens += ids
        return logits

    def _forget_changed(self, tokens: list[int]) -> None:
        """Drop the points predicted from tokens the session has since taken back."""
        known = self._predicted_from
        # Checked at C speed first: normally the conversation only grows.
        common = len(known) if known == tokens[: len(known)] else first_divergence(known, tokens)
        while self.points and self.points[-1].position > common:
            self.points.pop()
        del known[common:]

    def _catch_up(self, tokens: list[int], start: int) -> None:
        """Make the shadow have read exactly ``tokens[:start]``, in the session's chunks:
        more of them when attached mid-conversation, all again when the session went
        back or refills its cache (a full cache cannot un-read)."""
        read = self.shadow_tokens
        if len(read) > start or read != tokens[: len(read)]:
            self.shadow.reset()
            self.shadow_tokens = []
        size = self.session.prefill_chunk_size
        for at in range(len(self.shadow_tokens), start, size):
            self._feed(tokens[at : min(at + size, start)])

    def _visible_before(self, start: int, end: int) -> torch.Tensor:
        """``(layers, kv_heads, end)`` bool: which positions the bounded cache's newest
        query could attend to in the pass that fed ``[start, end)``: what it held before
        the pass (its eviction after the pass does not count yet) plus the new tokens."""
        fed, held = self._held_at
        if fed != start:
            # A fresh cache (start 0: the session rebuilt it) holds nothing before the
            # pass. Otherwise, not seen from the start of this pass (cannot happen while
            # attached from the session's own fed count on): the best known is now.
            held = held_positions(self.session.cache) if start else None
        layers, kv_heads = len(self.shadow.layers), self.shadow.layers[0].keys.shape[1]
        visible = torch.zeros(layers, kv_heads, end, dtype=torch.bool)
        if held is not None:
            visible.scatter_(-1, held.cpu(), True)
        visible[..., start:end] = True
        return visible

    def _point(self, position: int, logits: torch.Tensor, full_logits: torch.Tensor,
               visible: torch.Tensor) -> FidelityPoint:
        # A full cache never evicts, so its slot i holds position i.
        attention = torch.stack([newest[0] for newest in self._newest_attention]).cpu()
        query_heads = self.session.model.config.get_text_config(decoder=True).num_attention_heads
        lacking = ~visible
        lost = (attention * lacking).sum(dim=(0, 1)) / (attention.shape[0] * query_heads)
        pairs = lacking.sum(dim=(0, 1))
        top = lost.topk(min(self.top_k, lost.numel()))
        forgotten = tuple(
            Forgotten(int(p), float(m), int(pairs[p]))
            for m, p in zip(top.values.tolist(), top.indices.tolist()) if m > 0
        )
        full_top, bounded_top = int(full_logits.argmax()), int(logits.argmax())
        return FidelityPoint(
            position=position, agree=full_top == bounded_top,
            kl=kl_divergence(full_logits, logits), full_top=full_top, bounded_top=bounded_top,
            lost_mass=float(lost.sum()), forgotten=forgotten,
        )
