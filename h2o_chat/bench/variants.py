"""Policy variants for the tuning study, and several policies side by side in one batch.

``Variant`` describes one eviction rule: the stock ones (h2o = the paper's rule, recent,
sink) and H2O with a score normalisation:

- ``norm="sum"``: raw accumulated attention (the paper's rule, ``H2OPolicy``'s default),
- ``norm="mean"``: accumulated attention divided by the number of queries the slot has
  received (``H2OPolicy(norm="mean")``, also ``cache.score_norm: mean`` in the config),
- ``decay=g < 1``: exponentially decayed sum, ``score <- g * score + received`` at every
  attention call (``DecayedH2OPolicy``, through the policies' ``accumulate`` hook).

``MixedPolicy`` gives row block k of the batch to variant k. The cache evicts every batch
row and head independently, so one batch of ``len(variants) * n`` rows is exactly ``n``
passages run under each variant alone (tested), at a fraction of the cost on a CPU.
All variants of a ``MixedPolicy`` must have the same capacity (slot budget).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cached_property

import torch

from h2o_chat.config import POLICIES, check_field
from h2o_chat.engine.build import cache_for_policy
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import EvictionPolicy, H2OPolicy, RowRule, make_policy
from h2o_chat.engine.quant import KVStorage

EVICTING = tuple(name for name in POLICIES if name != "full")  # the kinds a variant may be


class DecayedH2OPolicy(H2OPolicy):
    """H2O ranking by an exponentially decayed sum of the attention received: at every
    attention call, ``score <- decay * score + received``."""

    def __init__(self, heavy: int, recent: int, sink: int = 0, norm: str = "sum", decay: float = 1.0) -> None:
        super().__init__(heavy=heavy, recent=recent, sink=sink, norm=norm)
        self.decay = decay

    def accumulate(self, scores: torch.Tensor, received: torch.Tensor) -> None:
        scores.mul_(self.decay).add_(received)

    def describe(self) -> dict[str, int | str]:
        return super().describe() | {"decay": self.decay}


@dataclass(frozen=True)
class Variant:
    label: str
    kind: str  # one of EVICTING
    heavy: int = 0
    recent: int = 0
    sink: int = 0
    norm: str = "sum"  # sum | mean
    decay: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in EVICTING:
            raise ValueError(f"variant kind {self.kind!r}: must be one of {', '.join(EVICTING)}")
        check_field("cache.score_norm", self.norm)
        if not 0 < self.decay <= 1:
            raise ValueError(f"variant decay {self.decay}: must be in (0, 1]")
        if self.capacity < 1:
            raise ValueError(f"variant {self.label}: budget must be >= 1 slot")

    @property
    def capacity(self) -> int:
        return self.policy.capacity

    def describe(self) -> dict:
        return asdict(self)

    @cached_property
    def policy(self) -> EvictionPolicy:
        """The engine's policy for this rule."""
        if self.kind == "h2o":
            if self.decay < 1:
                return DecayedH2OPolicy(heavy=self.heavy, recent=self.recent, sink=self.sink,
                                        norm=self.norm, decay=self.decay)
            return H2OPolicy(heavy=self.heavy, recent=self.recent, sink=self.sink, norm=self.norm)
        return make_policy(self.kind, recent=self.recent, sink=self.sink)


def h2o_split(label: str, budget: int, heavy_share: float = 0.5, sink: int = 0, **kw) -> Variant:
    """H2O with ``budget`` slots: ``sink`` first, then ``heavy_share`` of the rest heavy."""
    rest = budget - sink
    heavy = int(round(rest * heavy_share))
    return Variant(label, "h2o", heavy=heavy, recent=rest - heavy, sink=sink, **kw)


def standard_variants(budget: int, sink: int = 4) -> list[Variant]:
    """The three stock rules at ``budget`` slots: the paper's H2O (heavy = recent = half,
    no sinks), a recent window and StreamingLLM (``sink`` + recent)."""
    return [
        h2o_split("h2o", budget),
        Variant("recent", "recent", recent=budget),
        Variant("sink", "sink", sink=min(sink, budget - 1), recent=budget - min(sink, budget - 1)),
    ]


class MixedPolicy(EvictionPolicy):
    """Row block k of the batch (``rows`` rows) is scored and evicted by ``variants[k]``."""

    name = "mixed"

    def __init__(self, variants: list[Variant], rows: int = 1) -> None:
        if not variants:
            raise ValueError("MixedPolicy needs at least one variant")
        caps = {v.capacity for v in variants}
        if len(caps) != 1:
            raise ValueError(f"variants in one batch must share a capacity; got {sorted(caps)}")
        self.variants, self.rows = list(variants), rows
        self._capacity = caps.pop()
        # Windows ignore scores: only a variant that ranks by them needs probabilities.
        self.needs_scores = any(v.policy.needs_scores for v in variants)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def batch(self) -> int:
        return len(self.variants) * self.rows

    def _blocks(self) -> Iterator[tuple[slice, Variant]]:
        for k, variant in enumerate(self.variants):
            yield slice(k * self.rows, (k + 1) * self.rows), variant

    def accumulate(self, scores: torch.Tensor, received: torch.Tensor) -> None:
        for rows, variant in self._blocks():
            variant.policy.accumulate(scores[rows], received[rows])

    def row_rules(self, rows: int) -> list[RowRule]:
        if rows != self.batch:
            raise ValueError(f"batch of {rows} rows; this MixedPolicy expects {self.batch}")
        return [rule for variant in self.variants for rule in variant.policy.row_rules(self.rows)]

    def describe(self) -> dict:
        return {"policy": self.name, "rows": self.rows, "variants": [v.label for v in self.variants]}


def bench_cache(model, variants: list[Variant], rows: int = 1, rolling: bool = False,
                storage: KVStorage = KVStorage()) -> H2OCache:
    """A cache for ``model`` whose row block k follows ``variants[k]`` (``rows`` rows each);
    ``rolling`` and ``storage`` as in ``make_cache``."""
    return cache_for_policy(model, MixedPolicy(variants, rows), rolling, storage)
