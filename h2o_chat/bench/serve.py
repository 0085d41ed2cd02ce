"""Serving: many conversations at once, batched or taking turns, bounded or full.

``python -m h2o_chat.bench serve [--quick | --full] [--threads 1] [--serve-configs 4x2048,...]``

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

import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path


from h2o_chat.config import CacheConfig
from h2o_chat.engine.build import cache_from_config
from h2o_chat.scheduler import BatchScheduler, TakeTurns
from h2o_chat.sessions import ChatSession

from . import data
from .report import pyplot
from .speed import RssSampler

# Each mode's cache settings; "take turns" runs one forward pass at a time (the app
# before batching), the others batched by the scheduler.
MODES = {"batched h2o": CacheConfig(), "take turns h2o": CacheConfig(), "batched full": CacheConfig(policy="full"),
         "batched h2o K8/V4": CacheConfig(key_bits=8, value_bits=4)}


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
    runner = TakeTurns(model) if mode.startswith("take turns") else BatchScheduler(model)
    cache = MODES[mode]
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


def chat_turns(model, tokenizer, conversations: int, tokens: int, rounds: int = 3) -> dict:
    """Short chat turns, the way a chat client sends them: ``conversations`` fresh chats
    (system prompt included, each its own MT-Bench question) each get a greedy reply of
    exactly ``tokens`` tokens, prefill included in the time. Concurrently (one thread
    each, batched by the scheduler) against one after another on the same scheduler,
    alternating ``rounds`` times in this process: wall seconds and time to first token."""
    scheduler = BatchScheduler(model)
    questions = [q["turns"][0] for q in data.mt_bench_questions(conversations)]
    reply = dict(temperature=0, max_new_tokens=tokens, min_new_tokens=tokens)

    def turn(question: str, ttft: list[float]) -> int:
        session = ChatSession(model, tokenizer, cache=cache_from_config(model, CacheConfig()), runner=scheduler)
        started, first = time.perf_counter(), None
        for _ in session.send(question, **reply):
            first = first or time.perf_counter()
        ttft.append(first - started)
        return len(session.reply)

    seconds: dict[str, list[float]] = {"concurrent": [], "one after another": []}
    ttfts: dict[str, list[float]] = {key: [] for key in seconds}
    generated = 0
    for _ in range(rounds):
        for mode in seconds:
            counts: list[int] = []
            started = time.perf_counter()
            if mode == "concurrent":
                threads = [threading.Thread(target=lambda q=q: counts.append(turn(q, ttfts[mode])))
                           for q in questions]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            else:
                counts = [turn(q, ttfts[mode]) for q in questions]
            seconds[mode].append(time.perf_counter() - started)
            generated = sum(counts)
    return {"conversations": conversations, "tokens": generated, "seconds": seconds, "ttft": ttfts}


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


def run(model, tokenizer, configs: list[tuple[int, int]], max_new_tokens: int, turns: int,
        paste_tokens: int, samples: int, chat_turn_conversations: int = 0, log=print) -> dict:
    """Every configuration ``(conversations, history)`` in every mode, then the latency
    test; a JSON-able result for ``markdown``/``plot``."""
    questions = data.mt_bench_questions()
    runs: list[Run] = []
    for index, (n, history) in enumerate(configs):
        texts = passages(tokenizer, n, history)
        modes = list(MODES)
        order = modes[index % len(modes):] + modes[: index % len(modes)]
        for mode in order:
            runs.append(run_mode(model, tokenizer, mode, questions[index * 8 :], texts, history,
                                 max_new_tokens, turns))
            log(f"serve {n} x {history}: {mode}: {runs[-1].aggregate:.2f} tok/s aggregate")
    result = {"runs": [asdict(r) | {"aggregate": r.aggregate} for r in runs], "ratios": ratios(runs),
              "config": {"max_new_tokens": max_new_tokens, "turns": turns, "policy": asdict(CacheConfig())}}
    if paste_tokens:
        result["latency"] = latency_under_paste(model, tokenizer, paste_tokens, samples)
    if chat_turn_conversations:
        result["chat_turns"] = chat_turns(model, tokenizer, chat_turn_conversations, max_new_tokens)
        log(f"serve: chat turns: {result['chat_turns']['seconds']}")
    return result


def markdown(result: dict) -> str:
    lines = ["| conversations | history | mode | aggregate tok/s | per conversation tok/s (median) "
             "| TTFT p50 / p95 s | KV MB in use | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['conversations']} | {r['history']} | {r['mode']} | {r['aggregate']:.2f} "
                     f"| {statistics.median(r['per_conversation']):.2f} "
                     f"| {percentile(r['ttft'], 0.5):.2f} / {percentile(r['ttft'], 0.95):.2f} "
                     f"| {r['kv_bytes'] / 2**20:.1f} | {r['peak_rss'] / 2**20:.0f} |")
    lines += ["", *(f"- {line}" for line in result["ratios"])]
    if latency := result.get("latency"):
        idle95, busy95 = percentile(latency["idle"], 0.95), percentile(latency["busy"], 0.95)
        lines.append(f"- time to first token of a short message: idle p95 {idle95:.2f} s; while a "
                     f"{latency['paste_tokens']}-token paste is read ({latency['piece']}-token pieces) "
                     f"p95 {busy95:.2f} s = {busy95 / idle95:.2f}x (target <= 3x; every message "
                     f"during the paste: {latency['all_during_paste']})")
    if turns := result.get("chat_turns"):
        together, alone = (statistics.median(turns["seconds"][k]) for k in ("concurrent", "one after another"))
        lines.append(f"- {turns['conversations']} chat turns of {turns['tokens'] // turns['conversations']} "
                     f"tokens each (fresh chats, system prompt, prefill included): concurrent "
                     f"{turns['tokens'] / together:.2f} tok/s, one after another {turns['tokens'] / alone:.2f} "
                     f"tok/s = {alone / together:.2f}x (target >= 1.8x; median of "
                     f"{len(turns['seconds']['concurrent'])} alternating rounds); time to first token "
                     f"p50/p95 concurrent {percentile(turns['ttft']['concurrent'], 0.5):.2f}/"
                     f"{percentile(turns['ttft']['concurrent'], 0.95):.2f} s, alone "
                     f"{percentile(turns['ttft']['one after another'], 0.5):.2f}/"
                     f"{percentile(turns['ttft']['one after another'], 0.95):.2f} s")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    configs = list(dict.fromkeys((r["conversations"], r["history"]) for r in result["runs"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(configs)), 3.8))
    width = 0.8 / len(MODES)
    for m, mode in enumerate(MODES):
        values = [next((r["aggregate"] for r in result["runs"]
                        if (r["conversations"], r["history"]) == c and r["mode"] == mode), 0) for c in configs]
        ax.bar([i + m * width for i in range(len(configs))], values, width, label=mode)
    ax.set_xticks([i + width for i in range(len(configs))], [f"{n} x {h}" for n, h in configs])
    ax.set_xlabel("conversations x history tokens")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def ratios(runs: list[Run]) -> list[str]:
    """The issue's targets, from runs of one process."""
    by = {(r.conversations, r.history, r.mode): r for r in runs}
    lines = []
    for n, h, a, b, target in ((8, 2048, "batched h2o", "take turns h2o", 3.5),
                               (32, 2048, "batched h2o", "take turns h2o", 4),
                               (4, 2048, "batched h2o", "take turns h2o", 1.8),
                               (4, 4096, "batched h2o", "batched full", 1.5)):
        if (n, h, a) in by and (n, h, b) in by:
            ratio = by[n, h, a].aggregate / by[n, h, b].aggregate
            lines.append(f"{n} conversations at {h}: {a} / {b} aggregate tok/s = {ratio:.2f}x "
                         f"(target >= {target}x)")
    for mode, target in (("batched h2o", 0.2), ("batched h2o K8/V4", 0.05)):
        if (8, 4096, mode) in by and (8, 4096, "batched full") in by:
            share = by[8, 4096, mode].kv_bytes / by[8, 4096, "batched full"].kv_bytes
            lines.append(f"8 conversations at 4096: {mode} KV bytes / full = {share:.3f} (target <= {target})")
    return lines
