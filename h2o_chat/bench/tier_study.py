"""Comparison 8d: evicted tokens kept at fewer bits (MiKV's tier), measured before one is built.

At 5% of the bytes the exact-window cache (K4/V4, the newest 16 tokens at 16 bits, 8c)
loses 4% of perplexity, nearly all of it to the tokens H2O evicts. MiKV (arXiv
2402.18096) keeps evicted tokens at low precision instead of dropping them. This study
asks whether that pays within the same bytes: fewer 4-bit slots ("hi"), and the tokens
they let go kept in a second tier ("lo") at 2 or 3 bits until that tier is full too.

Each design is simulated over every token kept as the model gave it: a layer attends what
the design would read (the newest ``WINDOW`` tokens at float16, as the engine's exact
window; older hi tokens through the engine's 4-bit codec; lo tokens through a codec of
their width; dropped ones masked out) and accumulates each token's received attention.
Per layer and KV head, the hi slots follow H2O's rule (``SINK`` first tokens, a recent
half, the rest by score): the lowest-scored middle token leaves hi for lo, and lo over
its capacity drops its lowest-scored token. With no lo tier this is the engine's cache
(a test checks that its reads equal the engine's, and that it keeps what the engine keeps).

Bytes per layer and KV head: a share of the plain full cache's bytes for the passage,
less the window's rings, buys hi slots (codes, scales and 14 bytes of bookkeeping) and
then lo slots (codes as if packed, scales, bookkeeping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_chat.engine.attention import hand_over
from h2o_chat.engine.budget import cache_geometry
from h2o_chat.engine.quant import GroupQuantCodec
from h2o_chat.engine.slots import SLOT_METADATA

from . import data
from .equal_bytes import PRECISIONS, SINK, plain_token_bytes
from .report import designs_against_full, md_table, perplexity_bars
from .storage_designs import RoundingCodec, round_trip
from .streaming import full_records, passage_records, reference_logprobs, stream_pass

ENGINE = PRECISIONS["K4/V4 +16 exact"]  # the engine's cache the study starts from
WINDOW = ENGINE.exact_window
STUDY_SHARE = 0.05
STREAM_LEN = 1536
HI = (4, 4)  # the engine's K4/V4


@dataclass(frozen=True)
class Tier:
    """``hi`` slots of ``hi_bits`` (key bits, value bits; None: as many as the bytes buy)
    and the rest of the bytes as lo slots with ``lo`` bits in groups of ``group`` channels
    (None: no tier, evicted tokens are dropped)."""

    label: str
    hi: int | None = None
    lo: tuple[int, int] | None = None
    group: int = 32
    hi_bits: tuple[int, int] = HI

    def codecs(self, bits: tuple[int, int], group: int = 32) -> tuple[GroupQuantCodec, GroupQuantCodec]:
        return RoundingCodec(bits[0], group), RoundingCodec(bits[1], group)

    def slot_bytes(self, bits: tuple[int, int], head_dim: int, group: int = 32) -> int:
        """A slot's key and value codes and scales, plus its bookkeeping."""
        return sum(dtype.itemsize * last for codec, name in zip(self.codecs(bits, group), ("keys", "values"))
                   for dtype, last in codec.layout(name, head_dim, torch.float32).values()) + \
            sum(dtype.itemsize for dtype in SLOT_METADATA.values())

    def capacities(self, model, share: float, tokens: int) -> tuple[int, int]:
        """Hi and lo slots per layer and KV head at ``share`` of the plain full cache's bytes
        for ``tokens`` tokens, after the window's rings."""
        slots_a_token, head_dim = cache_geometry(model)
        left = int(share * tokens * plain_token_bytes(model)) // slots_a_token
        left -= ENGINE.window_bytes(head_dim, model.dtype)
        hi_bytes = self.slot_bytes(self.hi_bits, head_dim)
        hi = left // hi_bytes if self.hi is None else self.hi
        lo = 0 if self.lo is None else (left - hi * hi_bytes) // self.slot_bytes(self.lo, head_dim, self.group)
        return hi, lo


TIERS = (
    Tier("no tier (the engine's K4/V4 + 16 exact)"),
    Tier("uniform K3/V3 + 16 exact, no tier", hi_bits=(3, 3)),
    Tier("uniform K4/V3 + 16 exact, no tier", hi_bits=(4, 3)),
    Tier("uniform K4/V2 + 16 exact, no tier", hi_bits=(4, 2)),
    Tier("hi 250 + lo K2/V2", hi=250, lo=(2, 2)),
    Tier("hi 250 + lo K2/V2, groups of 64", hi=250, lo=(2, 2), group=64),
    Tier("hi 250 + lo K4/V2", hi=250, lo=(4, 2)),
    Tier("hi 250 + lo K4/V3", hi=250, lo=(4, 3)),
    Tier("hi 300 + lo K3/V3", hi=300, lo=(3, 3)),
    Tier("hi 250 + lo K3/V3", hi=250, lo=(3, 3)),
    Tier("hi 187 + lo K3/V3", hi=187, lo=(3, 3)),
)

GONE, LO, HELD = 0, 1, 2


class TierLayer(CacheLayerMixin):
    """One layer of a tier design: every token as given, what the design reads of it, its
    tier and its accumulated score, ``(batch, kv_heads, length, ...)``."""

    def __init__(self, tier: Tier, hi: int, lo: int, length: int, recent_share: float = 0.5) -> None:
        super().__init__()
        self.capacity, self.lo_capacity, self.length = hi, lo, length
        self.recent = math.floor((hi - SINK) * recent_share)  # of the hi slots after the sink
        self.hi_codecs = tier.codecs(tier.hi_bits)
        self.lo_codecs = tier.codecs(tier.lo, tier.group) if tier.lo else None
        self.seen = self.held = self.demoted = self.rounded = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        shape = (batch, heads, self.length)
        self.given = [torch.zeros(*shape, dim), torch.zeros(*shape, dim)]
        self.read = [torch.zeros(*shape, dim), torch.zeros(*shape, dim)]
        self.scores, self.mask = torch.zeros(shape), torch.zeros(shape)
        self.tier = torch.full(shape, GONE, dtype=torch.int8)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seen == 0:
            self.lazy_initialization(key_states, value_states)
        new = slice(self.seen, self.seen + key_states.shape[2])
        for given, read, x in zip(self.given, self.read, (key_states, value_states)):
            given[:, :, new] = read[:, :, new] = x  # the pass attends its own tokens as given
        self.tier[:, :, new] = HELD
        self.seen, self.held = new.stop, self.held + key_states.shape[2]
        # The window holds the newest tokens, this pass's included: older ones are read rounded.
        upto = max(self.rounded, self.seen - WINDOW)
        if upto > self.rounded:
            older = slice(self.rounded, upto)
            held = (self.tier[:, :, older] == HELD).unsqueeze(-1)
            for given, read, codec in zip(self.given, self.read, self.hi_codecs):
                read[:, :, older] = torch.where(held, round_trip(codec, given[:, :, older]), read[:, :, older])
            self.rounded = upto
        hand_over(self)
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, None]:
        hand_over(None)  # served: a later forward without this cache must not find it
        batch, q_heads, n, dim = query.shape
        heads, seen = self.tier.shape[1], self.seen
        grouped = query.reshape(batch, heads, q_heads // heads * n, dim)
        logits = grouped @ self.read[0][:, :, :seen].transpose(-1, -2) * scaling + self.mask[:, :, None, :seen]
        if n > 1:  # the pass's own tokens causally; rows are (query head, token), head-major
            at = torch.arange(seen - n, seen).repeat(q_heads // heads)
            logits = logits.masked_fill(torch.arange(seen)[None, :] > at[:, None], float("-inf"))
        probabilities = torch.softmax(logits, dim=-1)
        output = (probabilities @ self.read[1][:, :, :seen]).reshape(batch, q_heads, n, dim).transpose(1, 2)
        self.scores[:, :, :seen] += probabilities.sum(2)
        self._settle(n)
        return output, None

    def _settle(self, n: int) -> None:
        """After a pass: its tokens go into the float16 ring, and the rule demotes and drops."""
        seen = self.seen
        for given, read in zip(self.given, self.read):
            read[:, :, seen - n : seen] = given[:, :, seen - n : seen].half().float()
        self.apply_rule()

    def apply_rule(self) -> None:
        """Down to capacity by H2O's rule per KV head: the lowest-scored middle token leaves
        hi (for lo, where there is a tier), and lo over its capacity drops its lowest."""
        seen = self.seen
        while self.held > self.capacity:
            token = self._lowest(self.middle())
            self.held -= 1
            if self.lo_capacity:
                self._demote(token)
            else:
                self._drop(token)
        while self.demoted > self.lo_capacity:
            self._drop(self._lowest(self.tier[:, :, :seen] == LO))
            self.demoted -= 1

    def middle(self) -> torch.Tensor:
        """The hi tokens the rule ranks ``(batch, kv_heads, seen)``: held, past the sink and
        before each head's recent window."""
        positions = torch.arange(self.seen)
        return (self.tier[:, :, : self.seen] == HELD) & (positions >= SINK) & (positions < self.seen - self.recent)

    def _lowest(self, among: torch.Tensor) -> torch.Tensor:
        """Per head, the lowest-scored token ``among`` selects, ``(batch, heads, 1)``."""
        return torch.where(among, self.scores[:, :, : among.shape[-1]], float("inf")).argmin(-1, keepdim=True)

    def _demote(self, token: torch.Tensor) -> None:
        self.tier.scatter_(-1, token, LO)
        self.demoted += 1
        index = token.unsqueeze(-1).expand(*token.shape, self.read[0].shape[-1])
        for given, read, codec in zip(self.given, self.read, self.lo_codecs):
            read.scatter_(2, index, round_trip(codec, given.gather(2, index)))

    def _drop(self, token: torch.Tensor) -> None:
        self.tier.scatter_(-1, token, GONE)
        self.mask.scatter_(-1, token, float("-inf"))

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1


def tier_cache(model, tier: Tier, share: float, length: int, tokens: int = STREAM_LEN) -> Cache:
    hi, lo = tier.capacities(model, share, tokens)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[TierLayer(tier, hi, lo, length) for _ in range(layers)])


def run(model, tokenizer, passages_per_source: int, share: float = STUDY_SHARE, tiers: tuple[Tier, ...] = TIERS,
        log=print) -> dict:
    """Every tier design streamed over comparison 8's passages (``STREAM_LEN`` tokens)."""
    passages = data.passages(tokenizer, passages_per_source, STREAM_LEN + 200)
    ids = torch.tensor([p.ids[:STREAM_LEN] for p in passages])
    log(f"  reference: full cache over {ids.shape[0]} passages x {STREAM_LEN} tokens")
    ref = reference_logprobs(model, ids)
    records = full_records(ids, ref, passages, phase="streaming", stream_len=STREAM_LEN)
    for tier in tiers:
        hi, lo = tier.capacities(model, share, STREAM_LEN)
        nll, agree, kl = stream_pass(model, tier_cache(model, tier, share, STREAM_LEN), ids, ref, 16)
        found = passage_records(tier.label, "tier", f"{share:.0%}", hi, passages, nll, agree, kl, "streaming")
        records += [r | {"hi": hi, "lo": lo} for r in found]
        log(f"  {tier.label}: hi {hi}, lo {lo}: ppl {found[-1]['ppl']:.3f}")
    return {"records": records, "config": {"passages": [{"source": p.source, "title": p.title} for p in passages],
                                           "stream_len": STREAM_LEN, "share": share, "window": WINDOW}}


def markdown(result: dict) -> str:
    rows = [[r["policy"], r["hi"], r["lo"], *(f"{x:.3f}×" for x in ratios), f"{r['top1']:.1%}", f"{r['kl']:.4f}"]
            for r, ratios in designs_against_full(result["records"])]
    share = f"{result['config']['share']:.0%}"
    return md_table(["design", f"hi slots at {share}", "lo slots", "ppl vs full: wikitext2", "book", "all",
                     "top-1 agree", "KL(full‖design)"], rows)


def plot(result: dict, path) -> None:
    perplexity_bars(result["records"], path, f"perplexity / full cache at {result['config']['share']:.0%} of the bytes")
