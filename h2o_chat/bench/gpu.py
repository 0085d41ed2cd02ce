"""The GPU check: ``python -m h2o_chat.bench gpu [--device cuda|cpu] [--tiny] [--gpu-models 1b,8b]``.

Runs with nothing downloaded, on random-weight Llamas of real shapes built on the device
(``gpu_models.py``; quality is not measured there), and the embedded SmolLM2 where its
package is installed. Every decode step is the scheduler's own (``engine.step.DecodeStep``:
one batched step for every row, replayed as a CUDA graph on a GPU, the rows' next tokens
drawn at once). Per model:

1. correctness on the device (``gpu_checks.py``), and that every cache is freed between runs;
2. one conversation at ``history`` tokens: decode tokens/s, peak memory and KV bytes for
   the full cache, h2o at 20% of the history (float slots, K8/V4 and K4/V4 with the 16
   newest tokens exact), and stock ``DynamicCache`` decoding through the model's own loop
   (the reference);
3. serving: B conversations with unlike histories (``bases`` distinct ones, of different
   lengths and so different kept positions; copies of them past that) decoding as one
   batch: aggregate and per-row tokens/s, KV bytes, and the same rows going on through
   the app's scheduler with a reader thread per row, as turns run (``scheduled.py``: the
   step's rate less the scheduler's host work per row); then the largest B that fits in memory
   for the full cache, float h2o and K8/V4, projected from the measured bytes and confirmed
   by running it (the H2O paper's throughput argument: a smaller cache fits a bigger batch);
4. what a step costs (torch.profiler): kernels the GPU ran, launches the host made,
   reads of the device, GPU busy time against wall time and the heaviest kernels by name,
   at one row, the most rows of the sweep and each largest batch;
5. prefill tokens/s of a long prompt in chunks;
6. the decode step's kernels alone at ``kernel_rows`` rows against the torch path they
   replace, the attention kernel at several launch settings, and a step's draws, greedy,
   unseeded and seeded (``gpu_kernels.py``).

Then a small random model saved as a model folder is loaded back through ``load_model``
with every placement the device allows, CUDA-only ones included (``device_map``,
bitsandbytes), see ``gpu_loading.py``; those that cannot run are listed with why.

A lent GPU's minutes cannot rerun anything, so every part (each correctness check, each
cache's decode and serving runs, prefill, the kernels, each loading placement) that raises
becomes a failed check naming the error, and the parts after it still run; and the result
so far is written (``gpu.json``, ``gpu.md``) after every part, so a run its time limit cuts
leaves what it measured.

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
from h2o_chat.engine.step import DecodeStep
from h2o_chat.fused_norms import FusedRMSNorm
from h2o_chat.fused_projections import FusedAttention, FusedMLP
from h2o_chat.generation import Generation
from h2o_chat.sampling import Draw, Sampling, draw_tokens
from h2o_chat.scheduler import BatchScheduler

from . import gpu_checks, gpu_kernels, gpu_loading, gpu_models, scheduled
from .gpu_checks import Check, h2o_budgets, random_ids
from .report import md_table
from .speed import RssSampler, decode, kv_numbers, prefill, synchronize
from .step import profile_step

MB = 2**20


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    check_context: int  # tokens of history in the correctness checks
    check_steps: int  # decode steps compared there
    chunk: int  # prefill chunk of the checks, the decode and serving runs (the app's 256)
    history: int  # tokens of history of the decode and serving runs
    decode_tokens: int  # tokens per timed decode run
    repeats: int  # timed decode runs per cache
    batches: tuple[int, ...]  # conversations decoding as one batch
    bases: int  # distinct conversations the serving rows are drawn from
    batch_steps: int  # timed batched decode steps
    scheduled_steps: int  # timed steps of the same rows through the app's scheduler
    prefill_tokens: int
    prefill_chunks: tuple[int, ...]
    max_rows: int  # the largest batch is searched up to this many rows
    memory_mb: float | None = None  # memory for the largest batch; None: what the device has free
    share: float = 0.2  # h2o's slots as a share of the history
    kernel_rows: int = 512  # rows of the kernels timed alone (``gpu_kernels.py``)


PLANS = {
    "full": Plan(check_context=1024, check_steps=16, chunk=256, history=4096, decode_tokens=64, repeats=3,
                 batches=(1, 16, 64), bases=16, batch_steps=16, scheduled_steps=64, prefill_tokens=16384, prefill_chunks=(2048,),
                 max_rows=16384),
    # A memory limit of its own keeps the tiny run's largest batches small enough to run.
    "tiny": Plan(check_context=64, check_steps=4, chunk=32, history=96, decode_tokens=4, repeats=2,
                 batches=(1, 4), bases=3, batch_steps=2, scheduled_steps=4, prefill_tokens=128, prefill_chunks=(32, 64),
                 max_rows=8, memory_mb=0.5, kernel_rows=4),
}
# Room kept free when projecting the largest batch: the allocator's fragmentation and
# the CUDA context's own buffers.
MEMORY_MARGIN = 0.9
# Allocations still alive after a run's caches are freed, at most (CUDA only).
LEFTOVER_BYTES = 8 * MB
GREEDY = Sampling(temperature=0)
# Quantized slots beside float h2o's, at the same slots: each design's storage and the
# speed against float h2o it must keep (K8/V4: the throughput issue's; K4/V4 with its exact
# window: the design quality at equal bytes chose).
QUANTIZED = {"K8/V4": (dict(key_bits=8, value_bits=4), 0.8),
             "K4/V4 +16 exact": (dict(key_bits=4, value_bits=4, exact_window=16), 0.9)}
# The caches of ``cache_configs`` whose largest batch is searched: the full cache, float h2o
# and K8/V4 (the last design is compared at the sweep's batches; its search would cost a
# GPU run's minutes for no target).
LARGEST_SEARCHED = 3
# The draws are timed at one row, at this many (the serving target's conversations) and
# at ``kernel_rows``.
TIMED_DRAW_ROWS = 64
# Steps a serving run takes beside its timed ones: three to warm up, one profiled.
STEP_ROOM = 4
# Tokens the rows draw through the scheduler before its steps are timed.
SCHEDULED_WARM = 3
# The check's parts, in the order they run; "largest" is the largest-batch search of
# "serving", "loading" the load_model placements after every model.
PARTS = ("checks", "decode", "serving", "largest", "prefill", "kernels", "loading")


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
    the allocated bytes come back after each run to where the first run left them (what a
    turn must not leak). The first run is the baseline because what first use allocates
    once stays by design: on an H200 a dropped step left 64-96 MiB, the matrix libraries'
    workspaces of its stream, which torch keeps per stream (``graphs.capture_stream``)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.refs, self.leftover = device, [], 0
        self.lingering = 0  # the most caches still alive right after a run dropped them
        self.before = in_use(device)
        self.baseline: int | None = None  # in use once the first run was dropped

    def watch(self, *caches) -> None:
        # No loop variable here outlives the call: one left bound to a batch's last cache
        # kept the whole batch alive (each row reaches the step's batch through its
        # counters), which the check then reported as memory not freed.
        self.refs.extend(map(weakref.ref, caches))

    def settle(self) -> None:
        """Called once a run's caches are dropped (outside any ``except`` block: a caught
        error's traceback holds the frames, and so the caches, of the run that raised)."""
        release(self.device)
        self.lingering = max(self.lingering, sum(ref() is not None for ref in self.refs))
        if self.device.type == "cuda":
            now = in_use(self.device)
            if self.baseline is None:
                self.baseline = now
            self.leftover = max(self.leftover, now - self.baseline)

    def check(self) -> Check:
        alive = sum(ref() is not None for ref in self.refs)
        cuda = self.device.type == "cuda"
        measured = (f"{alive} of {len(self.refs)} caches alive at the end, at most {self.lingering} right after "
                    f"their run")
        first = (self.baseline - self.before) if cuda and self.baseline is not None else None
        if cuda:
            measured += (f"; at most {self.leftover / MB:.1f} MiB more allocated after a run than after the first "
                         f"(limit {LEFTOVER_BYTES / MB:.0f} MiB)"
                         + (f"; the first run kept {first / MB:.1f} MiB (first use)" if first is not None else ""))
        passed = alive == 0 and self.lingering == 0 and (not cuda or self.leftover <= LEFTOVER_BYTES)
        return Check("memory freed between runs", passed, measured,
                     {"alive": alive, "lingering": self.lingering, "caches": len(self.refs),
                      "leftover_bytes": self.leftover if cuda else None, "first_run_bytes": first})


# ---- the scheduler's step ------------------------------------------------------------------


class Rows:
    """Conversations decoding together as the scheduler decodes them: one ``DecodeStep``
    per call, every row's next token drawn at once (greedy). ``add`` makes a
    conversation a row of the step's pools at once (room for ``room`` rows), so a large
    batch never holds every conversation's own buffers beside the pool; ``close`` lets
    go of what the step holds (the pools' rows, the captured graphs)."""

    def __init__(self, model, room: int = 1) -> None:
        self.model, self.caches, self.step = model, [], DecodeStep()
        self.room = self.step.batch_rows(model, room)

    def add(self, cache) -> None:
        self.step.join([cache], self.room)
        self.caches.append(cache)

    def __call__(self) -> None:
        with torch.inference_mode():
            logits = self.step(self.model, self.caches, self.tokens)
            self.tokens = draw_tokens(logits, list(range(len(self.caches))), [Draw(GREEDY)] * len(self.caches))

    def timed(self, steps: int, device: torch.device, warm: int = 3) -> tuple[float, PeakMemory]:
        """Seconds for ``steps`` steps after ``warm`` untimed ones (the step runs eagerly
        once, is captured once), and the peak memory of them all (a captured graph holds
        the memory of its step from its capture on)."""
        if warm:
            self.tokens = [0] * len(self.caches)
        with PeakMemory(device) as peak:
            for _ in range(warm):
                self()
            started = time.perf_counter()
            for _ in range(steps):
                self()
            synchronize(device)
            seconds = time.perf_counter() - started
        return seconds, peak

    @property
    def graphs(self) -> str:
        """How the steps ran: replayed graphs, or why not."""
        if self.step.graph_failure:
            return f"eager: capture failed ({self.step.graph_failure})"
        return f"{self.step.graph_replays} replays" if self.step.graph_replays else "eager"

    def close(self) -> None:
        """Drop the rows with the step: no conversation moves out of its pool into buffers
        of its own (what a turn's end does), which a full device would not have room for."""
        self.caches = []
        self.step = None


# ---- measurements ------------------------------------------------------------------------


def cache_configs(model, history: int, share: float) -> list[tuple[str, Callable]]:
    """The caches compared at ``history`` tokens, by label."""
    budget = h2o_budgets(max(gpu_checks.SINK + 2, int(history * share)))
    label = h2o_label(share)
    return [("full", lambda: make_cache(model, "full")),
            (label, lambda: make_cache(model, "h2o", **budget)),
            *((f"{label} {design}", lambda storage=storage: make_cache(model, "h2o", **storage, **budget))
              for design, (storage, _) in QUANTIZED.items())]


def unlike(model, make: Callable, plan: Plan, count: int, device: torch.device, steps: int) -> Rows:
    """``count`` conversations as rows: ``plan.bases`` distinct ones read random histories
    of different lengths (up to ``plan.history``); the rows are copies of them in turn.
    A full cache has room reserved for the ``steps`` it will take, as a server would give
    it for its reply: grown during the run, its pool would reallocate, twice its memory."""
    bases = []
    for index in range(min(count, plan.bases)):
        length = plan.history - index * plan.history // (4 * plan.bases)
        cache = make()
        prefill(model, cache, random_ids(model, length, device, seed=100 + index), plan.chunk)
        cache.fit_for_decoding()
        cache.reserve(steps)
        bases.append(cache)
    rows = Rows(model, count)
    for index in range(count):
        rows.add(copy.deepcopy(bases[index % len(bases)]))
    return rows


def decode_row(model, name: str, make: Callable | None, ids: torch.Tensor, plan: Plan, device: torch.device,
               freed: Freed) -> dict:
    """One conversation of ``ids`` on the cache ``make`` gives, through the scheduler's
    step; ``make`` None: stock ``DynamicCache`` through the model's own decode loop."""
    with PeakMemory(device) as peak:
        if make is None:
            cache = DynamicCache(config=model.config)
            logits = prefill(model, cache, ids, plan.chunk)
            decode(model, cache, logits, 1)  # the first step grows the buffers
            seconds = [decode(model, cache, logits, plan.decode_tokens) for _ in range(plan.repeats)]
        else:
            cache = make()
            prefill(model, cache, ids, plan.chunk)
            cache.fit_for_decoding()
            one = Rows(model)
            one.add(cache)
            seconds = [one.timed(plan.decode_tokens, device, warm=3 if not index else 0)[0]
                       for index in range(plan.repeats)]
            one.close()
    freed.watch(cache)
    allocated, held_bytes, held = kv_numbers(cache)
    rate = [plan.decode_tokens / s for s in seconds]
    return {"history": plan.history, "cache": name, "decode_tok_s": statistics.median(rate), "runs_tok_s": rate,
            "peak_mb": peak.peak / MB, "kv_allocated_mb": allocated / MB, "kv_held_mb": held_bytes / MB, "held": held}


def serve(model, name: str, make: Callable, search: bool, plan: Plan, device: torch.device, freed: Freed, log,
          sweep: list[dict], costs: list[dict]) -> dict | None:
    """The batch sweep of one cache into ``sweep`` (as each batch ends: a later failure
    keeps it), what its steps cost into ``costs``, and its largest batch if ``search``."""
    conversation = step_bytes = 0
    for count in plan.batches:
        rows = unlike(model, make, plan, count, device,
                      STEP_ROOM + plan.batch_steps + SCHEDULED_WARM + plan.scheduled_steps + 1)
        seconds, peak = rows.timed(plan.batch_steps, device)
        if count in (plan.batches[0], plan.batches[-1]):
            costs.append({"cache": name, "conversations": count} | profile_step(rows, device))
            log(f"  step cost {name} x {count}: {costs[-1]}")
        caches = rows.caches
        conversation = kv_numbers(caches[0])[0]
        # What a step takes beyond the caches (activations, a captured graph's pool), from
        # the allocator on CUDA; a CPU's resident memory moves too much to tell per row.
        step_bytes = max(0, peak.peak - peak.start) / count if device.type == "cuda" else 0
        sweep.append({"cache": name, "conversations": count, "history": plan.history,
                      "aggregate_tok_s": count * plan.batch_steps / seconds, "per_row_tok_s": plan.batch_steps / seconds,
                      "kv_mb": sum(kv_numbers(c)[0] for c in caches) / MB,
                      "kv_held_mb": sum(kv_numbers(c)[1] for c in caches) / MB,
                      "step_mb_per_row": step_bytes / MB, "peak_mb": peak.peak / MB, "graphs": rows.graphs})
        sweep[-1]["scheduled_tok_s"] = through_scheduler(model, rows, plan, device)
        log(f"  serve {name} x {count}: {sweep[-1]['aggregate_tok_s']:.1f} tok/s aggregate ({rows.graphs}), "
            f"through the scheduler {sweep[-1]['scheduled_tok_s'] or 0:.1f}")
        freed.watch(*caches)
        rows.close()
        del caches, rows
        freed.settle()
    if not search:
        return None
    largest = largest_batch(model, make, name, conversation, step_bytes, plan, device, freed)
    log(f"  largest batch {name}: {largest}")
    return largest


def through_scheduler(model, rows: Rows, plan: Plan, device: torch.device) -> float | None:
    """Aggregate tokens/s of ``rows`` decoding on through the app's scheduler on their step
    (its pools and graphs), each row read by a thread as a turn reads its reply: the
    step's rate less the scheduler's host work per row. Each row's turn then ends, and its
    cache leaves the pool into buffers of its own, as a turn's end makes it: None (not
    run) where the device has no room for those beside the pool."""
    caches = rows.caches
    if free_memory(device) * MEMORY_MARGIN < sum(kv_numbers(cache)[0] for cache in caches):
        return None
    tokens = SCHEDULED_WARM + plan.scheduled_steps + 1
    sampling = Sampling(max_new_tokens=tokens, temperature=0, min_new_tokens=tokens)
    generations = [Generation(cache, [0] * cache.get_seq_length() + [token], cache.get_seq_length(), sampling,
                              chunk=plan.chunk, reply=[]) for cache, token in zip(caches, rows.tokens)]
    scheduler = BatchScheduler(model, gather_s=scheduled.GATHER_S, max_batch=len(caches), step=rows.step)
    step_ms = scheduled.time_steps(scheduler, generations, SCHEDULED_WARM, SCHEDULED_WARM + plan.scheduled_steps)
    return len(caches) * 1000 / step_ms


def largest_batch(model, make: Callable, name: str, conversation: int, step_bytes: float, plan: Plan,
                  device: torch.device, freed: Freed) -> dict:
    """The most conversations that fit: projected from one conversation's bytes and a
    step's bytes per row, then run (at most ``plan.max_rows`` rows, a batch size a
    captured step computes without padding; the next smaller after an out-of-memory
    error), and one more step of the rows that ran profiled: where its time goes there."""
    free = free_memory(device) if plan.memory_mb is None else plan.memory_mb * MB
    projected = int(free * MEMORY_MARGIN // (conversation + step_bytes)) if conversation else 0
    step = DecodeStep()
    sizes = [n for n in range(1, min(projected, plan.max_rows) + 1) if step.batch_rows(model, n) == n]
    result = {"cache": name, "memory_mb": free / MB, "conversation_mb": conversation / MB,
              "step_mb_per_row": step_bytes / MB, "projected": projected, "confirmed": None, "aggregate_tok_s": None,
              "graphs": None, "step_cost": None}
    while sizes:
        count, rows = sizes.pop(), None
        try:
            rows = unlike(model, make, plan, count, device, STEP_ROOM + plan.batch_steps)
            seconds, _ = rows.timed(plan.batch_steps, device)
        except torch.OutOfMemoryError:
            fitted = False
        else:
            fitted = True
            result.update(confirmed=count, aggregate_tok_s=count * plan.batch_steps / seconds, graphs=rows.graphs)
            try:  # a diagnostic, whose failure must not cost the measurement above
                result["step_cost"] = profile_step(rows, device)
            except Exception as err:
                result["step_cost"] = {"error": f"{type(err).__name__}: {err}"}
        if rows is not None:
            freed.watch(*rows.caches)
            rows.close()
        del rows
        freed.settle()  # outside the except block: its traceback held the caches
        if fitted:
            break
    return result


def measure_prefill(model, plan: Plan, device: torch.device, freed: Freed, log, rows: list[dict]) -> None:
    """Prefill tokens/s of the full cache and float h2o into ``rows``."""
    ids = random_ids(model, plan.prefill_tokens, device, seed=5)
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


# ---- the run -------------------------------------------------------------------------------


def run_model(name: str, plan: Plan, device: torch.device, parts: frozenset[str], log,
              progress: Callable[[dict], None]) -> dict:
    """The check on one model; ``progress`` is given the result as far as it goes after
    each part (a run cut by its time limit still leaves what it measured). A part that
    raises becomes a failed check and the parts after it still run."""
    started = time.perf_counter()
    if name == gpu_models.SMOLLM2:
        label, model = "SmolLM2-135M-Instruct, real weights", gpu_models.load_smollm2(device)
    else:
        shape = gpu_models.SHAPES[name]
        label, model = shape.label, gpu_models.build(shape, device)
    config = model.config
    fused = {kind: sum(isinstance(module, cls) for module in model.modules())
             for kind, cls in (("norms", FusedRMSNorm), ("attentions", FusedAttention), ("mlps", FusedMLP))}
    log(f"gpu check: {label} on {device}, fused: {fused['norms']} norms, {fused['attentions']} attentions, "
        f"{fused['mlps']} MLPs")
    result = {"model": name, "label": label, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
              "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
              "fused_norms": fused["norms"], "fused_attentions": fused["attentions"], "fused_mlps": fused["mlps"],
              "dtype": str(model.dtype), "weights_mb": in_use(device) / MB if device.type == "cuda" else None,
              "decode": [], "serving": [], "step_costs": [], "largest_batch": [], "prefill": [], "kernels": [],
              "draws": [],
              "part_seconds": {}}
    checks: list[Check] = []

    def part(what: str, work: Callable, settle: Callable[[], None]):
        """``work()`` as one part, then ``settle()`` (outside the part's ``except``, whose
        traceback holds the failed part's caches)."""
        # Each part's seconds: what the next run on a lent GPU plans its few minutes by.
        begun = time.perf_counter()
        value, failure = gpu_checks.attempt(f"{what} ran to its end", work)
        result["part_seconds"][what] = round(time.perf_counter() - begun, 1)
        if failure:
            checks.append(failure)
            log(f"  {verdict(False)} {failure.name}: {failure.measured}")
        settle()
        return value

    def report() -> None:
        result["checks"] = [asdict(c) for c in checks]
        progress(result)

    if "checks" in parts:
        # Logged at once: a run cut short by its time limit still tells the checks' verdicts.
        for check in part("the correctness checks", lambda: gpu_checks.run(
                model, plan.check_context, plan.check_steps, plan.chunk, device), lambda: release(device)) or []:
            checks.append(check)
            log(f"  {verdict(check.passed)} {check.name}: {check.measured}")
        report()
    freed = Freed(device)
    configs = cache_configs(model, plan.history, plan.share)
    if "decode" in parts:
        ids = random_ids(model, plan.history, device, seed=plan.history)
        for cache_name, make in [*configs, ("stock DynamicCache", None)]:
            row = part(f"decode, {cache_name}", lambda: decode_row(model, cache_name, make, ids, plan, device, freed),
                       freed.settle)
            result["decode"].extend([row] if row else [])
        full = [r["decode_tok_s"] for r in result["decode"] if r["cache"] == "full"]
        for row in result["decode"]:
            row["vs_full"] = row["decode_tok_s"] / full[0] if full else None
        log("  decode: " + ", ".join(f"{r['cache']} {r['decode_tok_s']:.1f} tok/s" for r in result["decode"]))
        del ids
        report()
    if "serving" in parts:
        for index, (cache_name, make) in enumerate(configs):
            search = index < LARGEST_SEARCHED and "largest" in parts
            largest = part(f"serving, {cache_name}", lambda: serve(
                model, cache_name, make, search, plan, device, freed, log, result["serving"], result["step_costs"]),
                freed.settle)
            result["largest_batch"].extend([largest] if largest else [])
            report()
    if "prefill" in parts:
        part("prefill", lambda: measure_prefill(model, plan, device, freed, log, result["prefill"]), freed.settle)
        report()
    if "kernels" in parts:
        result["kernels"] = part("the kernels alone", lambda: gpu_kernels.run(
            model, plan.kernel_rows, int(plan.history * plan.share), device), lambda: release(device)) or []
        for row in result["kernels"]:
            log(f"  {row['what']}, {row['path']}: {row['ms']:.3f} ms, {row['gb_s']:.0f} GB/s held")
        result["draws"] = part("the draws alone", lambda: gpu_kernels.draw_rows(
            model, tuple(sorted({1, TIMED_DRAW_ROWS, plan.kernel_rows})), device), lambda: release(device)) or []
        log("  draws: " + ", ".join(f"{r['path']} {r['rows']} rows {r['ms']:.3f} ms" for r in result["draws"]))
    freed_check = freed.check()
    checks.append(freed_check)
    log(f"  {verdict(freed_check.passed)} {freed_check.name}: {freed_check.measured}")
    result["seconds"] = round(time.perf_counter() - started, 1)
    report()
    del model
    release(device)
    return result


def run(model_names: list[str], plan: Plan, device: torch.device, parts: frozenset[str] = frozenset(PARTS),
        log=print, progress: Callable[[dict], None] = lambda result: None) -> dict:
    """The check's ``parts`` (``PARTS``) on each of ``model_names``
    (``gpu_models.MODEL_NAMES``); ``progress`` is given the whole result as far as it goes
    (``complete`` False) after each part."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (no GPU, or a CPU-only torch); "
                         "use --device cpu --tiny for the CPU variant")
    models, skipped = [], []

    def summary(current: list[dict], loading: list[Check], branches: list[dict], complete: bool) -> dict:
        checks = [c["passed"] for m in current for c in m.get("checks", [])] + [c.passed for c in loading]
        return {"device": str(device), "device_name": device_name(device), "plan": asdict(plan),
                "models": current, "skipped": skipped, "loading": [asdict(c) for c in loading],
                "loading_branches": branches, "parts": [part for part in PARTS if part in parts],
                "complete": complete,
                "passed": all(passed for passed in checks if passed is not None)}

    for name in model_names:
        why = gpu_models.smollm2_missing() if name == gpu_models.SMOLLM2 else None
        if why:
            skipped.append({"model": name, "why": why})
            log(f"gpu check: {name} skipped: {why}")
            continue
        model, failure = gpu_checks.attempt(f"{name}: the model's check ran to its end", lambda: run_model(
            name, plan, device, parts, log, lambda current: progress(summary([*models, current], [], [], False))))
        if failure:
            log(f"  {verdict(False)} {failure.name}: {failure.measured}")
            release(device)
        models.append(model or {"model": name, "label": name, "checks": [asdict(failure)]})
        progress(summary(models, [], [], False))
    loading, branches = [], []
    if "loading" in parts:
        loaded, failure = gpu_checks.attempt("loading a saved model through load_model ran to its end",
                                             lambda: gpu_loading.run(device))
        loading, branches = loaded or ([failure], [])
    for check in loading:
        log(f"  {verdict(check.passed)} {check.name}: {check.measured}")
    return summary(models, loading, branches, True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return "CPU"


def verdict(passed: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "measured"}[passed]


def checks_table(checks: list[dict]) -> str:
    return md_table(["check", "result", "measured"], [[c["name"], verdict(c["passed"]), c["measured"]] for c in checks])


def h2o_label(share: float) -> str:
    return f"h2o {share:.0%}"


def ratios(model: dict, share: float) -> list[str]:
    """The issue's GPU targets, from one model's run (those its finished parts give)."""
    full, h2o = "full", h2o_label(share)
    decode = {r["cache"]: r["decode_tok_s"] for r in model.get("decode", [])}
    serving = {(r["cache"], r["conversations"]): r["aggregate_tok_s"] for r in model.get("serving", [])}
    largest = {r["cache"]: r["aggregate_tok_s"] for r in model.get("largest_batch", [])}
    lines = []
    if decode:
        lines.append("one conversation: " + ", ".join(f"{name} {rate:.0f} tok/s" for name, rate in decode.items()))
    if serving:
        most = max(n for _, n in serving)
        lines.append(f"{most} conversations: " + ", ".join(f"{name} {rate:.0f} tok/s aggregate"
                                                         for (name, n), rate in serving.items() if n == most))
        scheduled_rates = [(r["cache"], r["scheduled_tok_s"] / r["aggregate_tok_s"]) for r in model["serving"]
                           if r["conversations"] == most and r.get("scheduled_tok_s") is not None]
        if scheduled_rates:
            lines.append(f"{most} conversations through the scheduler, a reader per row, against the step alone: "
                         + ", ".join(f"{name} {share:.2f}x" for name, share in scheduled_rates))
    for design, (_, target) in QUANTIZED.items():
        quantized = f"{h2o} {design}"
        for count in sorted({n for _, n in serving}):
            if (quantized, count) in serving and (h2o, count) in serving:
                lines.append(f"{quantized} / {h2o} at {count} conversations: "
                             f"{serving[quantized, count] / serving[h2o, count]:.2f}x (target >= {target}x)")
    if largest.get(full) and largest.get(h2o):
        rows = {r["cache"]: r["confirmed"] for r in model["largest_batch"]}
        lines.append(f"largest batch that fits: {h2o} {rows[h2o]} rows {largest[h2o]:.0f} tok/s, {full} {rows[full]} "
                     f"rows {largest[full]:.0f} tok/s: {largest[h2o] / largest[full]:.2f}x (target >= 3x)")
    return lines


def spent(cost: dict | None) -> str:
    """A profiled step's heaviest kinds of work, as a table's cell."""
    if not cost:
        return "–"
    if "error" in cost:
        return f"not profiled: {cost['error']}"
    return "; ".join(f"{name} {ms:.2f}" for name, ms in cost["heaviest"])


def step_time(cost: dict | None) -> str:
    """A profiled step's wall time (and on a GPU its busy time), as a table's cell."""
    if not cost or "error" in cost:
        return "–"
    busy = cost.get("gpu_busy_ms")
    return f"{cost['wall_ms']:.2f}" + ("" if busy is None else f" ({busy:.2f})")


def markdown(result: dict) -> str:
    blocks = [f"Device: {result['device_name']}. Random weights measure speed, memory and equality, "
              "not the quality of the text. Every decode step but stock DynamicCache's is the scheduler's "
              "(one batched step for every row, replayed as a CUDA graph on a GPU)."]
    if not result["complete"]:
        blocks.append("**Written while the run went on: it ended before the check did** (its time limit, or the "
                      "process stopped). The parts below are those that finished.")
    if len(result["parts"]) < len(PARTS):
        blocks.append(f"Parts run: {', '.join(result['parts'])} (of {', '.join(PARTS)}).")
    cuda = result["device"].startswith("cuda")
    heaviest = "heaviest: " + ("kernels, GPU ms" if cuda else "operations, ms")
    for m in result["models"]:
        if "layers" not in m:  # the model could not be built or checked
            blocks.append(f"### {m['label']}")
            blocks.append(checks_table(m["checks"]))
            continue
        blocks.append(f"### {m['label']}\n\n{m['layers']} layers, {m['hidden']} hidden, {m['heads']} query heads, "
                      f"{m['kv_heads']} KV heads, {m['dtype'].removeprefix('torch.')}, {m['fused_norms']} RMS norms "
                      f"fused, {m['fused_attentions']} attentions and {m['fused_mlps']} MLPs with stacked projections"
                      + (f", {m['weights_mb']:.0f} MiB of weights" if m["weights_mb"] else ""))
        blocks.extend([checks_table(m["checks"])] if m.get("checks") else [])
        tables = [
            (["history", "cache", "decode tok/s", "vs full", "peak memory MiB", "KV MiB allocated", "KV MiB in use"],
             [[r["history"], r["cache"], r["decode_tok_s"], "–" if r.get("vs_full") is None else f"{r['vs_full']:.2f}×",
               r["peak_mb"], r["kv_allocated_mb"], r["kv_held_mb"]] for r in m["decode"]]),
            (["conversations", "cache", "aggregate tok/s", "per row tok/s", "through the scheduler tok/s",
              "KV MiB allocated", "step MiB per row", "steps"],
             [[r["conversations"], r["cache"], r["aggregate_tok_s"], r["per_row_tok_s"],
               "not run (no room)" if r.get("scheduled_tok_s") is None else r["scheduled_tok_s"], r["kv_mb"],
               r["step_mb_per_row"], r["graphs"]] for r in m["serving"]]),
            (["conversations", "cache", "tensor ops issued", "host reads", "wall ms"]
             + (["kernels run", "launches", "GPU busy ms"] if cuda else []) + [heaviest],
             [[r["conversations"], r["cache"], r["ops"], r["host_reads"], r["wall_ms"]]
              + ([r["kernels"], r["launches"], r["gpu_busy_ms"]] if cuda else []) + [spent(r)]
              for r in m["step_costs"]]),
            (["cache", "largest batch (projected)", "ran", "aggregate tok/s there", "MiB a conversation", "memory MiB",
              "steps", "a step there: wall ms" + (" (GPU busy)" if cuda else ""), heaviest],
             [[r["cache"], r["projected"], r["confirmed"], r["aggregate_tok_s"], r["conversation_mb"], r["memory_mb"],
               r["graphs"], step_time(r.get("step_cost")), spent(r.get("step_cost"))] for r in m["largest_batch"]]),
            (["prefill tokens", "chunk", "cache", "prefill tok/s", "peak memory MiB"],
             [[r["tokens"], r["chunk"], r["cache"], r["prefill_tok_s"], r["peak_mb"]] for r in m["prefill"]]),
            (["kernel alone (one layer; eviction: every layer)", "path", "rows", "slots", "ms", "MiB of inputs",
              "GB/s of inputs"],
             [[r["what"], r["path"], r["rows"], r["slots"], f"{r['ms']:.3f}", f"{r['held_mb']:.1f}",
               f"{r['gb_s']:.0f}"] for r in m["kernels"]]),
            (["a step's draws", "rows", "vocabulary", "ms"],
             [[r["path"], r["rows"], r["vocab"], f"{r['ms']:.3f}"] for r in m["draws"]])]
        blocks.extend(md_table(header, rows) for header, rows in tables if rows)
        blocks.append("Seconds by part: " + "; ".join(f"{what} {seconds:g} s" for what, seconds
                                                       in m["part_seconds"].items()) + ".")
        lines = ratios(m, result["plan"]["share"])
        blocks.extend(["\n".join(f"- {line}" for line in lines)] if lines else [])
    if result["loading"]:
        blocks.append("### Loading a saved model through load_model\n\n" + checks_table(result["loading"]))
    notes = [f"- {s['model']}: not run: {s['why']}" for s in result["skipped"]]
    notes += [f"- {b['branch']}: not run: {b['why_not']}" for b in result["loading_branches"] if not b["ran"]]
    if result["device"] == "cpu" and result["complete"] and "loading" in result["parts"]:
        notes.append("- model.device cuda and auto (device_map), model.quantization 8bit and 4bit "
                     "(bitsandbytes): not run: they need CUDA")
    blocks.extend(["\n".join(notes)] if notes else [])
    return "\n\n".join(blocks)
