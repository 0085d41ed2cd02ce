"""Comparison 8e: where a byte budget's slots go, per layer and per KV head, measured
before the engine takes any of it on.

The engine gives every layer and KV head the same slots, so one shape per layer serves a
batched step. PyramidKV (arXiv 2406.02069) gives lower layers more, SqueezeAttention and
others size each layer by how spread its attention is, Ada-KV (arXiv 2407.11550) lets a
layer's heads share one budget (the lowest-scored token of any head goes). This study
asks whether any of that buys quality at 5% of the bytes, where the exact-window cache
(K4/V4, the newest 16 tokens at 16 bits) loses 4%: the same slots in all, distributed
otherwise.

It runs on the tier study's simulation of the engine (``tier_study.TierLayer``: every
token kept as given, attention over what the cache would read, H2O's rule per layer and
KV head), which with the uniform shape keeps what the engine keeps (its tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from h2o_chat.engine.attention import ATTENTION_NAME

from . import data
from .report import designs_against_full, md_table, perplexity_bars
from .streaming import full_records, passage_records, reference_logprobs, stream_pass
from .tier_study import GONE, HELD, STREAM_LEN, STUDY_SHARE, TIERS, TierLayer

ENGINE_TIER = TIERS[0]  # no tier: the engine's K4/V4 + 16 exact
# Of a query's attention, how far from its position the queries that size layers by their
# attention start: past the first passes' near-complete view of a short history.
MASS_FROM = 512
# The fewest slots a layer keeps when sized by attention: its sink, the exact window and
# some recent tokens.
MASS_FLOOR = 40


@dataclass(frozen=True)
class Shape:
    """How one byte budget's slots spread: per layer linearly from ``first`` to ``last``
    times the mean (1, 1: the engine's uniform shape), or by where the layers' attention
    mass lies (``by_attention``); ``recent_share`` of each layer's slots after the sink
    go to its recent window; ``shared_heads``: a layer's KV heads share its slots."""

    label: str
    first: float = 1.0
    last: float = 1.0
    by_attention: bool = False
    recent_share: float = 0.5
    shared_heads: bool = False


SHAPES = (
    Shape("uniform (the engine)"),
    Shape("uniform, recent quarter", recent_share=0.25),
    Shape("lower layers more, 1.5 to 0.5 (PyramidKV)", 1.5, 0.5),
    Shape("deeper layers more, 0.75 to 1.25", 0.75, 1.25),
    Shape("deeper layers more, 0.5 to 1.5", 0.5, 1.5),
    Shape("deeper layers more, 0.25 to 1.75", 0.25, 1.75),
    Shape("by attention mass (tune passages)", by_attention=True),
    Shape("a layer's heads share its slots (Ada-KV)", shared_heads=True),
)


def attention_mass(model, ids: torch.Tensor, since: int = MASS_FROM) -> torch.Tensor:
    """Per layer ``(layers, length)``: the mean k-th largest attention a token receives from
    one query, summed over each KV head's queries as H2O's scores are, over the queries
    from position ``since`` of the passages ``ids`` ``(passages, length)``."""
    config = model.config.get_text_config(decoder=True)
    kv_heads = config.num_key_value_heads
    curves = torch.zeros(config.num_hidden_layers, ids.shape[1])
    model.set_attn_implementation("eager")  # the engine's attention returns no probabilities
    try:
        with torch.inference_mode():
            for passage in ids.to(model.device):
                attentions = model(input_ids=passage[None], output_attentions=True, use_cache=False).attentions
                for layer, probabilities in enumerate(attentions):
                    per_head = probabilities[0, :, since:].float().unflatten(0, (kv_heads, -1)).sum(1)
                    curves[layer] += per_head.sort(-1, descending=True).values.mean((0, 1)).cpu() / ids.shape[0]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return curves


def layer_slots(shape: Shape, slots: int, layers: int, mass: torch.Tensor | None = None) -> list[int]:
    """Each layer's slots under ``shape``, ``slots`` per layer on average (the same bytes)."""
    total = slots * layers
    if shape.by_attention:
        # Greedy on concave curves: the ``total`` largest marginal masses of all layers.
        marginal = mass.clone()
        marginal[:, :MASS_FLOOR] = float("inf")
        taken = marginal.flatten().topk(total).indices // marginal.shape[1]
        return torch.bincount(taken, minlength=layers).tolist()
    weights = torch.linspace(shape.first, shape.last, layers, dtype=torch.float64)
    each = (weights / weights.mean() * slots).floor().long()
    each[: total - int(each.sum())] += 1
    return each.tolist()


class SharedHeadsLayer(TierLayer):
    """A layer whose KV heads share ``capacity`` x heads slots: over budget, the lowest-
    scored middle token of any head goes (each head keeps its sink and recent window)."""

    def apply_rule(self) -> None:
        seen = self.seen
        held = (self.tier[:, :, :seen] == HELD).sum((1, 2))
        budget = self.capacity * self.tier.shape[1]
        rows = torch.arange(self.tier.shape[0])
        while bool((held > budget).any()):
            lowest = torch.where(self.middle(), self.scores[:, :, :seen], float("inf")).flatten(1).argmin(-1)
            over = held > budget
            head, token = lowest[over] // seen, lowest[over] % seen
            self.tier[rows[over], head, token] = GONE
            self.mask[rows[over], head, token] = float("-inf")
            held -= over.long()


def shape_cache(shape: Shape, each: list[int]) -> Cache:
    """The simulated cache of ``shape`` with ``each`` layer's slots."""
    kind = SharedHeadsLayer if shape.shared_heads else TierLayer
    return Cache(layers=[kind(ENGINE_TIER, slots, 0, STREAM_LEN, shape.recent_share) for slots in each])


def run(model, tokenizer, passages_per_source: int, share: float = STUDY_SHARE, shapes: tuple[Shape, ...] = SHAPES,
        log=print) -> dict:
    """Every shape streamed over comparison 8's passages at ``share`` of the bytes."""
    passages = data.passages(tokenizer, passages_per_source, STREAM_LEN + 200)
    ids = torch.tensor([p.ids[:STREAM_LEN] for p in passages])
    ref = reference_logprobs(model, ids)
    records = full_records(ids, ref, passages, phase="streaming", stream_len=STREAM_LEN)
    slots, _ = ENGINE_TIER.capacities(model, share, STREAM_LEN)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    mass = None
    if any(shape.by_attention for shape in shapes):  # sized on tune passages, never the measured ones
        tune = data.passages(tokenizer, passages_per_source, STREAM_LEN, split="tune")
        mass = attention_mass(model, torch.tensor([p.ids[:STREAM_LEN] for p in tune]))
    for shape in shapes:
        each = layer_slots(shape, slots, layers, mass)
        nll, agree, kl = stream_pass(model, shape_cache(shape, each), ids, ref, 16)
        found = passage_records(shape.label, "shape", f"{share:.0%}", slots, passages, nll, agree, kl, "streaming")
        records += [r | {"layer_slots": each} for r in found]
        log(f"  {shape.label}: slots per layer {min(each)}..{max(each)}: ppl {found[-1]['ppl']:.3f}")
    return {"records": records, "config": {"passages": [{"source": p.source, "title": p.title} for p in passages],
                                           "stream_len": STREAM_LEN, "share": share, "slots": slots}}


def markdown(result: dict) -> str:
    rows = []
    for r, ratios in designs_against_full(result["records"]):
        each = r["layer_slots"]
        rows.append([r["policy"], f"{each[0]} / {min(each)}..{max(each)} / {each[-1]}",
                     *(f"{x:.3f}×" for x in ratios), f"{r['top1']:.1%}", f"{r['kl']:.4f}"])
    share = f"{result['config']['share']:.0%}"
    return md_table(["shape", f"slots at {share}: first layer / range / last layer", "ppl vs full: wikitext2",
                     "book", "all", "top-1 agree", "KL(full‖shape)"], rows)


def plot(result: dict, path) -> None:
    perplexity_bars(result["records"], path, f"perplexity / full cache at {result['config']['share']:.0%} of the bytes")
