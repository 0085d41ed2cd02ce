"""Eviction policies: how many slots a layer keeps, and how it ranks them.

Every policy here keeps, per KV head, its pinned slots, the first ``sink`` and the last
``recent`` unpinned tokens (its windows, ``spans.ProtectedSpans.windows``) and the best
ranked of the rest (the middle) up to ``capacity``. What tells policies apart is their
budgets and their ``ranking`` of the middle: accumulated attention (h2o), attention per
query received (h2o, ``score_norm="mean"``) or recency (the window policies, which keep
no middle at all in normal use). Which slots go follows from that in one place for
every policy (``selection.py``), so the decode step runs rows of any policies as one.
Adding a policy never touches the cache code.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from h2o_chat.config import check_cache_budgets, check_field

from .selection import RANK_MEAN, RANK_RECENCY, RANK_SCORE


class RowRule(NamedTuple):
    """A batch row's windows and ranking."""

    sink: int
    recent: int
    ranking: int  # RANK_SCORE, RANK_MEAN or RANK_RECENCY


class EvictionPolicy:
    """Interface: ``capacity`` unpinned slots are kept at rest, chosen by ``row_rules``."""

    name: ClassVar[str]
    # Policies that rank slots by attention mass make the attention function compute
    # explicit softmax probabilities; the others can use the fused sdpa kernel.
    needs_scores: ClassVar[bool] = False
    # Whether the cache keeps each slot's score to its own turn (``turns.TurnMarks``).
    marks_turns: ClassVar[bool] = False
    ranking: ClassVar[int] = RANK_RECENCY
    sink = 0
    recent = 0

    @property
    def capacity(self) -> int | None:
        """Unpinned slots kept per KV head at rest; ``None`` means unbounded."""
        raise NotImplementedError

    @property
    def sums_scores(self) -> bool:
        """Whether a slot's score is simply the mass it received, added up: the one rule
        the batched decode step applies to every row at once."""
        return type(self).accumulate is EvictionPolicy.accumulate

    def accumulate(self, scores, received) -> None:
        """Fold the attention mass each slot just received into its score, in place; both
        ``(batch, kv_heads, held)`` float32, slots in the cache's memory order. Called
        after every attention call that computed probabilities."""
        scores.add_(received)

    def row_rules(self, rows: int) -> list[RowRule]:
        """The windows and ranking of each of ``rows`` batch rows (the same for all, but in
        policies that mix rules in one batch, the benchmarks')."""
        return [RowRule(self.sink, self.recent, self.ranking)] * rows

    def fit(self, capacity: int) -> None:
        """Keep ``capacity`` unpinned slots at rest from now on (a byte budget's slots
        less the pinned ones), by resizing the share that pins may take."""
        raise ValueError(f"the {self.name} policy has no budget to fit")

    def describe(self) -> dict[str, int | str]:
        return {"policy": self.name}


class FullPolicy(EvictionPolicy):
    name = "full"

    @property
    def capacity(self) -> int | None:
        return None


class RecentPolicy(EvictionPolicy):
    """A sliding window over the newest tokens."""

    name = "recent"

    def __init__(self, recent: int) -> None:
        self.recent = recent

    @property
    def capacity(self) -> int:
        return self.recent

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

    def fit(self, capacity: int) -> None:
        self.recent = max(1, capacity - self.sink)

    def describe(self) -> dict[str, int | str]:
        return {"policy": self.name, "sink": self.sink, "recent": self.recent}


class H2OPolicy(EvictionPolicy):
    """Heavy-Hitter Oracle: sink + recent window + the ``heavy`` highest-scored of the rest.

    ``norm="sum"`` ranks by accumulated attention, as in the paper. ``norm="mean"`` divides
    it by the number of queries the slot has received (``seen - position``): raw sums
    favour old slots, which simply had more queries to collect mass from (the tuning
    study in the benchmarks measures both).
    """

    name = "h2o"
    needs_scores = True

    def __init__(self, heavy: int, recent: int, sink: int = 0, norm: str = "sum") -> None:
        self.heavy, self.recent, self.sink = heavy, recent, sink
        self.norm = check_field("cache.score_norm", norm)
        self.ranking = RANK_MEAN if norm == "mean" else RANK_SCORE

    @property
    def capacity(self) -> int:
        return self.sink + self.heavy + self.recent

    def fit(self, capacity: int) -> None:
        # Pins take heavy-hitter slots: the windows stay whole.
        self.heavy = max(0, capacity - self.sink - self.recent)

    def describe(self) -> dict[str, int | str]:
        described = {"policy": self.name, "heavy": self.heavy, "recent": self.recent, "sink": self.sink}
        return described | ({"score_norm": self.norm} if self.norm != "sum" else {})


class TurnsPolicy(H2OPolicy):
    """H2O whose scores stay with their turn: a slot is scored by the queries of its own
    turn only, so later turns cannot wear down what an early turn kept (``turns.py``).
    ``norm="mean"`` closes each turn's scores as the mass per query each slot received in
    its turn, so a long turn's slots do not outrank a short one's for its length alone.
    Where nothing marks turns (a story), it is h2o."""

    name = "turns"
    marks_turns = True


def make_policy(name: str, *, heavy: int = 0, recent: int = 0, sink: int = 0,
                score_norm: str = "sum") -> EvictionPolicy:
    """Build a policy by name; budgets (and the h2o score normalisation) that a policy
    does not use are ignored."""
    name = check_field("cache.policy", name)
    heavy, recent, sink = (check_field(f"cache.{k}", v) for k, v in (("heavy", heavy), ("recent", recent), ("sink", sink)))
    check_cache_budgets(name, heavy, recent)
    if name == "full":
        return FullPolicy()
    if name in ("h2o", "turns"):
        return (H2OPolicy if name == "h2o" else TurnsPolicy)(heavy=heavy, recent=recent, sink=sink, norm=score_norm)
    if name == "recent":
        return RecentPolicy(recent=recent)
    return SinkPolicy(sink=sink, recent=recent)
