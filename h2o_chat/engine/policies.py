"""Eviction policies: how a layer scores its cached slots, and which it keeps over budget.

Each policy is one small class behind one interface. After each attention call the cache
layer asks its policy to ``accumulate`` the attention mass every slot received; once over
budget it hands the policy the accumulated scores of its evictable (unpinned) slots, in
temporal order, and the policy answers with the indices to keep. Adding a policy never
touches the cache code.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from h2o_chat.config import check_cache_budgets, check_field


class EvictionPolicy:
    """Interface: ``capacity`` evictable slots are kept at rest; ``keep`` picks them."""

    name: ClassVar[str]
    # Policies that rank slots by attention mass make the attention function compute
    # explicit softmax probabilities; the others can use the fused sdpa kernel.
    needs_scores: ClassVar[bool] = False

    @property
    def capacity(self) -> int | None:
        """Evictable slots kept per KV head at rest; ``None`` means unbounded."""
        raise NotImplementedError

    def accumulate(self, scores: torch.Tensor, received: torch.Tensor) -> None:
        """Fold the attention mass each slot just received into its score, in place; both
        ``(batch, kv_heads, held)`` float32, slots in the cache's memory order. Called
        after every attention call that computed probabilities."""
        scores.add_(received)

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Indices of the slots to keep.

        ``scores`` (accumulated attention mass) and ``positions`` (absolute token
        positions; the newest is the last token seen) are ``(batch, kv_heads, n)`` with
        ``n > capacity``, oldest slot first. Returns either ``(capacity,)`` (same slots
        for every head) or ``(batch, kv_heads, capacity)``.
        """
        raise NotImplementedError

    def drop_one(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The slot to evict, ``(batch, kv_heads, 1)``, when exactly one slot is over budget
        and none is pinned, as at every decode step; or None to use ``keep``.

        Unlike ``keep``, slots come in any order (the cache's memory order), so the answer
        costs no sort. It must name the slot that ``keep`` would drop. With nothing pinned
        the sink slots are exactly positions ``0..sink-1`` and the recent window the last
        ``recent`` positions: every policy here keeps both windows, so no token in them was
        ever evicted.
        """
        return None

    def fit(self, capacity: int) -> None:
        """Keep ``capacity`` evictable slots at rest from now on (a byte budget's slots
        less the pinned ones), by resizing the share that pins may take."""
        raise ValueError(f"the {self.name} policy has no budget to fit")

    def describe(self) -> dict[str, int | str]:
        return {"policy": self.name}


def window_indices(n: int, sink: int, recent: int, device: torch.device) -> torch.Tensor:
    """The first ``sink`` and the last ``recent`` of ``n`` slots, ascending."""
    return torch.cat(
        [torch.arange(sink, device=device), torch.arange(n - recent, n, device=device)]
    )


class FullPolicy(EvictionPolicy):
    name = "full"

    @property
    def capacity(self) -> int | None:
        return None

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the full policy never evicts")


class RecentPolicy(EvictionPolicy):
    """A sliding window over the newest tokens."""

    name = "recent"

    def __init__(self, recent: int) -> None:
        self.recent = recent

    @property
    def capacity(self) -> int:
        return self.recent

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return window_indices(scores.shape[-1], 0, self.recent, scores.device)

    def drop_one(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return positions.argmin(dim=-1, keepdim=True)

    def fit(self, capacity: int) -> None:
        self.recent = max(1, capacity)

    def describe(self) -> dict[str, int | str]:
        return {"policy": self.name, "recent": self.recent}


class SinkPolicy(EvictionPolicy):
    """StreamingLLM: the first ``sink`` tokens (attention sinks) plus a recent window."""

    name = "sink"

    def __init__(self, sink: int, recent: int) -> None:
        self.sink, self.recent = sink, recent

    @property
    def capacity(self) -> int:
        return self.sink + self.recent

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return window_indices(scores.shape[-1], self.sink, self.recent, scores.device)

    def drop_one(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The oldest token past the sink: the one leaving the recent window.
        past_sink = positions.masked_fill(positions < self.sink, torch.iinfo(positions.dtype).max)
        return past_sink.argmin(dim=-1, keepdim=True)

    def fit(self, capacity: int) -> None:
        self.recent = max(1, capacity - self.sink)

    def describe(self) -> dict[str, int | str]:
        return {"policy": self.name, "sink": self.sink, "recent": self.recent}


class H2OPolicy(EvictionPolicy):
    """Heavy-Hitter Oracle: sink + recent window + the ``heavy`` highest-scored of the rest.

    ``norm="sum"`` ranks by accumulated attention, as in the paper. ``norm="mean"`` divides
    it by the number of queries the slot has received (``seen - position``, with ``seen``
    the newest position + 1): raw sums favour old slots, which simply had more queries to
    collect mass from (the tuning study in the README measures both).
    """

    name = "h2o"
    needs_scores = True

    def __init__(self, heavy: int, recent: int, sink: int = 0, norm: str = "sum") -> None:
        self.heavy, self.recent, self.sink = heavy, recent, sink
        self.norm = check_field("cache.score_norm", norm)

    @property
    def capacity(self) -> int:
        return self.sink + self.heavy + self.recent

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = scores.shape[-1]
        if self.norm == "mean":
            seen = positions.amax(dim=-1, keepdim=True) + 1
            scores = scores / (seen - positions).clamp(min=1).to(scores.dtype)
        middle = scores[..., self.sink : n - self.recent]
        if n == self.capacity + 1:
            # One slot over budget, as at every decode step: drop the lowest-ranked middle
            # slot, the newest of equals (what the stable sort below drops), without
            # sorting. The flip makes argmin, which returns the first minimum, find the last.
            drop = self.sink + middle.shape[-1] - 1 - middle.flip(-1).argmin(dim=-1, keepdim=True)
            kept = torch.arange(n - 1, device=scores.device).expand(*scores.shape[:-1], -1)
            return kept + (kept >= drop)
        # A stable sort makes ties (e.g. slots that never received attention) keep the
        # older slot, so the choice is deterministic and matches the reference rule.
        order = torch.sort(middle, dim=-1, descending=True, stable=True).indices
        heavy = order[..., : self.heavy] + self.sink
        window = window_indices(n, self.sink, self.recent, scores.device)
        return torch.cat([window.expand(*scores.shape[:-1], -1), heavy], dim=-1)

    def drop_one(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        newest = positions.amax(dim=-1, keepdim=True)
        if self.norm == "mean":
            scores = scores / (newest + 1 - positions).clamp(min=1).to(scores.dtype)
        middle = (positions >= self.sink) & (positions <= newest - self.recent)
        scores = scores.masked_fill(~middle, float("inf"))
        lowest = scores == scores.amin(dim=-1, keepdim=True)
        # The newest of equally low slots, as ``keep`` drops.
        return positions.masked_fill(~lowest, -1).argmax(dim=-1, keepdim=True)

    def fit(self, capacity: int) -> None:
        # Pins take heavy-hitter slots: the recent window stays whole, so ``drop_one``'s
        # reading of it (never evicted) holds.
        self.heavy = max(0, capacity - self.sink - self.recent)

    def describe(self) -> dict[str, int | str]:
        described = {"policy": self.name, "heavy": self.heavy, "recent": self.recent, "sink": self.sink}
        return described | ({"score_norm": self.norm} if self.norm != "sum" else {})


def make_policy(name: str, *, heavy: int = 0, recent: int = 0, sink: int = 0,
                score_norm: str = "sum") -> EvictionPolicy:
    """Build a policy by name; budgets (and the h2o score normalisation) that a policy
    does not use are ignored."""
    name = check_field("cache.policy", name)
    heavy, recent, sink = (check_field(f"cache.{k}", v) for k, v in (("heavy", heavy), ("recent", recent), ("sink", sink)))
    check_cache_budgets(name, heavy, recent)
    if name == "full":
        return FullPolicy()
    if name == "h2o":
        return H2OPolicy(heavy=heavy, recent=recent, sink=sink, norm=score_norm)
    if name == "recent":
        return RecentPolicy(recent=recent)
    return SinkPolicy(sink=sink, recent=recent)
