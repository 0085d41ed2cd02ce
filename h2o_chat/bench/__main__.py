"""``python -m h2o_chat.bench [COMPARISON ...] [--quick | --full] [--out DIR] ...``

Comparisons: streaming (1), continuation (2), tune (tuning study), xsum (3), speed (4),
chat (5), rolling (6: absolute vs rolled positions past the trained context), or all. Each comparison runs in one process on the same inputs for every policy
and writes ``<name>.json``/``.md``/``.png`` into ``--out`` (default results/<timestamp>);
``index.md`` there collects the tables of every comparison in the folder.

``python -m h2o_chat.bench api ...`` measures the HTTP API's cost instead (``bench/api.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

COMPARISONS = ["streaming", "continuation", "tune", "xsum", "speed", "chat", "rolling"]

# quick: a few minutes per comparison on a 2-core CPU; full: the protocol.
PRESETS = {
    "quick": dict(passages=2, budgets="0.2", tune_budgets="0.2", articles=10, contexts="512,1024,2048,4096",
                  decode_tokens=16, repeats=3, prefill_repeats=1, questions=20, max_new_tokens=16,
                  tokens=10240),
    "full": dict(passages=4, budgets="0.1,0.2,0.5,64,128,256,512", tune_budgets="0.1,0.2", articles=100,
                 contexts="512,1024,2048,4096,8192", decode_tokens=64, repeats=5, prefill_repeats=2,
                 questions=80, max_new_tokens=64, tokens=16384),
}


def parse_budgets(text: str) -> list[float]:
    return [float(x) if "." in x else int(x) for x in text.split(",") if x]


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
    p.add_argument("--tokens", type=int, help="rolling: book tokens streamed (past the model's 8192 trained context)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="continuation: tokens per prefill pass (default 256, the app's cache.prefill_chunk_size)")
    p.add_argument("--chunk", type=int, default=32, help="rolling: tokens fed per forward pass (default 32)")
    p.add_argument("--rolling-budget", type=int, default=512, help="rolling: cache slots (default 512)")
    p.add_argument("--variant", default=None,
                   help="extra H2O variant compared in streaming/continuation/xsum/chat, e.g. "
                        "'mean:0.25:4' (norm:heavy share:sink) or 'decay0.99:0.5:4'")
    p.add_argument("--threads", type=int, help="torch threads (default: the app's, one per physical core)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if "all" in args.comparisons:
        args.comparisons = COMPARISONS
    args.out = args.out or Path("results") / time.strftime("%Y%m%d-%H%M%S")
    return args


def variant_factory(spec: str | None):
    """``norm:share:sink`` -> a function slots -> Variant labelled 'h2o tuned'."""
    if not spec:
        return None
    from .variants import h2o_split

    norm, share, sink = spec.split(":")
    kw = {}
    if norm.startswith("decay"):
        kw["decay"] = float(norm[5:])
    elif norm == "mean":
        kw["norm"] = "mean"
    elif norm != "sum":
        raise SystemExit(f"--variant {spec!r}: norm must be sum, mean or decayG")
    return lambda slots: h2o_split(f"h2o tuned ({spec})", slots, float(share), sink=int(sink), **kw)


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["api"]:  # the HTTP API's cost: a measurement of its own, not a comparison
        from .api import main as api_main

        api_main(argv[1:])
        return 0
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from h2o_chat.loading import load_model

    from . import report

    model, tokenizer = load_model()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"results -> {args.out}  ({args.mode} mode, {torch.get_num_threads()} torch threads)")
    extra = variant_factory(args.variant)

    def finish(name: str, result: dict, started: float, loadavg_start) -> dict:
        machine = report.machine_info()
        machine["loadavg_start"] = loadavg_start
        result.update(machine=machine, mode=args.mode, seconds=round(time.perf_counter() - started, 1),
                      command="python -m h2o_chat.bench " + " ".join(sys.argv[1:] if argv is None else argv))
        report.write_json(args.out, name, result)
        return machine

    quality = [c for c in ("streaming", "continuation") if c in args.comparisons]
    if quality:
        from . import data, streaming
        from .variants import standard_variants

        started, load0 = time.perf_counter(), list(os.getloadavg())
        passages = data.passages(tokenizer, args.passages, 1536 + 200)
        sets = (lambda slots: standard_variants(slots) + [extra(slots)]) if extra else None
        result = streaming.run_quality(model, tokenizer, passages, parse_budgets(args.budgets),
                                       phases=quality, variant_sets=sets, chunk=args.prefill_chunk, log=log)
        machine = finish("streaming" if quality == ["streaming"] else "quality", result, started, load0)
        for phase in quality:
            body = report.quality_tables(result["records"], phase)
            body += "\n\nTargets (20% budget):\n\n" + "\n".join(report.target_check(result["records"], phase) or ["- (20% not run)"])
            if "20%" in {r["budget"] for r in result["records"]}:
                body += "\n\nPer passage, 20% budget:\n\n" + report.per_passage_table(result["records"], phase, "20%")
            report.quality_plot(result["records"], phase, args.out / f"{phase}.png",
                                f"{phase}: {len(passages)} passages, same tokens for every policy")
            body += f"\n\n![{phase}]({phase}.png)"
            title = {"streaming": "1. Streaming (teacher forcing, one token at a time)",
                     "continuation": "2. Compressed context (1536 tokens, chunked), then the next 200 tokens"}[phase]
            report.write_markdown(args.out, phase, title, body, machine)
        log(f"quality done in {time.perf_counter() - started:.0f}s")

    if "tune" in args.comparisons:
        from . import data, streaming

        started, load0 = time.perf_counter(), list(os.getloadavg())
        passages = data.passages(tokenizer, args.passages, 1536 + 200, split="tune")
        result = streaming.run_quality(model, tokenizer, passages, parse_budgets(args.tune_budgets),
                                       variant_sets=streaming.tuning_variants, log=log)
        machine = finish("tuning", result, started, load0)
        body = ("Tuning passages are disjoint from the comparison passages (the `tune` split).\n\n"
                + report.tuning_tables(result["records"]))
        report.tuning_plot(result["records"], args.out / "tuning.png")
        body += "\n\n![tuning](tuning.png)"
        report.write_markdown(args.out, "tuning", "Tuning study: split, sinks, score normalisation", body, machine)
        log(f"tuning done in {time.perf_counter() - started:.0f}s")

    if "xsum" in args.comparisons:
        from . import xsum

        started, load0 = time.perf_counter(), list(os.getloadavg())
        result = xsum.run(model, tokenizer, args.articles, extra=extra, log=log)
        machine = finish("xsum", result, started, load0)
        report.xsum_plot(result, args.out / "xsum.png")
        body = report.xsum_markdown(result) + "\n\n![xsum](xsum.png)"
        report.write_markdown(args.out, "xsum", "3. XSUM summarization (H2O paper protocol, 0-shot)", body, machine)
        log(f"xsum done in {time.perf_counter() - started:.0f}s")

    if "speed" in args.comparisons:
        from . import speed

        started, load0 = time.perf_counter(), list(os.getloadavg())
        result = speed.run(model, tokenizer, [int(c) for c in args.contexts.split(",")], args.decode_tokens,
                           args.repeats, args.prefill_repeats, log=log)
        machine = finish("speed", result, started, load0)
        report.speed_plot(result, args.out / "speed.png")
        body = report.speed_markdown(result) + "\n\n" + "\n".join(result["notes"]) + "\n\n![speed](speed.png)"
        report.write_markdown(args.out, "speed", "4. Speed and memory vs context length", body, machine)
        log(f"speed done in {time.perf_counter() - started:.0f}s")

    if "chat" in args.comparisons:
        from . import long_chat

        started, load0 = time.perf_counter(), list(os.getloadavg())
        result = long_chat.run(model, tokenizer, args.questions, args.max_new_tokens, args.chat_budget,
                               extra=extra, log=log)
        machine = finish("long_chat", result, started, load0)
        report.chat_plot(result, args.out / "long_chat.png")
        body = report.chat_markdown(result) + "\n\n" + "\n".join(result["notes"]) + "\n\n![long chat](long_chat.png)"
        report.write_markdown(args.out, "long_chat", "5. A long chat: MT-Bench, one session per policy", body, machine)
        log(f"chat done in {time.perf_counter() - started:.0f}s")
    if "rolling" in args.comparisons:
        from . import rolling

        started, load0 = time.perf_counter(), list(os.getloadavg())
        result = rolling.run(model, tokenizer, args.tokens, budget=args.rolling_budget, chunk=args.chunk, log=log)
        machine = finish("rolling", result, started, load0)
        report.rolling_plot(result, args.out / "rolling.png")
        body = report.rolling_markdown(result) + "\n\n![rolling](rolling.png)"
        report.write_markdown(args.out, "rolling", "6. Position rolling past the trained context", body, machine)
        log(f"rolling done in {time.perf_counter() - started:.0f}s")
    log(f"done: {args.out / 'index.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
