"""Which slots a bounded cache drops: the rule every policy shares, written once.

Per KV head, a slot is pinned, in a window (the first ``sink`` or last ``recent``
unpinned tokens, given as the positions ``[start, end)`` between them), or in the
middle. Pinned and window slots stay; the middle is ranked by a key (higher stays) and
the best ranked stay up to the capacity, the older of equal keys first. The functions
take any leading dimensions (rows, layers, KV heads) with slots last, and per-row
inputs as tensors that broadcast over them, so one call serves one cache or every row
of a decode step.
"""

from __future__ import annotations

import torch

# How a policy ranks its middle slots (``EvictionPolicy.ranking``).
RANK_SCORE = 0  # accumulated attention
RANK_MEAN = 1  # accumulated attention per query received (final where a turn closed)
RANK_RECENCY = 2  # newer first


def ranking_key(ranking: int | torch.Tensor, scores: torch.Tensor, positions: torch.Tensor,
                seen: int | torch.Tensor, rankings: frozenset[int] | None = None,
                opened: int | torch.Tensor = 0) -> torch.Tensor:
    """Each slot's key (float32, higher stays). ``ranking`` is one of the ``RANK_*``
    for every row, or a tensor of them per row; ``seen`` the tokens seen (the newest
    position + 1), likewise. ``rankings``: which kinds the tensor holds, where known
    (kinds absent are not computed). ``opened``: the first position of the open turn
    (``turns.TurnMarks``); slots before it hold a final score, which a turn-aware cache
    turned into a mean when their turn closed."""
    kinds = {ranking} if isinstance(ranking, int) else (rankings or {RANK_SCORE, RANK_MEAN, RANK_RECENCY})
    keys = {}
    if RANK_SCORE in kinds:
        keys[RANK_SCORE] = scores
    if RANK_MEAN in kinds or RANK_RECENCY in kinds:
        # Exact in float32 for any age below 2**24 tokens.
        age = (seen - positions).to(torch.float32)
        if RANK_MEAN in kinds:
            mean = scores / age.clamp(min=1)
            if not (isinstance(opened, int) and opened == 0):
                mean = torch.where(positions >= opened, mean, scores)
            keys[RANK_MEAN] = mean
        if RANK_RECENCY in kinds:
            keys[RANK_RECENCY] = -age
    if len(keys) == 1:
        return next(iter(keys.values()))
    key = keys.get(RANK_SCORE, 0.0)
    for kind in (RANK_MEAN, RANK_RECENCY):
        if kind in keys:
            key = torch.where(ranking == kind, keys[kind], key)
    return key


def middle_slots(positions: torch.Tensor, pinned: torch.Tensor, start: int | torch.Tensor,
                 end: int | torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """The slots the policy ranks: unpinned, between the windows, and ``live`` (slots in
    use, where the buffers hold more; None: all are)."""
    middle = ~pinned & (positions >= start) & (positions < end)
    return middle if live is None else middle & live


def lowest_slot(key: torch.Tensor, positions: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
    """``(..., 1)``: the middle slot that goes when one must, the lowest ranked and of equals
    the newest (which ``kept_slots`` drops first). Costs no sort."""
    key = key.masked_fill(~middle, float("inf"))
    lowest = key == key.amin(dim=-1, keepdim=True)
    return positions.masked_fill(~lowest, -1).argmax(dim=-1, keepdim=True)


def kept_slots(key: torch.Tensor, positions: torch.Tensor, pinned: torch.Tensor, middle: torch.Tensor,
               capacity: int) -> torch.Tensor:
    """Which slots stay (bool, like ``positions``) when any number are over: pinned and
    window ones, and of the middle the best ranked up to ``capacity`` unpinned slots per
    head, the older of equals first."""
    window = ~pinned & ~middle
    quota = capacity - window.sum(dim=-1, keepdim=True)
    # Oldest first, then a stable sort by key: equal keys keep their temporal order.
    by_age = positions.argsort(dim=-1)
    ranked = key.masked_fill(~middle, float("-inf")).gather(-1, by_age)
    order = by_age.gather(-1, ranked.sort(dim=-1, descending=True, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order))
    return pinned | window | (middle & (rank < quota))
