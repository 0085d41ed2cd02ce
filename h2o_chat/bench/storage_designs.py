"""Comparison 8b: designs for 4-bit slots, measured before one is built.

Comparison 8 found 4-bit keys stored per token lose 5.7% on their own (the full cache at
K4/V4), so at a byte budget K8/V4 beats them although K4/V4 holds a third more tokens.
This study measures what each known way out buys, on the full cache (quantization
alone, no eviction) and the passages of comparison 8, before the engine takes one on.

Each design is simulated exactly: a transformers cache keeps every key and value as the
model gave it and replaces each one, at the moment the design would store it, by what
the design reads back (the engine's own codec rounds it: ``GroupQuantCodec``), so
attention sees exactly the values the design would give it. The first row is today's
storage; a test checks that its logits equal the engine's own K4/V4 cache.

Designs (keys; values 4-bit per token in groups of 32 unless stated):
- per token: groups of ``key_group`` neighbouring channels of one token (today's, 32);
- rotated: the same after a Hadamard rotation of the head dimension, which spreads the
  few outlier channels over all of them (QuaRot's remedy);
- per channel: one scale and minimum per channel over a block of 32 tokens, rounded once
  the block is complete (KIVI's keys); the newest block stays exact until then;
- a window: the newest ``window`` tokens' keys and values kept exact (KIVI's residual),
  rounded when they leave it;
- 2 and 3 bits (KIVI's own widths): per-channel keys and per-token values at fewer bits,
  rounded by the same per-group rule (``RoundingCodec``), bytes counted as packed.

Bytes: what a slot's key and value take (codes and scales), and what the exact window
and the per-channel design's open block take on top, per layer and KV head; "slots at 5%"
is what 5% of the plain full cache's bytes for the passage buys after those, with the
engine's 14 bytes of bookkeeping a slot.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from h2o_chat.engine.budget import cache_geometry
from h2o_chat.engine.quant import GroupQuantCodec, KVStorage
from h2o_chat.engine.slots import SLOT_METADATA

from . import data
from .equal_bytes import plain_token_bytes
from .report import designs_against_full, md_table, perplexity_bars
from .streaming import full_records, passage_records, reference_logprobs, stream_pass

BLOCK = 32  # tokens per block of the per-channel design
STUDY_SHARE = 0.05  # the share of bytes whose slots the table gives
PASSAGE_TOKENS = 1536 + 200  # comparison 8's passages: streamed, then 200 tokens continued


class RoundingCodec(GroupQuantCodec):
    """The engine's per-token group rounding at any width from 2 to 8 bits, for round
    trips only: codes stay one to a byte (never stored), bytes are counted as packed."""

    def __init__(self, bits: int, group: int = 32) -> None:
        self.bits, self.group, self.levels = bits, group, 2**bits - 1


@dataclass(frozen=True)
class Design:
    """How a design stores keys and values (per token) and how many newest tokens it
    keeps as given."""

    label: str
    keys: str = "token"  # "token", "rotated" or "channel"
    key_bits: int = 4
    key_group: int = 32
    window: int = 1  # newest tokens kept exact: 1 is the pass's own token, as the engine does
    value_bits: int = 4

    def codecs(self) -> tuple[GroupQuantCodec, GroupQuantCodec]:
        """The codecs that round its keys and its values. Per channel, the key codec's
        groups are a block's tokens (one channel of ``BLOCK`` tokens)."""
        return (RoundingCodec(self.key_bits, BLOCK if self.keys == "channel" else self.key_group),
                RoundingCodec(self.value_bits))

    def slot_bytes(self, head_dim: int) -> int:
        """A slot's key and value: codes, scales and minimums, as the codecs lay them out.
        Per channel, a block's scales are shared by its ``BLOCK`` tokens: per token as many
        bytes as groups of ``BLOCK`` channels take, which is the layout counted."""
        keys, values = self.codecs()
        return sum(dtype.itemsize * last for codec, name in ((keys, "keys"), (values, "values"))
                   for dtype, last in codec.layout(name, head_dim, torch.float32).values())

    def exact_tokens(self) -> int:
        """Tokens held exact besides the slots, at most: the window or the open block, but
        the pass's own token (attended as given, never stored so)."""
        return (BLOCK if self.keys == "channel" else self.window) - 1


DESIGNS = (
    Design("K8/V4 per token (today's K8/V4)", key_bits=8),
    Design("K4/V4 per token (today's K4/V4)"),
    Design("K4 rotated", keys="rotated"),
    Design("K4 groups of 16", key_group=16),
    Design("K4/V4, newest 8 exact", window=8),
    Design("K4/V4, newest 16 exact", window=16),
    Design("K4/V4, newest 32 exact", window=32),
    Design("K4 per channel, blocks of 32", keys="channel"),
    Design("K4 per channel / V2 per token", keys="channel", value_bits=2),
    Design("K3 per channel / V3 per token", keys="channel", key_bits=3, value_bits=3),
    Design("K2 per channel / V4 per token", keys="channel", key_bits=2),
    Design("K2 per channel / V2 per token (KIVI-2)", keys="channel", key_bits=2, value_bits=2),
)


@functools.cache
def hadamard(dim: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Hadamard matrix of size ``dim`` (a power of two), symmetric: it is
    its own inverse. Made once per size and device (every layer rounds at every token)."""
    if dim & (dim - 1):
        raise ValueError(f"a rotated design needs a power-of-two head dimension, not {dim}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(dim)


def round_trip(codec: GroupQuantCodec, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``codec`` stores and reads it back."""
    return codec.decode(*codec.encode(x), x.dtype)


class DesignLayer(DynamicLayer):
    """A layer that holds every token as given and then as ``design`` would read it."""

    def __init__(self, design: Design) -> None:
        super().__init__()
        self.design = design
        self.rounded = 0  # tokens 0 .. rounded - 1 hold their rounded values
        self.key_codec, self.value_codec = design.codecs()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        design, seen = self.design, keys.shape[-2]
        # The pass's own tokens are attended as given (as in the engine); older ones as stored.
        upto = max(self.rounded, seen - max(design.window, key_states.shape[-2]))
        if design.keys == "channel":
            upto = self.rounded + (upto - self.rounded) // BLOCK * BLOCK  # whole blocks only
        if upto > self.rounded:
            span = slice(self.rounded, upto)
            keys[..., span, :] = self._round_keys(keys[..., span, :])
            values[..., span, :] = round_trip(self.value_codec, values[..., span, :])
            self.rounded = upto
        return keys, values

    def _round_keys(self, keys: torch.Tensor) -> torch.Tensor:
        if self.design.keys == "channel":  # channels become the groups, over each block's tokens
            blocks = keys.unflatten(-2, (-1, BLOCK)).transpose(-1, -2)
            return round_trip(self.key_codec, blocks).transpose(-1, -2).flatten(-3, -2)
        if self.design.keys == "rotated":
            rotation = hadamard(keys.shape[-1], keys.device).to(keys.dtype)
            return round_trip(self.key_codec, keys @ rotation) @ rotation
        return round_trip(self.key_codec, keys)


def design_cache(model: torch.nn.Module, design: Design) -> Cache:
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[DesignLayer(design) for _ in range(layers)])


def slots_at(model: torch.nn.Module, design: Design, share: float, tokens: int) -> int:
    """Slots ``share`` of the plain full cache's bytes for ``tokens`` tokens buys, after
    the design's exact tokens (keys and values at the model's dtype), per layer and KV head."""
    slots_a_token, head_dim = cache_geometry(model)
    share_bytes = int(share * tokens * plain_token_bytes(model)) // slots_a_token
    exact = design.exact_tokens() * KVStorage().slot_bytes(head_dim, model.dtype)
    metadata = sum(dtype.itemsize for dtype in SLOT_METADATA.values())
    return max(0, share_bytes - exact) // (design.slot_bytes(head_dim) + metadata)


def run(model, tokenizer, passages_per_source: int, stream_len: int = 1536, prefill: int = 16,
        designs: tuple[Design, ...] = DESIGNS, log=print) -> dict:
    if not prefill < stream_len <= PASSAGE_TOKENS:
        raise ValueError(f"--design-len {stream_len}: must be from {prefill + 1} to {PASSAGE_TOKENS}")
    passages = data.passages(tokenizer, passages_per_source, PASSAGE_TOKENS)
    ids = torch.tensor([p.ids[:stream_len] for p in passages])
    log(f"  reference: full cache over {ids.shape[0]} passages x {stream_len} tokens")
    ref = reference_logprobs(model, ids)
    records = full_records(ids, ref, passages, phase="streaming", stream_len=stream_len)
    head_dim = cache_geometry(model)[1]
    for design in designs:
        nll, agree, kl = stream_pass(model, design_cache(model, design), ids, ref, prefill)
        found = passage_records(design.label, "design", "full", None, passages, nll, agree, kl, "streaming")
        for r in found:
            r |= {"slot_bytes": design.slot_bytes(head_dim), "exact_tokens": design.exact_tokens(),
                  "slots_at_share": slots_at(model, design, STUDY_SHARE, stream_len)}
        records += found
        log(f"  {design.label}: ppl {found[-1]['ppl']:.3f}")
    return {"records": records, "config": {"passages": [{"source": p.source, "title": p.title}
                                                                for p in passages],
                                                   "stream_len": stream_len, "share": STUDY_SHARE}}


def markdown(result: dict) -> str:
    rows = [[r["policy"], r["slot_bytes"], r["exact_tokens"], r["slots_at_share"], *(f"{x:.4f}×" for x in ratios),
             f"{r['top1']:.1%}", f"{r['kl']:.4f}"] for r, ratios in designs_against_full(result["records"])]
    share = f"{result['config']['share']:.0%}"
    return md_table(["design", "bytes a slot (K+V)", "exact tokens besides", f"slots at {share}",
                     "ppl vs full: wikitext2", "book", "all", "top-1 agree", "KL(full‖design)"], rows)


def plot(result: dict, path) -> None:
    perplexity_bars(result["records"], path, "perplexity / full cache (quantization alone)", xmin=0.99)
