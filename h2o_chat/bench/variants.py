"""Policy variants for the tuning study, and several policies side by side in one batch.

``Variant`` describes one eviction rule: the stock ones (h2o = the paper's rule, recent,
sink) and H2O with a score normalisation:

- ``norm="sum"``: raw accumulated attention (the paper's rule, ``H2OPolicy``'s default),
- ``norm="mean"``: accumulated attention divided by the number of queries the slot has
  received (``H2OPolicy(norm="mean")``, also ``cache.score_norm: mean`` in the config),
- ``decay=g < 1``: exponentially decayed sum, ``score <- g * score + received`` at every
  attention call (the engine has no hook where scores accumulate: ``BenchLayer`` adds one).

``MixedPolicy`` gives row block k of the batch to variant k. The cache evicts every batch
row and head independently, so one batch of ``len(variants) * n`` rows is exactly ``n``
passages run under each variant alone (tested), at a fraction of the cost on a CPU.
All variants of a ``MixedPolicy`` must have the same capacity (slot budget).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

import torch

from h2o_chat.cache import H2OCache, H2OLayer
from h2o_chat.config import check_field
from h2o_chat.policies import EvictionPolicy, H2OPolicy, make_policy
from h2o_chat.rope import RopeShifter


@dataclass(frozen=True)
class Variant:
    label: str
    kind: str  # h2o | recent | sink
    heavy: int = 0
    recent: int = 0
    sink: int = 0
    norm: str = "sum"  # sum | mean
    decay: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("h2o", "recent", "sink"):
            raise ValueError(f"variant kind {self.kind!r}: must be h2o, recent or sink")
        check_field("cache.score_norm", self.norm)
        if not 0 < self.decay <= 1:
            raise ValueError(f"variant decay {self.decay}: must be in (0, 1]")
        if self.capacity < 1:
            raise ValueError(f"variant {self.label}: budget must be >= 1 slot")

    @property
    def capacity(self) -> int:
        if self.kind == "recent":
            return self.recent
        if self.kind == "sink":
            return self.sink + self.recent
        return self.sink + self.heavy + self.recent

    @property
    def uses_scores(self) -> bool:
        return self.kind == "h2o"

    def describe(self) -> dict:
        return asdict(self)

    @cached_property
    def policy(self) -> EvictionPolicy:
        """The engine's policy for this rule (decay aside, which ``BenchLayer`` applies)."""
        if self.kind == "h2o":
            return H2OPolicy(heavy=self.heavy, recent=self.recent, sink=self.sink, norm=self.norm)
        return make_policy(self.kind, recent=self.recent, sink=self.sink)

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The policy's choice, ascending (the engine's ``EvictionPolicy.keep`` contract)."""
        return self.policy.keep(scores, positions).sort(dim=-1).values


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
    """Row block k of the batch (``rows`` rows) is evicted by ``variants[k]``."""

    name = "mixed"
    needs_scores = True  # at least one variant may rank by scores; windows ignore them

    def __init__(self, variants: list[Variant], rows: int = 1) -> None:
        if not variants:
            raise ValueError("MixedPolicy needs at least one variant")
        caps = {v.capacity for v in variants}
        if len(caps) != 1:
            raise ValueError(f"variants in one batch must share a capacity; got {sorted(caps)}")
        self.variants, self.rows = list(variants), rows
        self._capacity = caps.pop()
        self.needs_scores = any(v.uses_scores for v in variants)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def batch(self) -> int:
        return len(self.variants) * self.rows

    def keep(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != self.batch:
            raise ValueError(f"batch of {scores.shape[0]} rows; this MixedPolicy expects {self.batch}")
        if len(self.variants) == 1:
            return self.variants[0].keep(scores, positions)
        parts = []
        for k, variant in enumerate(self.variants):
            rows = slice(k * self.rows, (k + 1) * self.rows)
            index = variant.keep(scores[rows], positions[rows])
            parts.append(index.expand(self.rows, scores.shape[1], -1))
        return torch.cat(parts, dim=0)

    def decay_rows(self, device: torch.device) -> torch.Tensor | None:
        """Per-row score decay ``(batch, 1, 1)``, or None when no variant decays."""
        if all(v.decay == 1.0 for v in self.variants):
            return None
        decay = torch.tensor([v.decay for v in self.variants], dtype=torch.float32, device=device)
        return decay.repeat_interleave(self.rows)[:, None, None]

    def describe(self) -> dict:
        return {"policy": self.name, "rows": self.rows, "variants": [v.label for v in self.variants]}


class BenchLayer(H2OLayer):
    """``H2OLayer`` whose policy may decay old scores: with a ``decay_rows`` policy, the
    accumulated scores are multiplied by the decay before each attention call's mass is
    added. Prototype of an engine hook; everything else is the engine's layer."""

    def after_attention(self, received: torch.Tensor | None) -> None:
        decay_rows = getattr(self.policy, "decay_rows", None)
        if received is not None and decay_rows is not None:
            decay = decay_rows(self.scores.device)
            if decay is not None:
                self.scores.mul_(decay)
        super().after_attention(received)


class BenchCache(H2OCache):
    """``H2OCache`` made of ``BenchLayer``s."""

    def __init__(self, policy: EvictionPolicy, num_layers: int, rope: RopeShifter | None = None) -> None:
        super().__init__(policy, num_layers, rope)
        self.layers = [BenchLayer(policy, self.spans, rope) for _ in range(num_layers)]


def bench_cache(model, variants: list[Variant], rows: int = 1, rolling: bool = False) -> BenchCache:
    """A cache for ``model`` whose row block k follows ``variants[k]`` (``rows`` rows each);
    ``rolling`` as in ``make_cache``."""
    from h2o_chat.attention import ATTENTION_NAME

    config = model.config.get_text_config(decoder=True)
    if config._attn_implementation != ATTENTION_NAME:
        raise ValueError(f"the model must use the {ATTENTION_NAME!r} attention (load it with load_model)")
    rope = RopeShifter.from_model(model) if rolling else None
    return BenchCache(MixedPolicy(variants, rows), config.num_hidden_layers, rope)
