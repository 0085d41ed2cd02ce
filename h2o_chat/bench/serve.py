"""Serving: many conversations at once, batched or taking turns, bounded or full.

``python -m h2o_chat.bench.serve [--quick | --full] [--threads 1] [--device cpu|cuda]``

Each conversation first reads a history of ``H`` tokens (its own passage of Pride and
Prejudice, as one user message), then N of them run concurrently, one thread each,
through the sessions' public API: both turns of an MT-Bench question, greedy replies of
up to ``--max-new-tokens``. Modes, on the same inputs in one process (order rotated per
configuration): the app's H2O cache batched by the scheduler, the same taking turns per
forward pass (the app before batching), and the full cache batched. Per run: aggregate
decode tokens/s (tokens generated over the wall time of the turns), per-conversation
tokens/s, time to first token p50/p95, KV bytes in use, peak RSS.

Then the latency test: a short message's time to first token on an idle server, and
while another conversation reads a long paste (``--paste-tokens``) in chunks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from h2o_chat.config import CacheConfig, ModelConfig
from h2o_chat.engine.build import cache_from_config
from h2o_chat.loading import load_model
from h2o_chat.scheduler import BatchScheduler, TakeTurns
from h2o_chat.session import ChatSession

from . import data
from .speed import RssSampler

MODES = ("batched h2o", "take turns h2o", "batched full")
PRESETS = {
    # The targets: 4 and 8 conversations at 2048 (batched vs take turns), 4 at
    # 4096 (h2o vs full), KV bytes of 8 at 4096.
    "quick": dict(configs=[(4, 2048), (8, 2048), (4, 4096), (8, 4096)], max_new_tokens=64, turns=1),
    "full": dict(configs=[(n, h) for h in (512, 2048, 4096) for n in (1, 2, 4, 8)], max_new_tokens=64, turns=2),
}


@dataclass
class Run:
    mode: str
    conversations: int
    history: int
    tokens: int
    seconds: float
    per_conversation: list[float]  # decode tokens/s of each
    ttft: list[float]  # seconds, one per turn started
    kv_bytes: int
    peak_rss: int

    @property
    def aggregate(self) -> float:
        return self.tokens / self.seconds


def conversation(model, tokenizer, cache: CacheConfig, runner, passage: str) -> ChatSession:
    """A session that has read ``passage`` (its history) already."""
    session = ChatSession(model, tokenizer, cache=cache_from_config(model, cache), runner=runner,
                          history=[{"role": "user", "content": passage},
                                   {"role": "assistant", "content": "I have read it."}])
    session.prefill()
    return session


def passages(tokenizer, count: int, length: int) -> list[str]:
    """``count`` different passages of about ``length`` tokens of the book."""
    ids = tokenizer(data.read_text(data.BOOK), add_special_tokens=False).input_ids
    step = (len(ids) - length) // max(1, count)
    return [tokenizer.decode(ids[i * step : i * step + length]) for i in range(count)]


def run_mode(model, tokenizer, mode: str, questions: list[dict], texts: list[str],
             history: int, max_new_tokens: int, turns: int) -> Run:
    policy = "full" if mode.endswith("full") else "h2o"
    runner = TakeTurns(model) if mode.startswith("take turns") else BatchScheduler(model)
    cache = CacheConfig(policy=policy)
    sessions = [conversation(model, tokenizer, cache, runner, text) for text in texts]
    generated = [0] * len(sessions)
    decode_s = [0.0] * len(sessions)
    ttft: list[float] = []
    errors: list[BaseException] = []

    def talk(index: int) -> None:
        try:
            for turn in questions[index]["turns"][:turns]:
                started = time.perf_counter()
                first = None
                for _ in sessions[index].send(turn, temperature=0, max_new_tokens=max_new_tokens):
                    first = first or time.perf_counter()
                ttft.append(first - started)
                decode_s[index] += time.perf_counter() - first
                generated[index] += len(sessions[index].reply)
        except BaseException as err:  # reported after the run
            errors.append(err)

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(sessions))]
    with RssSampler() as rss:
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    kv = sum(s.cache.stats().held_bytes for s in sessions)
    per = [max(g - 1, 0) / d if d else 0.0 for g, d in zip(generated, decode_s)]
    return Run(mode, len(sessions), history, sum(generated), seconds, per, ttft, kv, rss.peak)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency_under_paste(model, tokenizer, paste_tokens: int, samples: int) -> dict:
    """Time to first token of short messages, idle and while a long paste is read."""
    scheduler = BatchScheduler(model)
    cache = CacheConfig()
    questions = [q["turns"][0] for q in data.mt_bench_questions(samples)]

    def short_ttfts() -> list[float]:
        times = []
        for question in questions:
            session = ChatSession(model, tokenizer, cache=cache_from_config(model, cache), runner=scheduler)
            started = time.perf_counter()
            next(session.send(question, temperature=0, max_new_tokens=4))
            times.append(time.perf_counter() - started)
            session.stop()
        return times

    idle = short_ttfts()
    paste = passages(tokenizer, 1, paste_tokens)[0]
    reader = ChatSession(model, tokenizer, cache=cache_from_config(model, cache), runner=scheduler)
    done = threading.Event()

    def read() -> None:
        for _ in reader.send(paste + "\n\nSummarize this.", temperature=0, max_new_tokens=1):
            pass
        done.set()

    thread = threading.Thread(target=read)
    thread.start()
    busy = short_ttfts()
    busy_while_reading = not done.is_set()
    thread.join()
    return {"idle": idle, "busy": busy, "paste_tokens": reader.fed, "all_during_paste": busy_while_reading,
            "piece": scheduler.prefill_piece}


def table(runs: list[Run]) -> str:
    lines = ["| conversations | history | mode | aggregate tok/s | per conversation tok/s (median) "
             "| TTFT p50 / p95 s | KV MB in use | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.conversations} | {r.history} | {r.mode} | {r.aggregate:.2f} "
                     f"| {statistics.median(r.per_conversation):.2f} "
                     f"| {percentile(r.ttft, 0.5):.2f} / {percentile(r.ttft, 0.95):.2f} "
                     f"| {r.kv_bytes / 2**20:.1f} | {r.peak_rss / 2**20:.0f} |")
    return "\n".join(lines)


def ratios(runs: list[Run]) -> list[str]:
    """The issue's targets, from runs of one process."""
    by = {(r.conversations, r.history, r.mode): r for r in runs}
    lines = []
    for n, h, a, b, target in ((8, 2048, "batched h2o", "take turns h2o", 2.5),
                               (4, 2048, "batched h2o", "take turns h2o", 1.8),
                               (4, 4096, "batched h2o", "batched full", 1.5)):
        if (n, h, a) in by and (n, h, b) in by:
            ratio = by[n, h, a].aggregate / by[n, h, b].aggregate
            lines.append(f"{n} conversations at {h}: {a} / {b} aggregate tok/s = {ratio:.2f}x "
                         f"(target >= {target}x)")
    if (8, 4096, "batched h2o") in by and (8, 4096, "batched full") in by:
        share = by[8, 4096, "batched h2o"].kv_bytes / by[8, 4096, "batched full"].kv_bytes
        lines.append(f"8 conversations at 4096: h2o KV bytes / full = {share:.3f} (target <= 0.2)")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m h2o_chat.bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="preset", action="store_const", const="quick")
    mode.add_argument("--full", dest="preset", action="store_const", const="full")
    p.set_defaults(preset="quick")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--max-new-tokens", type=int, help="reply length cap per turn")
    p.add_argument("--paste-tokens", type=int, default=20000, help="latency test: tokens of the long paste")
    p.add_argument("--samples", type=int, default=8, help="latency test: short messages each way")
    p.add_argument("--skip-latency", action="store_true", help="only the throughput runs")
    p.add_argument("--configs", help="comma list of CONVERSATIONSxHISTORY, e.g. 4x2048,8x2048")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    configs = preset["configs"]
    if args.configs:
        configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(ModelConfig(device=args.device, threads=args.threads,
                                              dtype="bfloat16" if args.device == "cuda" else "auto"))
    print(f"serve benchmark: {args.preset}, {torch.get_num_threads()} torch thread(s), device {args.device}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    questions = data.mt_bench_questions()
    runs: list[Run] = []
    for index, (n, history) in enumerate(configs):
        texts = passages(tokenizer, n, history)
        order = MODES[index % len(MODES):] + MODES[: index % len(MODES)]
        for mode_name in order:
            run = run_mode(model, tokenizer, mode_name, questions[index * 8 :], texts, history,
                           args.max_new_tokens or preset["max_new_tokens"], preset["turns"])
            runs.append(run)
            print(f"  {n} x {history}: {mode_name}: {run.aggregate:.2f} tok/s aggregate, "
                  f"{run.tokens} tokens in {run.seconds:.1f} s", flush=True)
    print(table(runs))
    for line in ratios(runs):
        print(line)
    if not args.skip_latency:
        latency = latency_under_paste(model, tokenizer, args.paste_tokens, args.samples)
        idle95, busy95 = percentile(latency["idle"], 0.95), percentile(latency["busy"], 0.95)
        print(f"time to first token, short message: idle p95 {idle95:.2f} s, while a "
              f"{latency['paste_tokens']}-token paste is read ({latency['piece']}-token pieces) p95 "
              f"{busy95:.2f} s = {busy95 / idle95:.2f}x (target <= 3x; all during the paste: "
              f"{latency['all_during_paste']})")


if __name__ == "__main__":
    main()
