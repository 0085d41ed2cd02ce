"""The GPU check: ``python -m h2o_chat.bench gpu [--device cuda|cpu] [--tiny] [--gpu-models 1b,8b]``.

Runs with nothing downloaded, on random-weight Llamas of real shapes built on the device
(``gpu_models.py``; quality is not measured there), and the embedded SmolLM2 where its
package is installed. Per model:

1. correctness on the device (``gpu_checks.py``), and that every cache is freed between runs;
2. decode tokens/s, peak memory and KV bytes at several history lengths, for the full
   cache, h2o at 20% of the history (float and K8/V4 slots) and stock ``DynamicCache``;
3. serving: B conversations with the same history decoding as one batch (the scheduler's
   step, ``forward_rows``): aggregate and per-row tokens/s, KV bytes; then the largest B
   that fits in memory for each cache, projected from the measured bytes and confirmed by
   running it (the H2O paper's throughput argument: a smaller cache fits a bigger batch);
4. prefill tokens/s of a long prompt in chunks.

Then a small random model saved as a model folder is loaded back through ``load_model``
with every placement the device allows, CUDA-only ones included (``device_map``,
bitsandbytes), see ``gpu_loading.py``; those that cannot run are listed with why.

``--tiny`` runs the same on a tiny model with small sizes in seconds (``make test`` does,
on the CPU), so the check cannot rot between GPU runs.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil
import torch
from transformers import DynamicCache

from h2o_chat.engine.build import make_cache
from h2o_chat.scheduler import forward_one, forward_rows

from . import gpu_checks, gpu_loading, gpu_models
from .gpu_checks import Check, h2o_budgets, random_ids
from .report import md_table
from .speed import RssSampler, decode, kv_numbers, prefill, synchronize

MB = 2**20


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    check_context: int  # tokens of history in the correctness checks
    check_steps: int  # decode steps compared there
    chunk: int  # prefill chunk of the checks, the decode and serving runs (the app's 256)
    contexts: tuple[int, ...]  # history lengths of the decode runs
    decode_tokens: int  # tokens per timed decode run
    repeats: int  # timed decode runs per cache
    batches: tuple[int, ...]  # conversations decoding as one batch
    history: int  # tokens each of them has read
    batch_steps: int  # timed batched decode steps
    prefill_tokens: int
    prefill_chunks: tuple[int, ...]
    confirm_rows: int  # the largest batch is confirmed by running at most this many rows
    memory_mb: float | None = None  # memory for the largest batch; None: what the device has free
    share: float = 0.2  # h2o's slots as a share of the history


PLANS = {
    "full": Plan(check_context=1024, check_steps=16, chunk=256, contexts=(4096, 16384, 32768), decode_tokens=32,
                 repeats=3, batches=(1, 4, 16, 64), history=4096, batch_steps=16, prefill_tokens=16384,
                 prefill_chunks=(256, 2048), confirm_rows=512),
    # A memory limit of its own keeps the tiny run's largest batches small enough to run.
    "tiny": Plan(check_context=64, check_steps=4, chunk=32, contexts=(64, 128), decode_tokens=4, repeats=2,
                 batches=(1, 4), history=96, batch_steps=2, prefill_tokens=128, prefill_chunks=(32, 64),
                 confirm_rows=8, memory_mb=0.5),
}
# Room kept free when projecting the largest batch: the allocator's fragmentation and
# the CUDA context's own buffers.
MEMORY_MARGIN = 0.9
# Allocations still alive after a run's caches are freed, at most (CUDA only).
LEFTOVER_BYTES = 8 * MB


# ---- memory ------------------------------------------------------------------------------


def in_use(device: torch.device) -> int:
    """Bytes in use: torch's allocations on a CUDA device, the process's RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def free_memory(device: torch.device) -> int:
    """Bytes that more caches could still take."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class PeakMemory:
    """Peak bytes in use while active (see ``in_use``; the RSS sampled every 2 ms)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._rss = RssSampler().__enter__()
        self.start = in_use(self.device)
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._rss.__exit__(*exc)
            self.peak = self._rss.peak


class Freed:
    """Whether every cache a run made is gone once the run drops it, and on CUDA whether
    the allocated bytes come back to where they were (what a turn must not leak)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.refs, self.leftover = device, [], 0
        self.baseline = in_use(device)

    def watch(self, cache) -> None:
        self.refs.append(weakref.ref(cache))

    def settle(self) -> None:
        """Called once a run's caches are dropped."""
        release(self.device)
        if self.device.type == "cuda":
            self.leftover = max(self.leftover, in_use(self.device) - self.baseline)

    def check(self) -> Check:
        alive = sum(ref() is not None for ref in self.refs)
        cuda = self.device.type == "cuda"
        measured = f"{alive} of {len(self.refs)} caches still alive after their runs"
        if cuda:
            measured += (f"; at most {self.leftover / MB:.1f} MiB still allocated after a run "
                         f"(limit {LEFTOVER_BYTES / MB:.0f} MiB)")
        passed = alive == 0 and (not cuda or self.leftover <= LEFTOVER_BYTES)
        return Check("memory freed between runs", passed, measured,
                     {"alive": alive, "caches": len(self.refs), "leftover_bytes": self.leftover if cuda else None})


# ---- measurements ------------------------------------------------------------------------


def cache_configs(model, history: int, share: float, stock: bool = False) -> list[tuple[str, Callable]]:
    """The caches compared at ``history`` tokens, by label."""
    budget = h2o_budgets(max(gpu_checks.SINK + 2, int(history * share)))
    label = f"h2o {share:.0%}"
    configs = [("full", lambda: make_cache(model, "full")),
               (label, lambda: make_cache(model, "h2o", **budget)),
               (f"{label} K8/V4", lambda: make_cache(model, "h2o", key_bits=8, value_bits=4, **budget))]
    if stock:
        configs.append(("stock DynamicCache", lambda: DynamicCache(config=model.config)))
    return configs


def measure_decode(model, plan: Plan, device: torch.device, freed: Freed, log) -> list[dict]:
    """Decode speed and memory per history length and cache. The timed runs continue one
    another, so the history grows by at most ``repeats x decode_tokens`` tokens."""
    rows = []
    for context in plan.contexts:
        ids = random_ids(model, context, device, seed=context)
        for name, make in cache_configs(model, context, plan.share, stock=True):
            with PeakMemory(device) as peak:
                cache = make()
                freed.watch(cache)
                logits = prefill(model, cache, ids, plan.chunk)
                decode(model, cache, logits, 1)  # the first step grows a full cache's buffers
                seconds = [decode(model, cache, logits, plan.decode_tokens) for _ in range(plan.repeats)]
            allocated, held_bytes, held = kv_numbers(cache)
            rate = [plan.decode_tokens / s for s in seconds]
            rows.append({"context": context, "cache": name, "decode_tok_s": statistics.median(rate),
                         "runs_tok_s": rate, "peak_mb": peak.peak / MB, "kv_allocated_mb": allocated / MB,
                         "kv_held_mb": held_bytes / MB, "held": held})
            del cache, logits
            freed.settle()
        full = next(r["decode_tok_s"] for r in rows if r["context"] == context and r["cache"] == "full")
        for row in rows:
            if row["context"] == context:
                row["vs_full"] = row["decode_tok_s"] / full
        log(f"  decode at {context}: " + ", ".join(f"{r['cache']} {r['decode_tok_s']:.1f} tok/s"
                                                  for r in rows if r["context"] == context))
    return rows


def decode_step(model, caches: list, tokens: torch.Tensor) -> torch.Tensor:
    """One step of every conversation, as the scheduler runs it: one row alone, more as
    one batch. The logits, ``(rows, vocab)``."""
    with torch.inference_mode():
        if len(caches) == 1:
            return forward_one(model, caches[0], tokens)[None]
        return torch.stack(forward_rows(model, caches, tokens))


def timed_steps(model, caches: list, steps: int, device: torch.device) -> tuple[float, PeakMemory]:
    """Seconds for ``steps`` greedy batched steps after one untimed step, and the peak
    memory of the timed ones."""
    tokens = torch.zeros((len(caches), 1), dtype=torch.long, device=device)
    tokens = decode_step(model, caches, tokens).argmax(-1, keepdim=True)
    with PeakMemory(device) as peak:
        started = time.perf_counter()
        for _ in range(steps):
            tokens = decode_step(model, caches, tokens).argmax(-1, keepdim=True)
        synchronize(device)
        seconds = time.perf_counter() - started
    return seconds, peak


def measure_serving(model, plan: Plan, device: torch.device, freed: Freed, log) -> tuple[list[dict], list[dict]]:
    """The batch sweep and the largest batch of each cache. Every conversation is a copy
    of one that read ``history`` random tokens: the same work per row as different
    histories, without a prefill per conversation."""
    ids = random_ids(model, plan.history, device, seed=11)
    rows, largest = [], []
    for name, make in cache_configs(model, plan.history, plan.share):
        base = make()
        freed.watch(base)
        prefill(model, base, ids, plan.chunk)
        step_bytes = conversation = 0
        for count in plan.batches:
            caches = []
            try:
                caches = [copy.deepcopy(base) for _ in range(count)]
                seconds, peak = timed_steps(model, caches, plan.batch_steps, device)
            except torch.OutOfMemoryError:  # the full cache's point: it stops fitting first
                rows.append({"cache": name, "conversations": count, "history": plan.history, "out_of_memory": True})
                log(f"  serve {name} x {count}: out of memory")
                del caches
                freed.settle()
                continue
            conversation = kv_numbers(caches[0])[0]
            step_bytes = max(0, peak.peak - peak.start) / count
            rows.append({"cache": name, "conversations": count, "history": plan.history, "out_of_memory": False,
                         "aggregate_tok_s": count * plan.batch_steps / seconds,
                         "per_row_tok_s": plan.batch_steps / seconds,
                         "kv_mb": sum(kv_numbers(c)[0] for c in caches) / MB,
                         "kv_held_mb": sum(kv_numbers(c)[1] for c in caches) / MB,
                         "step_mb_per_row": step_bytes / MB, "peak_mb": peak.peak / MB})
            log(f"  serve {name} x {count}: {rows[-1]['aggregate_tok_s']:.1f} tok/s aggregate")
            for cache in caches:
                freed.watch(cache)
            del caches
            freed.settle()
        largest.append(largest_batch(model, base, name, conversation, step_bytes, plan, device, freed))
        log(f"  largest batch {name}: {largest[-1]}")
        del base
        freed.settle()
    return rows, largest


def largest_batch(model, base, name: str, conversation: int, step_bytes: float, plan: Plan,
                  device: torch.device, freed: Freed) -> dict:
    """The most conversations like ``base`` that fit: projected from one conversation's
    bytes and a step's bytes per row, then run (at most ``plan.confirm_rows`` rows; 10%
    fewer after each out-of-memory error)."""
    free = free_memory(device) if plan.memory_mb is None else plan.memory_mb * MB
    # No conversation measured (one alone did not fit): nothing to project from.
    projected = int(free * MEMORY_MARGIN // (conversation + step_bytes)) if conversation else 0
    rows = min(projected, plan.confirm_rows)
    result = {"cache": name, "memory_mb": free / MB, "conversation_mb": conversation / MB,
              "step_mb_per_row": step_bytes / MB, "projected": projected, "confirmed": None, "aggregate_tok_s": None}
    while rows >= 1:
        caches = []
        try:
            caches = [copy.deepcopy(base) for _ in range(rows)]
            seconds, _ = timed_steps(model, caches, 2, device)
        except torch.OutOfMemoryError:
            del caches
            freed.settle()
            rows = int(rows * 0.9)
            continue
        result.update(confirmed=rows, aggregate_tok_s=2 * rows / seconds)
        for cache in caches:
            freed.watch(cache)
        del caches
        freed.settle()
        break
    return result


def measure_prefill(model, plan: Plan, device: torch.device, freed: Freed, log) -> list[dict]:
    ids = random_ids(model, plan.prefill_tokens, device, seed=5)
    rows = []
    for chunk in plan.prefill_chunks:
        for name, make in cache_configs(model, plan.prefill_tokens, plan.share)[:2]:
            with PeakMemory(device) as peak:
                cache = make()
                freed.watch(cache)
                started = time.perf_counter()
                prefill(model, cache, ids, chunk)
                seconds = time.perf_counter() - started
            rows.append({"cache": name, "tokens": plan.prefill_tokens, "chunk": chunk,
                         "prefill_tok_s": plan.prefill_tokens / seconds, "peak_mb": peak.peak / MB})
            del cache
            freed.settle()
        log(f"  prefill in {chunk}-token chunks: " + ", ".join(
            f"{r['cache']} {r['prefill_tok_s']:.0f} tok/s" for r in rows if r["chunk"] == chunk))
    return rows


# ---- the run -------------------------------------------------------------------------------


def run_model(name: str, plan: Plan, device: torch.device, log) -> dict:
    started = time.perf_counter()
    if name == gpu_models.SMOLLM2:
        label, model = "SmolLM2-135M-Instruct, real weights", gpu_models.load_smollm2(device)
    else:
        shape = gpu_models.SHAPES[name]
        label, model = shape.label, gpu_models.build(shape, device)
    config = model.config
    log(f"gpu check: {label} on {device}")
    result = {"model": name, "label": label, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
              "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
              "dtype": str(model.dtype), "weights_mb": in_use(device) / MB if device.type == "cuda" else None}
    checks = gpu_checks.run(model, plan.check_context, plan.check_steps, plan.chunk, device)
    release(device)
    freed = Freed(device)
    result["decode"] = measure_decode(model, plan, device, freed, log)
    result["serving"], result["largest_batch"] = measure_serving(model, plan, device, freed, log)
    result["prefill"] = measure_prefill(model, plan, device, freed, log)
    result["checks"] = [asdict(c) for c in [*checks, freed.check()]]
    for check in result["checks"]:
        log(f"  {'PASS' if check['passed'] else 'FAIL'} {check['name']}: {check['measured']}")
    result["seconds"] = round(time.perf_counter() - started, 1)
    del model
    release(device)
    return result


def run(model_names: list[str], plan: Plan, device: torch.device, log=print) -> dict:
    """The check on each of ``model_names`` (``gpu_models.MODEL_NAMES``)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (no GPU, or a CPU-only torch); "
                         "use --device cpu --tiny for the CPU variant")
    models, skipped = [], []
    for name in model_names:
        why = gpu_models.smollm2_missing() if name == gpu_models.SMOLLM2 else None
        if why:
            skipped.append({"model": name, "why": why})
            log(f"gpu check: {name} skipped: {why}")
            continue
        models.append(run_model(name, plan, device, log))
    loading, branches = gpu_loading.run(device)
    for check in loading:
        log(f"  {'PASS' if check.passed else 'FAIL'} {check.name}: {check.measured}")
    checks = [c["passed"] for m in models for c in m["checks"]] + [c.passed for c in loading]
    return {"device": str(device), "device_name": device_name(device), "plan": asdict(plan), "models": models,
            "skipped": skipped, "loading": [asdict(c) for c in loading], "loading_branches": branches,
            "passed": all(checks)}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return "CPU"


def markdown(result: dict) -> str:
    blocks = [f"Device: {result['device_name']}. Random weights measure speed, memory and equality, "
              "not the quality of the text."]
    for m in result["models"]:
        blocks.append(f"### {m['label']}\n\n{m['layers']} layers, {m['hidden']} hidden, {m['heads']} query heads, "
                      f"{m['kv_heads']} KV heads, {m['dtype'].removeprefix('torch.')}"
                      + (f", {m['weights_mb']:.0f} MiB of weights" if m["weights_mb"] else ""))
        blocks.append(md_table(["check", "result", "measured"],
                               [[c["name"], "pass" if c["passed"] else "FAIL", c["measured"]] for c in m["checks"]]))
        blocks.append(md_table(["history", "cache", "decode tok/s", "vs full", "peak memory MiB", "KV MiB allocated",
                                "KV MiB in use"],
                               [[r["context"], r["cache"], r["decode_tok_s"], f"{r['vs_full']:.2f}×", r["peak_mb"],
                                 r["kv_allocated_mb"], r["kv_held_mb"]] for r in m["decode"]]))
        blocks.append(md_table(["conversations", "cache", "aggregate tok/s", "per row tok/s", "KV MiB allocated",
                                "step MiB per row"],
                               [[r["conversations"], r["cache"], "out of memory", "", "", ""] if r["out_of_memory"] else
                                [r["conversations"], r["cache"], r["aggregate_tok_s"], r["per_row_tok_s"], r["kv_mb"],
                                 r["step_mb_per_row"]] for r in m["serving"]]))
        blocks.append(md_table(["cache", "largest batch (projected)", "ran", "aggregate tok/s there", "MiB a conversation",
                                "memory MiB"],
                               [[r["cache"], r["projected"], r["confirmed"], r["aggregate_tok_s"], r["conversation_mb"],
                                 r["memory_mb"]] for r in m["largest_batch"]]))
        blocks.append(md_table(["prefill tokens", "chunk", "cache", "prefill tok/s", "peak memory MiB"],
                               [[r["tokens"], r["chunk"], r["cache"], r["prefill_tok_s"], r["peak_mb"]]
                                for r in m["prefill"]]))
    blocks.append("### Loading a saved model through load_model\n\n" + md_table(
        ["check", "result", "measured"],
        [[c["name"], "pass" if c["passed"] else "FAIL", c["measured"]] for c in result["loading"]]))
    notes = [f"- {s['model']}: not run: {s['why']}" for s in result["skipped"]]
    notes += [f"- {b['branch']}: not run: {b['why_not']}" for b in result["loading_branches"] if not b["ran"]]
    if result["device"] == "cpu":
        notes.append("- model.device cuda and auto (device_map), model.quantization 8bit and 4bit "
                     "(bitsandbytes): not run: they need CUDA")
    blocks.extend(["\n".join(notes)] if notes else [])
    return "\n\n".join(blocks)
