"""Comparison 8: quality at equal memory, storage precision and eviction under one budget.

Each cache gets a share of the bytes the plain full cache takes for the same passage
(float32 K and V of every token and nothing else, what a cache without eviction holds).
The share buys ``bytes // token_bytes`` slots at the cache's precision, scales and
bookkeeping counted, as the app's ``cache.budget_mb`` does, and h2o splits them as the app
does (``split_slots``). Precision trades bytes per slot for slots: at one share a K8/V4
h2o holds four times the tokens of a float32 one.

Rows: the full cache stored at lower precision (quantization only, what llama.cpp and
Ollama users get), then at each share h2o at every precision and the sink window
(StreamingLLM) at float32 and K8/V4. Passages, reference and metrics are those of
comparisons 1 (streaming, one token at a time) and 2 (chunked prefill, then the next
tokens); the variants of one precision and share run as row blocks of one batch, each row
evicted exactly as alone. Decode speed: float32 and K8/V4 h2o with the same slots (what
the K8/V4 cache holds at 5% of the bytes) and the float32 full cache, each as the app
decodes a conversation (one row of the decode step) and through the model's own forward
over the cache, timed runs alternating in one process (comparison 4's method).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
import os
import statistics
import time

import torch

from h2o_chat.config import CacheConfig
from h2o_chat.engine.budget import cache_geometry, split_slots, token_bytes, window_bytes
from h2o_chat.engine.build import cache_for_policy
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import FullPolicy, make_policy
from h2o_chat.engine.quant import KVStorage
from h2o_chat.loading import eos_token_ids

from . import data
from .report import md_table, pyplot
from .speed import decode, decode_stepped, prefill
from .streaming import full_records, passage_records, phase_pass, reference_logprobs, run_budget
from .variants import Variant
from .xsum import greedy, rouge

PRECISIONS: dict[str, KVStorage] = {
    "float32": KVStorage(32, 32), "fp16": KVStorage(16, 16), "K8/V8": KVStorage(8, 8),
    "K8/V4": KVStorage(8, 4), "K4/V4": KVStorage(4, 4), "K4/V4 +16 exact": KVStorage(4, 4, exact_window=16),
}
QUANTIZE_ONLY = ("fp16", "K8/V8", "K8/V4", "K4/V4", "K4/V4 +16 exact")
SINK_PRECISIONS = ("float32", "K8/V4")
SINK = 4
SPEED_SHARE = 0.05  # the decode timing's slots: what K8/V4 holds at this share of the bytes
XSUM_SHARE = 0.1
XSUM_PRECISIONS = ("float32", "K8/V4")


def plain_token_bytes(model) -> int:
    """Bytes the plain full cache holds per token: float32 K and V in every layer and KV head."""
    slots, head_dim = cache_geometry(model)
    return slots * PRECISIONS["float32"].slot_bytes(head_dim, torch.float32)


def share_slots(model, share: float, tokens: int, storage: KVStorage) -> int:
    """Slots that ``share`` of the plain full cache's bytes for ``tokens`` tokens buy, after
    the exact window's rings (as a byte budget counts them)."""
    budget = int(share * tokens * plain_token_bytes(model)) - window_bytes(model, storage)
    return min(tokens, max(0, budget) // token_bytes(model, storage, rolling=False))


def share_variants(slots: int, precision: str) -> list[Variant]:
    """h2o split as the app splits a byte budget, and at some precisions the sink window."""
    variants = [Variant(f"h2o {precision}", "h2o", **split_slots("h2o", slots, SINK))]
    if precision in SINK_PRECISIONS and slots > SINK:
        variants.append(Variant(f"sink {precision}", "sink", **split_slots("sink", slots, SINK)))
    return variants


def _share_name(share: float) -> str:
    return f"{share:.1%}".replace(".0%", "%")


def measure_quality(model, passages, shares: list[float], *, phases=("streaming", "continuation"),
                    prefill: int = 16, stream_len: int = 1536, chunk: int = 256, baselines: bool = True,
                    precisions: tuple[str, ...] = tuple(PRECISIONS), log=print) -> list[dict]:
    """Every cache's records (``streaming.passage_records`` plus share, precision and the
    bytes a row held at the end) over ``passages`` in each phase, for ``precisions``;
    ``baselines``: the full cache at each lower precision too (shares and precisions of
    one run may go to processes of their own)."""
    ids = torch.tensor([p.ids for p in passages])
    rows = ids.shape[0]
    log(f"  reference: full cache over {rows} passages x {ids.shape[1]} tokens")
    ref = reference_logprobs(model, ids)
    records = []
    for phase in phases:
        # Shares are of the bytes the plain full cache takes for the context the budget is for.
        plain = plain_token_bytes(model) * stream_len
        found = [r | {"precision": "float32", "share": 1.0, "held_bytes_per_row": plain}
                 for r in full_records(ids, ref, passages, phase=phase, stream_len=stream_len)]
        for precision in [p for p in QUANTIZE_ONLY if p in precisions] if baselines else ():
            started = time.perf_counter()
            cache = cache_for_policy(model, FullPolicy(), storage=PRECISIONS[precision])
            nll, agree, kl = phase_pass(model, cache, ids, ref, phase=phase, prefill=prefill,
                                        stream_len=stream_len, chunk=chunk)
            stats = cache.stats()
            held = stats.held_bytes // rows
            log(f"  {phase} full {precision}: {time.perf_counter() - started:.0f}s")
            share = held / (plain_token_bytes(model) * stats.seen)
            found += [r | {"precision": precision, "share": share, "held_bytes_per_row": held}
                      for r in passage_records(f"full {precision}", "full", "full", None, passages,
                                               nll, agree, kl, phase)]
        for share in shares:
            for precision in precisions:
                storage = PRECISIONS[precision]
                slots = share_slots(model, share, stream_len, storage)
                found += [r | {"precision": precision, "share": r["held_bytes_per_row"] / plain}
                          for r in run_budget(model, ids, ref, passages, share_variants(slots, precision),
                                              _share_name(share), slots, phase=phase, prefill=min(prefill, slots),
                                              stream_len=stream_len, chunk=chunk, storage=storage, log=log)]
        records += found
    return records


def speed_configs(model, context: int) -> list[tuple[str, int | None, Callable[[], H2OCache]]]:
    """Float32 full, and float32 and K8/V4 h2o at the slots K8/V4 holds at SPEED_SHARE."""
    slots = share_slots(model, SPEED_SHARE, context, PRECISIONS["K8/V4"])

    def h2o(precision: str):
        return lambda: cache_for_policy(model, make_policy("h2o", **split_slots("h2o", slots, SINK)),
                                        storage=PRECISIONS[precision])

    return [("full float32", None, lambda: cache_for_policy(model, FullPolicy())),
            ("h2o float32", slots, h2o("float32")), ("h2o K8/V4", slots, h2o("K8/V4"))]


def measure_speed(model, tokenizer, contexts: list[int], decode_tokens: int, repeats: int, log=print) -> list[dict]:
    """Median decode tokens/s of each speed config at each context, runs alternating: through
    the model's own forward over the cache (``decode_tok_s``) and as the app decodes a
    conversation, one row of the decode step (``stepped_tok_s``)."""
    chunk = CacheConfig().prefill_chunk_size
    text = data.read_text(data.BOOK)
    book = tokenizer(text[: 8 * max(contexts)], add_special_tokens=False).input_ids
    paths = {"decode_tok_s": decode, "stepped_tok_s": decode_stepped}
    rows = []
    for context in contexts:
        ids = torch.tensor([book[:context]])
        configs = speed_configs(model, context)
        prefilled = {}
        for name, _, make in configs:
            cache = make()
            prefilled[name] = (cache, prefill(model, cache, ids, chunk))
        runs = {(name, path): [] for name, *_ in configs for path in paths}
        order = list(runs)
        for rep in range(repeats):
            for name, path in order[rep % len(order):] + order[: rep % len(order)]:
                cache, logits = prefilled[name]
                runs[name, path].append(decode_tokens / paths[path](model, copy.deepcopy(cache), logits, decode_tokens))
        for name, slots, _ in configs:
            rows.append({"context": context, "config": name, "slots": slots,
                         "held_bytes": prefilled[name][0].stats().held_bytes,
                         **{path: statistics.median(runs[name, path]) for path in paths},
                         "runs_tok_s": runs[name, "decode_tok_s"], "stepped_runs_tok_s": runs[name, "stepped_tok_s"]})
        log(f"  speed {context}: " + ", ".join(
            f"{r['config']} {r['stepped_tok_s']:.1f} tok/s stepped, {r['decode_tok_s']:.1f} the model's forward"
            for r in rows if r["context"] == context))
        del prefilled
    return rows


def measure_xsum(model, tokenizer, n_articles: int, share: float = XSUM_SHARE,
                 precisions: tuple[str, ...] = XSUM_PRECISIONS, log=print) -> dict:
    """Comparison 3's protocol (whole prompt as one chunk, greedy, ROUGE F1) for the full
    cache and h2o at each of ``precisions`` with ``share`` of the bytes the full cache
    holds for each prompt. An article whose share some precision cannot spend on the
    sink plus one slot (an exact window's rings come first) is left out for every cache,
    and counted."""
    eos = eos_token_ids(model, tokenizer)
    labels = ["full float32", *(f"h2o {p}" for p in precisions)]
    scores, slots = {label: [] for label in labels}, {label: [] for label in labels[1:]}
    started, left_out = time.perf_counter(), 0
    for i, row in enumerate(data.xsum_articles(n_articles)):
        ids = torch.tensor([tokenizer(row["article"], add_special_tokens=False).input_ids])
        bought = {p: share_slots(model, share, ids.shape[1], PRECISIONS[p]) for p in precisions}
        if min(bought.values()) <= SINK:
            left_out += 1
            continue
        caches = {"full float32": cache_for_policy(model, FullPolicy())}
        for precision in precisions:
            slots[f"h2o {precision}"].append(bought[precision])
            budgets = split_slots("h2o", bought[precision], SINK)
            caches[f"h2o {precision}"] = cache_for_policy(model, make_policy("h2o", **budgets),
                                                          storage=PRECISIONS[precision])
        for label, cache in caches.items():
            scores[label].append(rouge(row["summary_gt"], greedy(model, tokenizer, cache, ids, eos)[0][0]))
        if (i + 1) % 10 == 0:
            log(f"  xsum {i + 1}/{n_articles} articles, {time.perf_counter() - started:.0f}s")
    return {"share": share, "articles": n_articles - left_out, "left_out": left_out,
            "caches": {label: {"mean_slots": statistics.mean(slots[label]) if label in slots else None,
                               **{k: statistics.mean(s[k] for s in scores[label]) for k in scores[label][0]}}
                       for label in labels}}


def run(model, tokenizer, passages_per_source: int, shares: list[float], contexts: list[int],
        decode_tokens: int, repeats: int, xsum_articles: int = 0, phases=("streaming", "continuation"),
        log=print) -> dict:
    passages = data.passages(tokenizer, passages_per_source, 1536 + 200)
    started_load = os.getloadavg()[0]
    records = measure_quality(model, passages, shares, phases=phases, log=log)
    speed = measure_speed(model, tokenizer, contexts, decode_tokens, repeats, log=log) if contexts else []
    summaries = measure_xsum(model, tokenizer, xsum_articles, log=log) if xsum_articles else None
    notes = [f"Plain full cache: {plain_token_bytes(model):,} bytes a token (float32 K and V, "
             f"{cache_geometry(model)[0]} slots of head dim {cache_geometry(model)[1]}); each share is of that, "
             "a row's bytes are what its cache reported holding at the end (scales and bookkeeping included).",
             f"Load average (1 min) at the start {started_load:.2f}, at the end {os.getloadavg()[0]:.2f}."]
    return {"records": records, "speed": speed, "xsum": summaries, "notes": notes,
            "config": {"passages": [{"source": p.source, "title": p.title, "tokens": len(p.ids)} for p in passages],
                       "shares": shares, "contexts": contexts, "decode_tokens": decode_tokens,
                       "repeats": repeats, "phases": list(phases), "sink": SINK}}


def _pooled(records: list[dict], phase: str, source: str) -> dict[tuple[str, str], dict]:
    """(share name, cache label) -> the pooled record of ``source`` in ``phase``."""
    return {(r["budget"], r["policy"]): r for r in records
            if r["phase"] == phase and r["set"] == source and not r["per_passage"]}


def ratio(records: list[dict], phase: str, source: str, budget: str, label: str) -> float | None:
    table = _pooled(records, phase, source)
    row, full = table.get((budget, label)), table.get(("full", "full"))
    return None if row is None or full is None else row["ppl"] / full["ppl"]


def markdown(result: dict) -> str:
    records, blocks = result["records"], []
    for phase in result["config"]["phases"]:
        table = {source: _pooled(records, phase, source) for source in ("wikitext2", "book", "all")}
        header = ["share of bytes", "cache", "slots", "bytes held (share)", "ppl vs full: wikitext2", "book",
                  "all", "top-1 agree", "KL(full‖cache)"]
        rows = []
        for (budget, label), r in table["all"].items():
            rows.append([budget, label, r["slots"] or "all", f"{r['held_bytes_per_row'] / 2**20:.2f} MiB "
                         f"({r['share']:.1%})"]
                        + [f"{ratio(records, phase, s, budget, label):.3f}×" for s in ("wikitext2", "book", "all")]
                        + [f"{r['top1']:.1%}", f"{r['kl']:.4f}"])
        full = table["all"][("full", "full")]["ppl"]
        blocks.append(f"**{phase}** (full cache perplexity {full:.2f})\n\n" + md_table(header, rows))
    if result["speed"]:
        # Results from before the stepped timing have the model's forward alone.
        paths = [(key, label) for key, label in (("stepped_tok_s", "decode step"), ("decode_tok_s", "model's forward"))
                 if key in result["speed"][0]]
        rows = []
        for r in result["speed"]:
            same = {s["config"]: s for s in result["speed"] if s["context"] == r["context"]}
            rows.append([r["context"], r["config"], r["slots"] or "all", f"{r['held_bytes'] / 2**20:.2f} MiB"]
                        + [cell for key, _ in paths for cell in (
                            f"{r[key]:.1f}", f"{r[key] / same['full float32'][key]:.2f}×",
                            f"{r[key] / same['h2o float32'][key]:.2f}×")])
        header = ["context", "cache", "slots", "bytes held"] + [
            column for _, label in paths for column in (f"tok/s, {label}", "vs full float32", "vs h2o float32")]
        blocks.append("**decode speed** (median of alternating runs; the decode step is the app's path, one "
                      "row)\n\n" + md_table(header, rows))
    if result.get("xsum"):
        xs = result["xsum"]
        full = xs["caches"]["full float32"]
        rows = [[label, "all" if c["mean_slots"] is None else f"{c['mean_slots']:.0f}", f"{c['rougeL']:.4f}",
                 f"{c['rougeL'] / full['rougeL']:.3f}×", f"{c['rouge1']:.4f}", f"{c['rouge2']:.4f}"]
                for label, c in xs["caches"].items()]
        # Older results have no count of articles left out (none was).
        left_out = f", {xs['left_out']} left out: too short to hold a window" if xs.get("left_out") else ""
        blocks.append(f"**XSUM** ({xs['articles']} articles{left_out}, h2o at {_share_name(xs['share'])} of the "
                      "bytes the full cache holds for each prompt; mean slots)\n\n"
                      + md_table(["cache", "slots", "ROUGE-L", "vs full", "ROUGE-1", "ROUGE-2"], rows))
    return "\n\n".join(blocks)


def plot(result: dict, path) -> None:
    plt = pyplot()
    phases = result["config"]["phases"]
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        table = _pooled(result["records"], phase, "all")
        full = table[("full", "full")]["ppl"]
        for label in dict.fromkeys(lbl for _, lbl in table if lbl != "full"):
            points = sorted((r["share"], r["ppl"] / full) for (_, lbl), r in table.items() if lbl == label)
            ax.plot(*zip(*points), "o-" if label.startswith(("h2o", "sink")) else "s", label=label)
        ax.axhline(1, color="black", ls="--", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="share of the full cache's bytes", ylabel="perplexity / full",
               title=phase)
        # Ticks at the measured shares, as plain numbers: log axes label every minor tick.
        shares = sorted({round(r["share"], 3) for r in table.values()})
        ax.set_xticks(shares, [f"{s:.1%}" for s in shares], fontsize=7, rotation=45)
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.2f}×"))
        ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:.1f}×"))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
