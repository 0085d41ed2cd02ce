"""The decode step's cost as conversations are added: what one scheduler step costs.

``python -m h2o_chat.bench step [--threads 1] [--step-rows 1,16,32] [--step-history 512] [--step-slots 128]``

Conversations with unlike histories (each its own passage of the book, behind a pinned
system prompt, as the app's chats are), each in a bounded cache of ``--step-slots``
slots (float32; 8-bit keys and 4-bit values; both 4-bit; both 4-bit with 16 exact newest
tokens), decode as the scheduler decodes them: one ``DecodeStep`` for every row, then
every row's next token drawn at once with the app's sampling settings. Per precision and
row count: tensor operations issued per step and reads of the device (torch.profiler,
deterministic), and the median time of a step over rounds that alternate every
precision and row count in one process. Then what drawing a step's tokens costs alone,
seeded rows against unseeded ones (the app's default).

``profile_step`` is also what the GPU check reports for the path the app runs.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from h2o_chat.config import GenerationConfig
from h2o_chat.engine.build import make_cache
from h2o_chat.engine.step import DecodeStep
from h2o_chat.sampling import Draw, Sampling, draw_tokens
from h2o_chat.scheduler import forward_one

from . import data
from .report import md_table

PRECISIONS = {"float32": {}, "K8/V4": dict(key_bits=8, value_bits=4), "K4/V4": dict(key_bits=4, value_bits=4),
              "K4/V4 +16 exact": dict(key_bits=4, value_bits=4, exact_window=16)}
SYSTEM_TOKENS = 24  # the pinned system prompt's share of each history
# The range ``stepper`` draws the rows' tokens in, as ``profile_step`` finds it.
DRAWING = "drawing tokens"
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
# How many kinds of work ``profile_step`` names as the heaviest of a step.
HEAVIEST = 6


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(run: Callable[[], object], device: torch.device) -> dict:
    """One call of ``run`` under torch.profiler: tensor operations issued from Python (the
    top-level aten calls), reads of the device by the host, and on CUDA the kernels the
    GPU ran, the launches the host made (a graph replay is one) and the GPU's busy time
    against the wall time; then the ``HEAVIEST`` kinds of work by time (``heaviest``:
    ``[name, ms]``, kernels on CUDA, operations' own time on the CPU)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - started
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::")
              and (e.cpu_parent is None or e.cpu_parent.name == DRAWING))
    # A draw's own ``.item()`` calls read the host's copy of the logits (one transfer,
    # counted on CUDA as a copy back), not the device.
    scalar_reads = sum(1 for e in events if e.name == "aten::_local_scalar_dense" and not _within(e, DRAWING))
    result = {"ops": ops, "host_reads": scalar_reads, "wall_ms": 1000 * wall}
    spent = Counter()  # milliseconds by kind of work
    if device.type == "cuda":
        device_events = [e for e in events if e.device_type == DeviceType.CUDA]
        for e in device_events:
            spent[kernel_name(e.name)] += e.time_range.elapsed_us() / 1000
        copies_back = sum(1 for e in device_events if "DtoH" in e.name)
        result |= {"host_reads": scalar_reads + copies_back,
                   "kernels": sum(1 for e in device_events if "Memcpy" not in e.name and "Memset" not in e.name),
                   "launches": sum(1 for e in events if e.name in _LAUNCHES),
                   "gpu_busy_ms": sum(spent.values())}
    else:  # the operations' own time: a CPU runs each where it is issued
        for e in events:
            if e.name.startswith("aten::"):
                spent[e.name] += e.self_cpu_time_total / 1000
    # Where the step's time goes, for a run that has no time to profile again: on a GPU
    # the kernels by name (a replayed graph's have no operation to name them by).
    result["heaviest"] = [[name, ms] for name, ms in spent.most_common(HEAVIEST)]
    return result


def kernel_name(name: str) -> str:
    """A CUDA kernel's name as a table can show it: without ``void``, namespaces and
    parameters, its template arguments (which tell an addition from a product) cut at 64
    characters."""
    name = re.sub(r"\b\w+::|\(anonymous namespace\)::", "", name.removeprefix("void "))
    depth = 0
    for at, char in enumerate(name):
        depth += (char == "<") - (char == ">")
        if char == "(" and depth == 0:
            name = name[:at]
            break
    return name[:64].strip()


def _within(event, name: str) -> bool:
    while event is not None:
        if event.name == name:
            return True
        event = event.cpu_parent
    return False


def conversations(model, tokenizer, count: int, history: int, slots: int, storage: dict,
                  policy: str = "h2o") -> list:
    """``count`` caches that read unlike histories of ``history`` tokens, the first
    ``SYSTEM_TOKENS`` pinned; a turns cache's history is two turns, the second open."""
    ids = tokenizer(data.read_text(data.BOOK), add_special_tokens=False).input_ids
    stride = max(1, (len(ids) - history) // max(1, count))
    caches = []
    with torch.inference_mode():
        for index in range(count):
            cache = make_cache(model, policy, heavy=(slots - 4) // 2, recent=(slots - 4) - (slots - 4) // 2,
                               sink=4, **storage)
            cache.protect(0, SYSTEM_TOKENS)
            cache.mark_turn(history // 2)  # only a turns cache keeps it
            passage = torch.tensor([ids[index * stride : index * stride + history]], device=model.device)
            for half in passage.split(history // 2, dim=1):
                for piece in half.split(256, dim=1):
                    forward_one(model, cache, piece)
            cache.fit_for_decoding()
            caches.append(cache)
    return caches


def stepper(model, caches: list, seed: int = 0) -> Callable[[], list[int]]:
    """One scheduler step of ``caches`` per call, each row feeding the token it drew last."""
    step = DecodeStep()
    settings = GenerationConfig()
    samplings = [Sampling(temperature=settings.temperature, top_p=settings.top_p, seed=seed + row)
                 for row in range(len(caches))]
    tokens = [0] * len(caches)
    drawn = 0  # tokens each row drew before: the index of its next in its reply

    def run() -> list[int]:
        nonlocal drawn
        with torch.inference_mode():
            logits = step(model, caches, tokens)
            with record_function(DRAWING):
                tokens[:] = draw_tokens(logits, list(range(len(caches))), [Draw(s, drawn) for s in samplings])
        drawn += 1
        return tokens

    return run


def run(model, tokenizer, rows: list[int], history: int, slots: int, rounds: int, steps: int,
        policies: tuple[str, ...] = ("h2o",), log=print) -> dict:
    """Every precision's and policy's step at every row count, timed in rounds that
    alternate them all, so that their ratios come from the same minutes."""
    device = model.device
    results, runs = [], {}
    for precision, storage in PRECISIONS.items():
        for policy in policies:
            for count in rows:
                run = stepper(model, conversations(model, tokenizer, count, history, slots, storage, policy))
                for _ in range(3):  # the rows join the pools; graphs are captured on CUDA
                    run()
                runs[precision, policy, count] = run
                results.append({"precision": precision, "policy": policy, "rows": count}
                               | profile_step(run, device))
    seconds = alternating(runs, rounds, steps, device)
    for result in results:
        key = (result["precision"], result["policy"], result["rows"])
        result["step_ms"] = 1000 * statistics.median(seconds[key])
        result["step_ms_runs"] = [1000 * s for s in seconds[key]]
    for precision in PRECISIONS:
        log(f"step {precision}: " + ", ".join(f"{r['policy']} {r['rows']} rows {r['step_ms']:.1f} ms, {r['ops']} ops"
                                               for r in results if r["precision"] == precision))
    draws = draw_costs(model, tokenizer, rows, rounds)
    log("draws: " + ", ".join(f"{r['rows']} rows {'seeded' if r['seeded'] else 'unseeded'} {r['draw_ms']:.2f} ms"
                              for r in draws))
    return {"rows": rows, "history": history, "slots": slots, "policies": list(policies), "results": results,
            "targets": targets(results), "draws": draws}


def alternating(runs: dict, rounds: int, calls: int, device: torch.device) -> dict[object, list[float]]:
    """Seconds a call of each of ``runs`` took, one mean of ``calls`` calls per round, in
    ``rounds`` that alternate them all (each round starting one further along), so that
    their ratios come from the same minutes."""
    seconds = {key: [] for key in runs}
    keys = list(runs)
    for index in range(rounds):
        for key in keys[index % len(keys):] + keys[: index % len(keys)]:
            synchronize(device)
            started = time.perf_counter()
            for _ in range(calls):
                runs[key]()
            synchronize(device)
            seconds[key].append((time.perf_counter() - started) / calls)
    return seconds


def draw_costs(model, tokenizer, rows: list[int], rounds: int) -> list[dict]:
    """What drawing a step's tokens costs at each row count, seeded rows (their keys
    hashed on the host) against unseeded ones (fresh noise): the app's sampling from the
    model's own next-token distributions over the book, median milliseconds over
    ``rounds`` that alternate them."""
    ids = tokenizer(data.read_text(data.BOOK), add_special_tokens=False).input_ids[: max(rows) + 1]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, 1:].float()
    settings = GenerationConfig()
    seeded_samplings = [Sampling(temperature=settings.temperature, top_p=settings.top_p, seed=row)
                        for row in range(max(rows))]
    unseeded_sampling = Sampling(temperature=settings.temperature, top_p=settings.top_p)
    runs = {}
    for count in rows:
        for seeded in (True, False):
            def run(count=count, seeded=seeded) -> None:
                draws = [Draw(seeded_samplings[row] if seeded else unseeded_sampling) for row in range(count)]
                draw_tokens(logits[:count].clone(), list(range(count)), draws)
            run()
            runs[count, seeded] = run
    seconds = alternating(runs, rounds, 1, model.device)
    return [{"rows": count, "seeded": seeded, "draw_ms": 1000 * statistics.median(seconds[count, seeded])}
            for count, seeded in runs]


def targets(results: list[dict]) -> list[str]:
    """The issue's CPU targets, from one run."""
    by = {(r["precision"], r["rows"]): r for r in results if r["policy"] == "h2o"}
    lines = []
    for r in results:
        if r["policy"] != "h2o" and (r["precision"], r["rows"]) in by:
            h2o = by[r["precision"], r["rows"]]
            lines.append(f"{r['policy']} / h2o, {r['precision']}, {r['rows']} rows: step {r['step_ms'] / h2o['step_ms']:.3f}x, "
                         f"ops {r['ops']} / {h2o['ops']}")
    counts = sorted({r["rows"] for r in results})
    one, most = counts[0], counts[-1]
    for precision in PRECISIONS:
        alone, many = by.get((precision, one)), by.get((precision, most))
        if alone is None or many is None or one == most:
            continue
        lines.append(f"{precision}: tensor ops per step at {most} rows / at {one}: "
                     f"{many['ops'] / alone['ops']:.2f}x (target <= 1.5x); host reads per step "
                     f"{max(r['host_reads'] for r in results if r['precision'] == precision)} at most (target <= 2); "
                     f"a row at {most} rows costs {many['step_ms'] / most / alone['step_ms']:.3f}x its "
                     f"{one}-row step (target <= 0.2x)")
    if ("float32", one) in by and ("K8/V4", one) in by:
        lines.append(f"K8/V4 {one}-row step / float32: "
                     f"{by['K8/V4', one]['step_ms'] / by['float32', one]['step_ms']:.2f}x (target <= 1.1x)")
    for count in counts:
        if ("float32", count) in by and ("K4/V4 +16 exact", count) in by:
            speed = by["float32", count]["step_ms"] / by["K4/V4 +16 exact", count]["step_ms"]
            lines.append(f"K4/V4 +16 exact at {count} rows: {speed:.2f}x the speed of float32 rows with the "
                         "same slots (target >= 0.9x)")
    return lines


def markdown(result: dict) -> str:
    table = md_table(["slots", "policy", "rows", "tensor ops / step", "host reads / step", "step ms", "ms a row"],
                     [[r["precision"], r["policy"], r["rows"], r["ops"], r["host_reads"], f"{r['step_ms']:.1f}",
                       f"{r['step_ms'] / r['rows']:.2f}"] for r in result["results"]])
    head = (f"Each row: {result['history']} tokens of its own passage of the book read (the first "
            f"{SYSTEM_TOKENS} pinned; a turns row read it as two turns), with {result['slots']} slots; the app's "
            "sampling.")
    draws = md_table(["rows", "draw", "ms a step", "ms a row"],
                     [[r["rows"], "seeded" if r["seeded"] else "unseeded", f"{r['draw_ms']:.2f}",
                       f"{r['draw_ms'] / r['rows']:.3f}"] for r in result["draws"]])
    return "\n\n".join([head, table, "\n".join(f"- {line}" for line in result["targets"]),
                         "Drawing a step's tokens alone (the step times above include the seeded rows' draws):",
                         draws])
