"""Position rolling on a long text: one bounded cache, absolute vs rolled positions.

The book is streamed from its first chapter through a cache of ``budget`` slots, in chunks
of ``chunk`` tokens (each chunk's tokens are scored causally, and the cache holds at most
``budget + chunk`` slots during a forward pass), and every token's negative
log-likelihood is kept; perplexity is then reported per window of ``window`` tokens.

With absolute positions the sink and heavy slots stay at their early positions while the
queries move on, so once the text outgrows the model's trained context
(``max_position_embeddings``) attention spans distances the model never saw. With rolling
every key sits at its rank in the cache and the queries right after, so no query–key
distance exceeds ``budget + chunk``. H2O and the StreamingLLM window (sink + recent) at
the same budget run as the two row blocks of one batch (``MixedPolicy``), once per
position mode. The full cache (absolute positions, growing with the text) is the
reference: the model's own perplexity on the same tokens, past its trained context too.
"""

from __future__ import annotations

import math
import time

import torch
from torch.nn import functional as F

from h2o_chat.engine.build import make_cache

from . import data
from .metrics import perplexity, token_nll
from .variants import Variant, bench_cache, h2o_split


def book_ids(tokenizer, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of the book from its first chapter heading."""
    text = data.read_text(data.BOOK)
    start = data.section_starts(text, data._CHAPTER)[0][0]
    # ~4 characters per token in English prose; 6 leaves a margin before tokenizing.
    ids = tokenizer(text[start : start + 6 * tokens], add_special_tokens=False).input_ids
    if len(ids) < tokens:
        raise ValueError(f"the book has only {len(ids)} tokens from its first chapter; asked for {tokens}")
    return ids[:tokens]


def stream_nll(model, cache, ids: torch.Tensor, chunk: int, progress=None) -> torch.Tensor:
    """Feed ``ids`` (rows, L) through ``cache`` in chunks of ``chunk`` tokens; the nll of
    every predicted token, (rows, L - 1): entry t scores token t + 1."""
    rows, length = ids.shape
    nll = torch.empty(rows, length - 1)
    with torch.inference_mode():
        for start in range(0, length - 1, chunk):
            end = min(start + chunk, length - 1)
            logits = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits
            nll[:, start:end] = token_nll(F.log_softmax(logits.float(), dim=-1), ids[:, start + 1 : end + 1])
            if progress:
                progress(end, length)
    return nll


def windows(nll: torch.Tensor, window: int) -> list[dict]:
    """Perplexity per window of ``window`` tokens of the text (by the predicted token's
    index; the first window has one token fewer, token 0 being unpredicted)."""
    length = nll.shape[-1] + 1
    out = []
    for start in range(0, length, window):
        end = min(start + window, length)
        part = nll[..., max(start - 1, 0) : end - 1]
        out.append({"start": start, "end": end, "tokens": int(part.shape[-1]), "ppl": perplexity(part)})
    return out


def variants(budget: int, sink: int = 4) -> list[Variant]:
    """H2O with ``sink`` sinks and heavy ≈ recent, and StreamingLLM, at ``budget`` slots."""
    return [h2o_split("h2o", budget, 0.5, sink=sink), Variant("sink", "sink", sink=sink, recent=budget - sink)]


def run(model, tokenizer, tokens: int, *, budget: int = 512, sink: int = 4, chunk: int = 32,
        window: int = 1024, full: bool = True, ids: list[int] | None = None, log=print) -> dict:
    """Stream ``tokens`` tokens of the book (or the given ``ids``) with absolute and with
    rolled positions; per-window perplexity of each policy in each mode (and of the full
    cache when ``full``). Returns ``{"runs": [...], "config": {...}}``."""
    ids = torch.tensor([ids if ids is not None else book_ids(tokenizer, tokens)])
    trained = model.config.get_text_config(decoder=True).max_position_embeddings
    runs = []
    if full:
        started = time.perf_counter()
        # The full cache never evicts, so its chunk size does not change what it computes.
        nll = stream_nll(model, make_cache(model, "full"), ids, 512)
        runs.append({"policy": "full", "mode": "absolute", "label": "full", "slots": None,
                     "ppl": perplexity(nll), "windows": windows(nll, window),
                     "seconds": round(time.perf_counter() - started, 1)})
        log(f"  full cache: {runs[-1]['seconds']:.0f}s")
    rules = variants(budget, sink)
    for rolling in (False, True):
        mode = "rolling" if rolling else "absolute"
        cache = bench_cache(model, rules, rolling=rolling)
        started = time.perf_counter()
        nll = stream_nll(model, cache, ids.repeat(len(rules), 1), chunk, progress=lambda t, L: (
            log(f"    {mode}: token {t}/{L}  {time.perf_counter() - started:.0f}s") if t % 2048 < chunk else None))
        held = cache.stats().held
        assert held <= budget, f"{held} slots held, budget {budget}"
        seconds = round(time.perf_counter() - started, 1)
        log(f"  {mode}: {len(rules)} policies in {seconds:.0f}s")
        for k, rule in enumerate(rules):
            runs.append({"policy": rule.label, "mode": mode, "label": f"{rule.label} {mode}", "slots": budget,
                         "variant": rule.describe(), "ppl": perplexity(nll[k]), "windows": windows(nll[k], window),
                         "held_at_end": held, "seconds_batch": seconds})
    config = {"source": data.BOOK, "start": "Chapter 1", "tokens": ids.shape[1], "budget": budget, "sink": sink,
              "chunk": chunk, "window": window, "trained_context": trained, "full_chunk": 512 if full else None}
    return {"runs": runs, "config": config}


def past_trained(result: dict) -> dict[str, dict[str, float]]:
    """Per run: perplexity pooled over the windows inside and past the trained context
    (token-weighted, i.e. exp of the mean nll over those tokens)."""
    trained = result["config"]["trained_context"]
    out = {}
    for run in result["runs"]:
        parts = {}
        for name, inside in (("inside", True), ("past", False)):
            ws = [w for w in run["windows"] if (w["end"] <= trained) == inside]
            n = sum(w["tokens"] for w in ws)
            parts[name] = math.exp(sum(w["tokens"] * math.log(w["ppl"]) for w in ws) / n) if n else None
        out[run["label"]] = parts
    return out
