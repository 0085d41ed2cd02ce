"""Comparisons 1 (streaming) and 2 (compressed context, then continue), and the tuning study.

Same inputs for every policy: a set of passages of ``stream_len + cont_len`` tokens. The
full-cache reference is ONE forward pass per passage (full policy, chunked: the full cache
never evicts, so chunking does not change its logits) and is reused by every policy.

Streaming (1): each policy run feeds the first ``prefill`` tokens as one chunk (fewer than
the smallest budget, so nothing is evicted yet), then the rest ONE token at a time, as in
the H2O paper's streaming setting: eviction happens after every token. Metrics cover every
predicted token of the first ``stream_len`` tokens.

Continuation (2): the first ``stream_len`` tokens are prefilled in chunks of ``chunk``
tokens (the app's prefill; eviction after each chunk), then the true next ``cont_len``
tokens go in one at a time with the cache still bounded; metrics cover those ``cont_len``
predictions.

All bounded policies at one budget run as row blocks of one batch (``MixedPolicy``): each
row is evicted independently, exactly as if run alone, at a fraction of the CPU time.
"""

from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from h2o_chat.engine.build import make_cache
from h2o_chat.engine.quant import KVStorage

from .metrics import summarize, token_metrics
from .variants import Variant, bench_cache, h2o_split, standard_variants


def reference_logprobs(model, ids: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Full-cache next-token log-probabilities ``(batch, length, vocab)`` for ``ids``."""
    cache = make_cache(model, "full")
    out = []
    with torch.inference_mode():
        for piece in ids.split(chunk, dim=1):
            logits = model(input_ids=piece, past_key_values=cache, use_cache=True).logits
            out.append(F.log_softmax(logits.float(), dim=-1))
    return torch.cat(out, dim=1)


def _ref_rows(ref: torch.Tensor, rows: int) -> torch.Tensor:
    # ref holds n passages; row r of the batch is passage r % n (policy-major blocks).
    return ref if ref.shape[0] == rows else ref.repeat(rows // ref.shape[0], *([1] * (ref.dim() - 1)))


def stream_pass(model, cache, ids: torch.Tensor, ref: torch.Tensor, prefill: int, progress=None):
    """Teacher-force ``ids`` (rows, L): ``prefill`` tokens at once, then one at a time.

    ``ref`` is (n, L, vocab) reference log-probs of the n distinct passages, rows being
    policy-major copies of them. Returns per-token nll, agreement and KL, each
    (rows, L - 1): entry t scores the prediction of token t + 1.
    """
    rows, length = ids.shape
    nll = torch.empty(rows, length - 1)
    agree = torch.empty(rows, length - 1, dtype=torch.bool)
    kl = torch.empty(rows, length - 1)
    with torch.inference_mode():
        logits = model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits
        n, a, k = token_metrics(logits, ids[:, 1 : prefill + 1], _ref_rows(ref[:, :prefill], rows))
        nll[:, :prefill], agree[:, :prefill], kl[:, :prefill] = n, a, k
        for t in range(prefill, length - 1):
            logits = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
            nll[:, t], agree[:, t], kl[:, t] = token_metrics(logits, ids[:, t + 1], _ref_rows(ref[:, t], rows))
            if progress and t % 256 == 0:
                progress(t, length)
    return nll, agree, kl


def continue_pass(model, cache, ids: torch.Tensor, ref: torch.Tensor, context: int, chunk: int):
    """Prefill ``ids[:, :context]`` in chunks, then feed the rest one token at a time.

    Returns per-token nll, agreement and KL for the predictions of tokens ``context ..
    L - 1``, each (rows, L - context).
    """
    rows, length = ids.shape
    out = []
    with torch.inference_mode():
        for piece in ids[:, :context].split(chunk, dim=1):
            logits = model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        for t in range(context, length):
            out.append(token_metrics(logits, ids[:, t], _ref_rows(ref[:, t - 1], rows)))
            if t + 1 < length:
                logits = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
    return tuple(torch.stack(x, dim=1) for x in zip(*out))


def budget_slots(budget: float | int, length: int) -> int:
    """A budget given as a fraction (< 1) of ``length`` or as a slot count."""
    return max(1, int(round(budget * length))) if budget < 1 else int(budget)


def passage_records(label, kind, budget_name, slots, passages, nll, agree, kl, phase, variant=None):
    """Per-passage and per-source records of one variant's rows."""
    records = []
    sources = sorted({p.source for p in passages})
    groups = [(p.source, f"{p.source}:{p.title}", [i]) for i, p in enumerate(passages)]
    groups += [(s, s, [i for i, p in enumerate(passages) if p.source == s]) for s in sources]
    groups.append(("all", "all", list(range(len(passages)))))
    for source, name, idx in groups:
        rec = {
            "phase": phase, "policy": label, "kind": kind, "budget": budget_name, "slots": slots,
            "set": name, "source": source, "per_passage": name not in sources and name != "all",
            **summarize(nll[idx], agree[idx], kl[idx]),
        }
        if variant is not None:
            rec["variant"] = variant.describe()
        records.append(rec)
    return records


def phase_pass(model, cache, ids, ref, *, phase: str, prefill: int, stream_len: int, chunk: int, progress=None):
    """Per-token nll, agreement and KL of ``cache`` (one row per row of ``ids``) in ``phase``."""
    if phase == "streaming":
        return stream_pass(model, cache, ids[:, :stream_len], ref[:, :stream_len], prefill, progress=progress)
    return continue_pass(model, cache, ids, ref, stream_len, chunk)


def run_budget(model, ids, ref, passages, variants: list[Variant], budget_name, slots, *,
               phase: str, prefill: int, stream_len: int, chunk: int, storage: KVStorage = KVStorage(),
               log=print) -> list[dict]:
    """One batched pass of every variant in ``variants`` (same capacity) over the passages,
    their slots stored at ``storage``'s precision."""
    n = ids.shape[0]
    # Policy-major: rows k*n .. (k+1)*n - 1 are the n passages under variant k.
    rows_ids = ids.repeat(len(variants), 1)
    cache = bench_cache(model, variants, rows=n, storage=storage)
    started = time.perf_counter()
    nll, agree, kl = phase_pass(model, cache, rows_ids, ref, phase=phase, prefill=prefill, stream_len=stream_len,
                                chunk=chunk,
                                progress=lambda t, L: log(f"    token {t}/{L}  {time.perf_counter() - started:.0f}s"))
    stats = cache.stats()
    assert stats.held <= slots and all(layer.held <= slots for layer in stats.layers), "budget exceeded"
    seconds = time.perf_counter() - started
    log(f"  {phase} budget {budget_name} ({slots} slots): {len(variants)} policies x {n} passages in {seconds:.0f}s")
    records = []
    for k, variant in enumerate(variants):
        rows = slice(k * n, (k + 1) * n)
        records += passage_records(variant.label, variant.kind, budget_name, slots, passages,
                                   nll[rows], agree[rows], kl[rows], phase, variant)
    for rec in records:
        rec["held_at_end"] = stats.held
        rec["held_bytes_per_row"] = stats.held_bytes // rows_ids.shape[0]
        rec["seconds_batch"] = seconds
    return records


def full_records(ids, ref, passages, *, phase, stream_len):
    """The full cache scored by its own reference (KL 0 and top-1 agreement 1 by definition)."""
    if phase == "streaming":
        logits, targets, r = ref[:, : stream_len - 1], ids[:, 1:stream_len], ref[:, : stream_len - 1]
    else:
        logits, targets, r = ref[:, stream_len - 1 : -1], ids[:, stream_len:], ref[:, stream_len - 1 : -1]
    nll, agree, kl = token_metrics(logits, targets, r)
    return passage_records("full", "full", "full", None, passages, nll, agree, kl, phase)


def run_quality(model, tokenizer, passages, budgets, *, phases=("streaming", "continuation"),
                variant_sets=None, prefill: int = 16, stream_len: int = 1536, chunk: int = 256,
                sink: int = 4, log=print) -> dict:
    """Comparisons 1 and/or 2 over ``passages`` at each budget in ``budgets``.

    ``variant_sets(slots)`` returns the variants to compare at a budget (default: the
    stock h2o, recent and sink rules). Returns ``{"records": [...], "config": {...}}``.
    """
    variant_sets = variant_sets or (lambda slots: standard_variants(slots, sink))
    ids = torch.tensor([p.ids for p in passages])
    log(f"  reference: full cache over {ids.shape[0]} passages x {ids.shape[1]} tokens")
    started = time.perf_counter()
    ref = reference_logprobs(model, ids)
    log(f"  reference done in {time.perf_counter() - started:.0f}s")
    records = []
    for phase in phases:
        records += full_records(ids, ref, passages, phase=phase, stream_len=stream_len)
        for budget in budgets:
            slots = budget_slots(budget, stream_len)
            name = f"{budget:.0%}" if budget < 1 else str(int(budget))
            records += run_budget(model, ids, ref, passages, variant_sets(slots), name, slots,
                                  phase=phase, prefill=min(prefill, slots), stream_len=stream_len,
                                  chunk=chunk, log=log)
    config = {
        "passages": [{"source": p.source, "title": p.title, "start_char": p.start_char, "tokens": len(p.ids)}
                     for p in passages],
        "budgets": [str(b) for b in budgets], "prefill": prefill, "stream_len": stream_len,
        "cont_len": ids.shape[1] - stream_len, "chunk": chunk, "sink": sink,
    }
    return {"records": records, "config": config}


def tuning_variants(slots: int, decays=(0.99,), sink: int = 4) -> list[Variant]:
    """The tuning grid at one budget: heavy/recent split, sink slots, score normalisation;
    with the stock sink window as the baseline to beat."""
    grid = [
        h2o_split("h2o 50/50 (paper)", slots, 0.5),
        h2o_split("h2o 25/75", slots, 0.25),
        h2o_split("h2o 75/25", slots, 0.75),
        h2o_split("h2o 50/50 +sink", slots, 0.5, sink=sink),
        h2o_split("h2o 25/75 +sink", slots, 0.25, sink=sink),
        h2o_split("h2o mean 50/50 +sink", slots, 0.5, sink=sink, norm="mean"),
        h2o_split("h2o mean 25/75 +sink", slots, 0.25, sink=sink, norm="mean"),
    ]
    grid += [h2o_split(f"h2o decay{g} 50/50 +sink", slots, 0.5, sink=sink, decay=g) for g in decays]
    grid.append(Variant("sink", "sink", sink=min(sink, slots - 1), recent=slots - min(sink, slots - 1)))
    return grid
