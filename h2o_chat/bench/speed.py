"""Comparison 4: speed and memory against context length, full cache vs H2O.

Same prompt for every config at a context length: the first ``context`` tokens of Pride
and Prejudice. Per config: prefill in the app's chunks (256 tokens), timed; then greedy
decoding of ``decode_tokens`` tokens, timed, from a copy of the prefilled cache, so every
timed decode run of a config starts from the same state. Timed runs alternate between the
configs (order rotated each repeat) and are repeated; medians with min-max are reported.

Configs: full (the fused sdpa kernel; no scores), h2o with 20% of the context, h2o with a
fixed 512 slots, h2o with a budget larger than the context (never evicts: the cost of
score keeping alone, the explicit-softmax attention, against full with sdpa), and stock
transformers' ``DynamicCache`` with sdpa (what our full cache should cost no more than).
Memory: KV bytes from the cache's own tensors, and the process RSS sampled every 2 ms
(peak during the config's runs, and its growth over the RSS before them).
"""

from __future__ import annotations

import copy
import os
import statistics
import threading
import time

import psutil
import torch
from transformers import DynamicCache

from h2o_chat.config import CacheConfig
from h2o_chat.engine.build import cache_for_policy, make_cache
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.step import DecodeStep, why_not_stepped

from . import data


class RssSampler:
    """Peak resident set size of this process while active, sampled in a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._proc = psutil.Process()

    def __enter__(self):
        self.start = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def speed_configs(model, context: int, decode_tokens: int, sink: int = 4):
    def budgets(slots: int) -> dict[str, int]:
        heavy = (slots - sink) // 2
        return dict(heavy=heavy, recent=slots - sink - heavy, sink=sink)

    def h2o(slots: int):
        return lambda: make_cache(model, "h2o", **budgets(slots))

    def never_full(slots: int):
        # make_cache refuses budgets past the model's context (8192 tokens), which the
        # longest run needs to keep scores without evicting: build around the policy.
        return lambda: cache_for_policy(model, make_policy("h2o", **budgets(slots)))

    big = context + decode_tokens + 8
    return [
        ("full (sdpa)", None, lambda: make_cache(model, "full")),
        ("h2o 20%", context // 5, h2o(context // 5)),
        ("h2o 512", 512, h2o(512)),
        ("h2o, budget > context", big, never_full(big)),
        ("stock DynamicCache (sdpa)", None, lambda: DynamicCache(config=model.config)),
    ]


def kv_numbers(cache) -> tuple[int, int, int]:
    """Bytes allocated, bytes in use and slots held per layer, for our cache or a stock one."""
    if isinstance(cache, H2OCache):
        stats = cache.stats()
        return stats.kv_bytes, stats.held_bytes, stats.held
    nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return nbytes, nbytes, cache.get_seq_length()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: CUDA runs kernels asynchronously, so a clock
    read without this would stop before the last of them ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids`` in pieces of ``chunk`` tokens; the last token's logits, once computed."""
    with torch.inference_mode():
        for piece in ids.split(chunk, dim=1):
            logits = model(input_ids=piece, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    synchronize(logits.device)
    return logits


def decode(model, cache, logits: torch.Tensor, n: int) -> float:
    """Seconds for ``n`` greedy decode steps."""
    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(n):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        synchronize(logits.device)
        return time.perf_counter() - started


def decode_stepped(model, cache, logits: torch.Tensor, n: int) -> float:
    """Seconds for ``n`` greedy decode steps as the app decodes a conversation: one row of
    the scheduler's ``DecodeStep`` (``decode`` runs the model's own forward over the cache,
    which the app runs only for prompts and for caches the step cannot take). The step
    that makes the cache its row comes first, untimed: a conversation joins once."""
    why = why_not_stepped(cache)
    if why is not None:
        raise ValueError(f"the decode step cannot take this cache: {why}")
    step = DecodeStep()
    with torch.inference_mode():
        logits = step(model, [cache], [int(logits.argmax())])
        started = time.perf_counter()
        for _ in range(n):
            logits = step(model, [cache], [int(logits[0].argmax())])
        synchronize(logits.device)
        return time.perf_counter() - started


def run(model, tokenizer, contexts: list[int], decode_tokens: int, repeats: int, prefill_repeats: int = 1,
        log=print) -> dict:
    chunk = CacheConfig().prefill_chunk_size
    text = data.read_text(data.BOOK)
    book = tokenizer(text[: 8 * max(contexts)], add_special_tokens=False).input_ids
    if len(book) < max(contexts):
        book = tokenizer(text, add_special_tokens=False).input_ids
    loads, summary = [], []
    for context in contexts:
        ids = torch.tensor([book[:context]])
        configs = speed_configs(model, context, decode_tokens)
        state, prefill_s, rss = {}, {name: [] for name, *_ in configs}, {}
        for rep in range(prefill_repeats):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for name, slots, make in order:
                cache = make()
                with RssSampler() as sampler:
                    started = time.perf_counter()
                    logits = prefill(model, cache, ids, chunk)
                    prefill_s[name].append(time.perf_counter() - started)
                rss[name] = (sampler.peak, sampler.peak - sampler.start)
                state[name] = (cache, logits)
                loads.append(os.getloadavg()[0])
        decode_s = {name: [] for name, *_ in configs}
        kv_after = {}
        for rep in range(repeats):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for name, slots, make in order:
                cache, logits = state[name]
                work = copy.deepcopy(cache)
                with RssSampler() as sampler:
                    decode_s[name].append(decode(model, work, logits, decode_tokens))
                rss[name] = (max(rss[name][0], sampler.peak), max(rss[name][1], sampler.peak - sampler.start))
                kv_after[name] = kv_numbers(work)
                del work
                loads.append(os.getloadavg()[0])
        full_tps = full_prefill = None
        for name, slots, _ in configs:
            tps = [decode_tokens / s for s in decode_s[name]]
            allocated, in_use, _ = kv_numbers(state[name][0])
            row = {
                "context": context, "config": name, "slots": slots,
                "prefill_s": statistics.median(prefill_s[name]), "prefill_runs_s": prefill_s[name],
                "decode_tok_s": statistics.median(tps), "decode_tok_s_min": min(tps), "decode_tok_s_max": max(tps),
                "decode_runs_tok_s": tps,
                "kv_mb": allocated / 2**20,
                "held_mb": in_use / 2**20,
                "kv_mb_after_decode": kv_after[name][0] / 2**20,
                "held_after_decode": kv_after[name][2],
                "peak_rss_mb": rss[name][0] / 2**20, "rss_growth_mb": rss[name][1] / 2**20,
            }
            if name.startswith("full"):
                full_tps, full_prefill = row["decode_tok_s"], row["prefill_s"]
            row["decode_vs_full"] = row["decode_tok_s"] / full_tps
            row["prefill_vs_full"] = row["prefill_s"] / full_prefill
            summary.append(row)
        log(f"  speed {context}: " + ", ".join(f"{r['config']} {r['decode_tok_s']:.1f} tok/s"
                                               for r in summary if r["context"] == context))
        del state
    cores = psutil.cpu_count(logical=False) or 1
    notes = [
        f"Decode: {decode_tokens} greedy tokens per timed run, {repeats} runs per config alternating with the "
        f"other configs (order rotated each round); prefill: {prefill_repeats} timed run(s) per config, "
        f"chunks of {chunk} tokens.",
        f"Load average (1 min) during the runs: min {min(loads):.2f}, max {max(loads):.2f} on {cores} cores.",
    ]
    if max(loads) > 0.5 * cores + 1:
        notes.append(f"WARNING: the load average reached {max(loads):.2f}: something else ran on this "
                     f"{cores}-core machine during the measurement; the timings are unreliable.")
    return {"summary": summary, "notes": notes,
            "config": {"contexts": contexts, "decode_tokens": decode_tokens, "repeats": repeats,
                       "prefill_repeats": prefill_repeats, "chunk": chunk, "prompt": "Pride and Prejudice"}}
