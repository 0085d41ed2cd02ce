"""``python -m h2o_chat.bench [COMPARISON ...] [--quick | --full] [--out DIR] ...``

Comparisons: streaming (1), continuation (2), tune (tuning study), xsum (3), speed (4),
chat (5), rolling (6: absolute vs rolled positions past the trained context), serve (7:
many conversations at once, batched or taking turns), step (the decode step's cost as
conversations are added), readers (what the threads reading the replies cost the
scheduler's worker), churn (what rows coming and going cost the scheduler's pass), bytes (8: quality at equal memory, storage precision and
eviction), storage (8b: designs for 4-bit slots, quantization alone), tiers (8d: evicted
tokens kept at fewer bits), shapes (8e: per-layer and per-head budgets), or all; peer (llama.cpp on the same GGUF file, one
conversation; run only when named, it needs ``llama-cpp-python``, see ``bench/peer.py``); and gpu (the GPU check, run only when named:
``python -m h2o_chat.bench gpu [--device cpu --tiny]``, see ``bench/gpu.py``). Each comparison runs in one process on the same inputs for every policy
and writes ``<name>.json``/``.md``/``.png`` into ``--out`` (default results/<timestamp>);
``index.md`` there collects the tables of every comparison in the folder.

``python -m h2o_chat.bench api ...`` measures the HTTP API's cost instead (``bench/api.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from h2o_chat.loading import load_model, set_torch_threads

from . import (budget_shapes, churn, data, equal_bytes, gpu, gpu_models, long_chat, peer, readers, report, rolling,
               serve, speed, step, storage_designs, streaming, tier_study, xsum)
from .options import flag, parse_budgets, parse_counts, parse_serve_configs, parse_shares, refuse_below
from .variants import Variant, h2o_split, standard_variants

# quick: a few minutes per comparison on a 2-core CPU; full: the protocol.
PRESETS = {
    "quick": dict(passages=2, budgets="0.2", tune_budgets="0.2", articles=10, contexts="512,1024,2048,4096",
                  decode_tokens=16, repeats=3, prefill_repeats=1, questions=20, max_new_tokens=16,
                  tokens=10240, serve_configs="4x2048,8x2048,4x4096,8x4096", serve_turns=1,
                  byte_contexts="512,4096"),
    "full": dict(passages=4, budgets="0.1,0.2,0.5,64,128,256,512", tune_budgets="0.1,0.2", articles=100,
                 contexts="512,1024,2048,4096,8192", decode_tokens=64, repeats=5, prefill_repeats=2,
                 questions=80, max_new_tokens=64, tokens=16384,
                 serve_configs=",".join(f"{n}x{h}" for h in (512, 2048, 4096) for n in (1, 2, 4, 8)),
                 serve_turns=2, byte_contexts="512,4096,8192"),
}


# Flags whose value must be a whole number from 1, or from 0 (where 0 means none).
_FROM_ONE = ("passages", "articles", "decode_tokens", "repeats", "prefill_repeats", "questions", "max_new_tokens",
             "chat_budget", "tokens", "prefill_chunk", "chunk", "rolling_budget", "serve_tokens", "samples",
             "step_history", "step_slots", "step_rounds", "churn_passes", "design_len", "peer_context", "threads")
_FROM_ZERO = ("callbacks", "paste_tokens", "chat_turns")
# Comma-list flags: what reads them, and what it takes.
_LISTS: dict[str, tuple[Callable[[str], object], str]] = {
    "budgets": (parse_budgets, "fractions above 0 and at most 1 (0.2) or slot counts from 1 (256)"),
    "tune_budgets": (parse_budgets, "fractions above 0 and at most 1 (0.2) or slot counts from 1 (256)"),
    "contexts": (parse_counts, "whole numbers from 1"),
    "step_rows": (parse_counts, "whole numbers from 1"),
    "reader_rows": (parse_counts, "whole numbers from 1"),
    "churn_rows": (parse_counts, "whole numbers from 1"),
    "byte_contexts": (lambda text: parse_counts(text, allow_none=True), "whole numbers from 1, or ''"),
    "serve_configs": (parse_serve_configs, "CONVERSATIONSxHISTORY pairs of whole numbers from 1, e.g. 4x2048"),
    "shares": (parse_shares, "shares above 0 and at most 1"),
}


def _check_values(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse in one line, before anything loads, a value no comparison can run with
    (they failed after the model loaded, with a traceback, or ran for hours)."""
    refuse_below(p, args, _FROM_ONE, 1)
    refuse_below(p, args, _FROM_ZERO, 0)
    for name, (parse, takes) in _LISTS.items():
        try:
            parse(getattr(args, name))
        except ValueError:
            p.error(f"{flag(name)} {getattr(args, name)!r}: must be a comma list of {takes}")
    if args.serve_turns not in (1, 2):
        p.error(f"--serve-turns {args.serve_turns}: must be 1 or 2")
    try:
        variant_factory(args.variant)
    except ValueError:
        p.error(f"--variant {args.variant!r}: must be norm:heavy share:sink (norm sum, mean or decayG; share "
                "from 0 to 1), e.g. 'mean:0.25:4' or 'decay0.99:0.5:4'")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m h2o_chat.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("comparisons", nargs="*", default=["all"], choices=COMPARISONS + ["all"], metavar="COMPARISON",
                   help=f"any of {', '.join(COMPARISONS)}, or all (default)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="small inputs (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="the full protocol")
    p.set_defaults(mode="quick")
    p.add_argument("--out", type=Path, help="results folder (default results/<timestamp>)")
    p.add_argument("--passages", type=int, help="passages per source (WikiText-2, book) for streaming/continuation/tune")
    p.add_argument("--budgets", help="comma list: fractions of the passage (0.2) or slot counts (256)")
    p.add_argument("--tune-budgets", help="budgets of the tuning study, as --budgets")
    p.add_argument("--articles", type=int, help="XSUM articles")
    p.add_argument("--contexts", help="speed: comma list of context lengths")
    p.add_argument("--decode-tokens", type=int, help="speed: tokens decoded per timed run")
    p.add_argument("--repeats", type=int, help="speed: alternating timed decode runs per config")
    p.add_argument("--prefill-repeats", type=int, help="speed: timed prefills per config")
    p.add_argument("--questions", type=int, help="chat: MT-Bench questions (2 turns each)")
    p.add_argument("--max-new-tokens", type=int, help="chat: reply length cap per turn")
    p.add_argument("--chat-budget", type=int, default=512, help="chat: cache slots (default 512)")
    p.add_argument("--chat-runs", default=",".join(long_chat.FACT_RUNS),
                   help=f"chat: runs of the fact set, a comma list of {', '.join(long_chat.RUN_LABELS)}")
    p.add_argument("--callbacks", type=int, default=8,
                   help="chat: questions of the second set (second turns asked about the first; 0: none)")
    p.add_argument("--callback-runs", default=",".join(long_chat.CALLBACK_RUNS),
                   help="chat: runs of the second set, as --chat-runs")
    p.add_argument("--tokens", type=int, help="rolling: book tokens streamed (past the model's 8192 trained context)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="continuation: tokens per prefill pass (default 256, the app's cache.prefill_chunk_size)")
    p.add_argument("--chunk", type=int, default=32, help="rolling: tokens fed per forward pass (default 32)")
    p.add_argument("--rolling-budget", type=int, default=512, help="rolling: cache slots (default 512)")
    p.add_argument("--variant", default=None,
                   help="extra H2O variant compared in streaming/continuation/xsum/chat, e.g. "
                        "'mean:0.25:4' (norm:heavy share:sink) or 'decay0.99:0.5:4'")
    p.add_argument("--serve-configs", help="serve: comma list of CONVERSATIONSxHISTORY, e.g. 4x2048,8x2048")
    p.add_argument("--serve-turns", type=int, help="serve: MT-Bench turns per conversation (1 or 2)")
    p.add_argument("--serve-tokens", type=int, default=64, help="serve: reply length cap (default 64)")
    p.add_argument("--paste-tokens", type=int, default=20000,
                   help="serve: tokens of the long paste in the latency test (0: no latency test)")
    p.add_argument("--chat-turns", type=int, default=4,
                   help="serve: fresh chats whose turns run concurrently and one after another (0: none)")
    p.add_argument("--samples", type=int, default=8, help="serve: short messages timed each way")
    p.add_argument("--step-rows", default="1,16,32", help="step: comma list of rows decoding together")
    p.add_argument("--step-history", type=int, default=512, help="step: tokens each row has read (default 512)")
    p.add_argument("--step-slots", type=int, default=128, help="step: cache slots of each row (default 128)")
    p.add_argument("--step-policies", default="h2o",
                   help="step: comma list of policies timed side by side (h2o first: the others' ratios are to it)")
    p.add_argument("--step-rounds", type=int, default=5,
                   help="step, readers, churn: timed rounds alternating the row counts")
    p.add_argument("--reader-rows", default="16,64,128", help="readers: comma list of rows decoding together")
    p.add_argument("--churn-rows", default="128,512", help="churn: comma list of rows decoding together")
    p.add_argument("--churn-passes", type=int, default=100, help="churn: passes timed each way (default 100)")
    p.add_argument("--shares", default="0.2,0.1,0.05,0.025",
                   help="bytes: comma list of shares of the full cache's bytes (default 0.2,0.1,0.05,0.025)")
    p.add_argument("--design-len", type=int, default=1536,
                   help="storage: tokens each passage streams (default 1536, as comparison 8)")
    p.add_argument("--byte-contexts", help="bytes: comma list of contexts whose decode speed is timed ('': none)")
    p.add_argument("--peer-context", type=int, default=512,
                   help="peer: tokens of context before the timed decode (default 512)")
    p.add_argument("--threads", type=int, help="torch threads (default: the app's, one per physical core)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="gpu: where the check runs (default cuda)")
    p.add_argument("--tiny", action="store_true",
                   help="gpu: a tiny model and small sizes, seconds on a CPU (what make test runs)")
    p.add_argument("--gpu-models", help=f"gpu: comma list of {', '.join(gpu_models.MODEL_NAMES)} "
                                        "(default 1b,8b,smollm2; tiny with --tiny)")
    p.add_argument("--gpu-parts", default=",".join(gpu.PARTS),
                   help=f"gpu: comma list of the parts to run, of {', '.join(gpu.PARTS)} (default all; a short "
                        "device time may take only what a target needs, say checks,decode for 8b)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    _check_values(p, args)
    if "all" in args.comparisons:
        args.comparisons = [c for c in COMPARISONS if c not in ON_REQUEST]
    if args.gpu_models is None:
        args.gpu_models = "tiny" if args.tiny else "1b,8b,smollm2"
    unknown = set(args.gpu_models.split(",")) - set(gpu_models.MODEL_NAMES)
    if unknown:
        p.error(f"--gpu-models: unknown {sorted(unknown)}; choose from {', '.join(gpu_models.MODEL_NAMES)}")
    args.gpu_parts = frozenset(_labels(args.gpu_parts))
    if not args.gpu_parts or args.gpu_parts - set(gpu.PARTS):
        unknown = sorted(args.gpu_parts - set(gpu.PARTS))
        p.error(f"--gpu-parts: {f'unknown {unknown}' if unknown else 'no part named'}; choose from "
                f"{', '.join(gpu.PARTS)}")
    args.out = args.out or Path("results") / time.strftime("%Y%m%d-%H%M%S")
    return args


def _labels(spec: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in spec.split(",") if part.strip())


def variant_factory(spec: str | None) -> Callable[[int], Variant] | None:
    """``norm:share:sink`` -> a function slots -> Variant labelled 'h2o tuned'."""
    if not spec:
        return None
    norm, share, sink = spec.split(":")  # ValueError where it is not three parts
    kw = {}
    if norm.startswith("decay"):
        kw["decay"] = float(norm[5:])
    elif norm == "mean":
        kw["norm"] = "mean"
    elif norm != "sum":
        raise ValueError(f"norm {norm!r}")
    share, sink = float(share), int(sink)
    if not 0 <= share <= 1 or sink < 0:
        raise ValueError(f"share {share}, sink {sink}")
    return lambda slots: h2o_split(f"h2o tuned ({spec})", slots, share, sink=sink, **kw)


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


Page = tuple[str, str, str]  # results name, title, markdown body


@dataclass(frozen=True)
class Bench:
    """What every comparison reads: the flags, the extra variant, if any, and the app's
    model, loaded when a comparison first asks for it (the GPU check builds its own)."""

    args: argparse.Namespace
    extra: Callable[[int], Variant] | None

    @cached_property
    def _loaded(self) -> tuple[Any, Any]:
        model, tokenizer = load_model()
        if self.args.threads:
            torch.set_num_threads(self.args.threads)
        return model, tokenizer

    @property
    def model(self) -> Any:
        return self._loaded[0]

    @property
    def tokenizer(self) -> Any:
        return self._loaded[1]


@dataclass(frozen=True)
class Comparison:
    label: str  # in the log
    measure: Callable[[Bench], tuple[str, dict]]  # the results name (of the JSON) and the results
    pages: Callable[[Bench, dict], list[Page]]  # draws the plots; the markdown pages to write


def _quality_phases(args: argparse.Namespace) -> list[str]:
    return [c for c in ("streaming", "continuation") if c in args.comparisons]


def _measure_quality(bench: Bench) -> tuple[str, dict]:
    args, extra, phases = bench.args, bench.extra, _quality_phases(bench.args)
    passages = data.passages(bench.tokenizer, args.passages, 1536 + 200)
    sets = (lambda slots: standard_variants(slots) + [extra(slots)]) if extra else None
    result = streaming.run_quality(bench.model, bench.tokenizer, passages, parse_budgets(args.budgets),
                                   phases=phases, variant_sets=sets, chunk=args.prefill_chunk, log=log)
    return ("streaming" if phases == ["streaming"] else "quality"), result


_QUALITY_TITLES = {"streaming": "1. Streaming (teacher forcing, one token at a time)",
                   "continuation": "2. Compressed context (1536 tokens, chunked), then the next 200 tokens"}


def _quality_pages(bench: Bench, result: dict) -> list[Page]:
    records, pages = result["records"], []
    for phase in _quality_phases(bench.args):
        body = report.quality_tables(records, phase)
        body += "\n\nTargets (20% budget):\n\n" + "\n".join(report.target_check(records, phase) or ["- (20% not run)"])
        if "20%" in {r["budget"] for r in records}:
            body += "\n\nPer passage, 20% budget:\n\n" + report.per_passage_table(records, phase, "20%")
        report.quality_plot(records, phase, bench.args.out / f"{phase}.png",
                            f"{phase}: {len(result['config']['passages'])} passages, same tokens for every policy")
        pages.append((phase, _QUALITY_TITLES[phase], f"{body}\n\n![{phase}]({phase}.png)"))
    return pages


def _measure_tuning(bench: Bench) -> tuple[str, dict]:
    passages = data.passages(bench.tokenizer, bench.args.passages, 1536 + 200, split="tune")
    return "tuning", streaming.run_quality(bench.model, bench.tokenizer, passages, parse_budgets(bench.args.tune_budgets),
                                           variant_sets=streaming.tuning_variants, log=log)


def _tuning_pages(bench: Bench, result: dict) -> list[Page]:
    report.tuning_plot(result["records"], bench.args.out / "tuning.png")
    body = ("Tuning passages are disjoint from the comparison passages (the `tune` split).\n\n"
            + report.tuning_tables(result["records"]) + "\n\n![tuning](tuning.png)")
    return [("tuning", "Tuning study: split, sinks, score normalisation", body)]


def _one_page(name: str, title: str, run: Callable[[Bench], dict], plot: Callable[[dict, Path], None],
              markdown: Callable[[dict], str]) -> Comparison:
    """A comparison with one page: its markdown (with the result's notes, if any), then its plot."""
    def pages(bench: Bench, result: dict) -> list[Page]:
        plot(result, bench.args.out / f"{name}.png")
        notes = "\n\n" + "\n".join(result["notes"]) if "notes" in result else ""
        return [(name, title, f"{markdown(result)}{notes}\n\n![{name}]({name}.png)")]

    return Comparison(name, lambda bench: (name, run(bench)), pages)


_QUALITY = Comparison("quality", _measure_quality, _quality_pages)
GPU_TITLE = "The GPU check: correctness, decode, serving and prefill on the device"
# Each comparison by the names that select it, in the order they run.
TABLE: dict[str, Comparison] = {
    "streaming": _QUALITY,
    "continuation": _QUALITY,
    "tune": Comparison("tuning", _measure_tuning, _tuning_pages),
    "xsum": _one_page(
        "xsum", "3. XSUM summarization (H2O paper protocol, 0-shot)",
        lambda b: xsum.run(b.model, b.tokenizer, b.args.articles, extra=b.extra, log=log),
        report.xsum_plot, report.xsum_markdown),
    "speed": _one_page(
        "speed", "4. Speed and memory vs context length",
        lambda b: speed.run(b.model, b.tokenizer, parse_counts(b.args.contexts),
                            b.args.decode_tokens, b.args.repeats, b.args.prefill_repeats, log=log),
        report.speed_plot, report.speed_markdown),
    "chat": _one_page(
        "long_chat", "5. A long chat: MT-Bench, one session per policy",
        lambda b: long_chat.run(b.model, b.tokenizer, b.args.questions, b.args.max_new_tokens,
                                b.args.chat_budget, runs=_labels(b.args.chat_runs), callbacks=b.args.callbacks,
                                callback_runs=_labels(b.args.callback_runs), extra=b.extra, log=log),
        report.chat_plot, report.chat_markdown),
    "rolling": _one_page(
        "rolling", "6. Position rolling past the trained context",
        lambda b: rolling.run(b.model, b.tokenizer, b.args.tokens, budget=b.args.rolling_budget,
                              chunk=b.args.chunk, log=log),
        report.rolling_plot, report.rolling_markdown),
    "serve": _one_page(
        "serve", "7. Serving: many conversations at once",
        lambda b: serve.run(b.model, b.tokenizer,
                            parse_serve_configs(b.args.serve_configs),
                            b.args.serve_tokens, b.args.serve_turns, b.args.paste_tokens, b.args.samples,
                            b.args.chat_turns, log=log),
        serve.plot, serve.markdown),
    "step": Comparison("step", lambda b: ("step", step.run(
        b.model, b.tokenizer, parse_counts(b.args.step_rows), b.args.step_history, b.args.step_slots,
        b.args.step_rounds, steps=4, policies=_labels(b.args.step_policies), log=log)), lambda b, result: [
        ("step", "The decode step's cost as conversations are added", step.markdown(result))]),
    "readers": Comparison("readers", lambda b: ("readers", readers.run(
        b.tokenizer, parse_counts(b.args.reader_rows), b.args.step_rounds, log=log)), lambda b, result: [
        ("readers", "What the threads reading the replies cost the scheduler's worker", readers.markdown(result))]),
    "churn": Comparison("churn", lambda b: ("churn", churn.run(
        parse_counts(b.args.churn_rows), b.args.churn_passes, b.args.step_rounds, log=log)), lambda b, result: [
        ("churn", "What rows coming and going cost the scheduler's pass", churn.markdown(result))]),
    "bytes": _one_page(
        "equal_bytes", "8. Quality at equal memory: storage precision and eviction under one byte budget",
        lambda b: equal_bytes.run(b.model, b.tokenizer, b.args.passages, parse_shares(b.args.shares),
                                  parse_counts(b.args.byte_contexts, allow_none=True), b.args.decode_tokens,
                                  b.args.repeats, b.args.articles, log=log),
        equal_bytes.plot, equal_bytes.markdown),
    "storage": _one_page(
        "storage_designs", "8b. Designs for 4-bit slots: quantization alone, before one is built",
        lambda b: storage_designs.run(b.model, b.tokenizer, b.args.passages, b.args.design_len, log=log),
        storage_designs.plot, storage_designs.markdown),
    "tiers": _one_page(
        "tier_study", "8d. Evicted tokens kept at fewer bits (a tier), before one is built",
        lambda b: tier_study.run(b.model, b.tokenizer, b.args.passages, log=log),
        tier_study.plot, tier_study.markdown),
    "shapes": _one_page(
        "budget_shapes", "8e. Where a byte budget's slots go: per-layer and per-head budgets, before one is built",
        lambda b: budget_shapes.run(b.model, b.tokenizer, b.args.passages, log=log),
        budget_shapes.plot, budget_shapes.markdown),
    "peer": _one_page(
        "peer", "Peer: llama.cpp on the same GGUF file, one conversation",
        lambda b: peer.run(b.model, b.tokenizer, b.args.peer_context, b.args.decode_tokens, b.args.repeats,
                           torch.get_num_threads(), log=log),
        peer.plot, peer.markdown),
    "gpu": Comparison("gpu", lambda b: ("gpu", _run_gpu(b.args)),
                      lambda b, result: [("gpu", GPU_TITLE, gpu.markdown(result))]),
}
COMPARISONS = list(TABLE)
# Left out of "all": gpu builds models of its own, sized for a GPU; peer needs llama.cpp
# (``llama-cpp-python``), an optional install.
ON_REQUEST = {"gpu", "peer"}


def _run_gpu(args: argparse.Namespace) -> dict:
    plan = gpu.PLANS["tiny" if args.tiny else "full"]
    machine = report.machine_info()

    def save(partial: dict) -> None:
        # Each finished part is on disk at once: a lent GPU's time limit may cut the run.
        report.write_json(args.out, "gpu", partial | {"machine": machine})
        report.write_markdown(args.out, "gpu", GPU_TITLE, gpu.markdown(partial), machine)

    return gpu.run(args.gpu_models.split(","), plan, torch.device(args.device), args.gpu_parts, log=log,
                   progress=save)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["api"]:  # the HTTP API's cost: a measurement of its own, not a comparison
        from .api import main as api_main

        api_main(argv[1:])
        return 0
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_torch_threads(args.threads)  # the app's rule unless told; loading the model applies it again
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"results -> {args.out}  ({args.mode} mode, {torch.get_num_threads()} torch threads)")
    bench = Bench(args, variant_factory(args.variant))
    command = "python -m h2o_chat.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    failed = []
    for comparison in dict.fromkeys(TABLE[name] for name in COMPARISONS if name in args.comparisons):
        started, loadavg_start = time.perf_counter(), list(os.getloadavg())
        try:
            name, result = comparison.measure(bench)
        except (FileNotFoundError, ModuleNotFoundError) as missing:  # data, or peer's llama.cpp
            log(f"error: {comparison.label}: {missing}")
            return 2
        machine = report.machine_info() | {"loadavg_start": loadavg_start}
        result.update(machine=machine, mode=args.mode, seconds=round(time.perf_counter() - started, 1),
                      command=command)
        report.write_json(args.out, name, result)
        for page, title, body in comparison.pages(bench, result):
            report.write_markdown(args.out, page, title, body, machine)
        log(f"{comparison.label} done in {time.perf_counter() - started:.0f}s")
        if result.get("passed") is False:  # a comparison with checks of its own (gpu)
            failed.append(comparison.label)
    log(f"done: {args.out / 'index.md'}" + (f"; checks FAILED in {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
