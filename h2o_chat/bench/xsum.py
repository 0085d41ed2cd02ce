"""Comparison 3: XSUM 0-shot summarization, the H2O paper's protocol.

Per article: the paper's prompt (``article`` field) is prefilled as ONE chunk, so the
bounded caches evict from the scores of the whole prompt, as the paper's implementation
does; then greedy decoding of up to 64 tokens, cut at the paper's stop string ``###``.
Budgets are ratios of the prompt length: h2o keeps heavy 10% + recent 10% ("20%"); the
paper's "local" baseline keeps the recent 20%; sink (StreamingLLM) keeps 4 sinks + the
recent rest. ROUGE-1/2/L F1 against ``summary_gt`` (``rouge-score``, Porter stemming).

The bounded policies run as rows of one batch (same prompt, same capacity); the full
cache runs alone.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from h2o_chat.engine.build import make_cache
from h2o_chat.loading import eos_token_ids

from . import data
from .variants import Variant, bench_cache

MAX_NEW_TOKENS = 64
STOP = "###"


def xsum_variants(prompt_len: int, ratio: float = 0.1, sink: int = 4, extra=None) -> list[Variant]:
    heavy = max(1, int(ratio * prompt_len))
    recent = max(1, int(ratio * prompt_len))
    slots = heavy + recent
    variants = [
        Variant("h2o", "h2o", heavy=heavy, recent=recent),
        Variant("local (recent)", "recent", recent=slots),
        Variant("sink", "sink", sink=sink, recent=slots - sink),
    ]
    if extra is not None:
        variants.append(extra(slots))
    return variants


def greedy(model, tokenizer, cache, ids: torch.Tensor, eos: set[int]) -> list[tuple[str, int]]:
    """Prefill ``ids`` (rows, L) as one chunk, decode greedily; (text, tokens) per row."""
    rows = ids.shape[0]
    out = [[] for _ in range(rows)]
    done = [False] * rows
    with torch.inference_mode():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        for _ in range(MAX_NEW_TOKENS):
            token = logits.argmax(-1)
            for r in range(rows):
                if done[r]:
                    continue
                t = int(token[r])
                if t in eos:
                    done[r] = True
                    continue
                out[r].append(t)
                if STOP in tokenizer.decode(out[r][-8:]):
                    done[r] = True
            if all(done):
                break
            logits = model(input_ids=token[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    texts = []
    for ids_r in out:
        text = tokenizer.decode(ids_r, skip_special_tokens=True)
        texts.append((text.split(STOP)[0].strip(), len(ids_r)))
    return texts


@functools.cache
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge(reference: str, text: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 of ``text`` against ``reference``."""
    scores = _scorer().score(reference, text)
    return {k: scores[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")}


def run(model, tokenizer, n_articles: int, extra=None, log=print) -> dict:
    eos = eos_token_ids(model, tokenizer)
    articles = data.xsum_articles(n_articles)
    per_article = []
    started = time.perf_counter()
    for i, row in enumerate(articles):
        ids = torch.tensor([tokenizer(row["article"], add_special_tokens=False).input_ids])
        length = ids.shape[1]
        outputs = {"full": (greedy(model, tokenizer, make_cache(model, "full"), ids, eos)[0], None)}
        variants = xsum_variants(length, extra=extra)
        cache = bench_cache(model, variants, rows=1)
        texts = greedy(model, tokenizer, cache, ids.repeat(len(variants), 1), eos)
        assert cache.stats().held <= variants[0].capacity
        for v, text in zip(variants, texts):
            outputs[v.label] = (text, v.capacity)
        rec = {"index": i, "prompt_tokens": length, "reference": row["summary_gt"], "outputs": {}}
        for label, ((text, n_new), slots) in outputs.items():
            rec["outputs"][label] = {"text": text, "new_tokens": n_new, "slots": slots,
                                     **rouge(row["summary_gt"], text)}
        per_article.append(rec)
        if (i + 1) % 5 == 0 or i + 1 == len(articles):
            log(f"  xsum {i + 1}/{len(articles)} articles, {time.perf_counter() - started:.0f}s")
    summary = {}
    for label in per_article[0]["outputs"]:
        outs = [a["outputs"][label] for a in per_article]
        summary[label] = {k: statistics.mean(o[k] for o in outs) for k in ("rouge1", "rouge2", "rougeL")}
        summary[label].update(n=len(outs), mean_new_tokens=statistics.mean(o["new_tokens"] for o in outs),
                              budget="100%" if label == "full" else "20% of prompt")
    return {
        "summary": summary,
        "articles": per_article,
        "config": {"articles": len(articles), "max_new_tokens": MAX_NEW_TOKENS, "stop": STOP, "decoding": "greedy",
                   "ratios": {"h2o": "heavy 10% + recent 10%", "local (recent)": "recent 20%",
                              "sink": "4 sinks + recent (20% - 4)"},
                   "prefill": "whole prompt as one chunk", "rouge": "rouge-score F1, use_stemmer=True"},
    }
