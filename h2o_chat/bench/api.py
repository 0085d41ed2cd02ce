"""``python -m h2o_chat.bench api [--clients 1,2,4,8] [--tokens 32] [--repeats 2] [--threads N]``

The cost of the HTTP API: N concurrent conversations, each one greedy reply of exactly
``--tokens`` tokens (``ignore_eos``), through the real server (``app.py`` in its own
process, streamed to N ``openai`` clients on threads here) and through the Python API
(N ``ChatSession`` threads in this process, the server idle). Both sides use the config's
cache and threads (``--threads`` sets both), the same questions, and alternate per
repeat. Prints aggregate tokens/s, time to first token p50/p95, and the HTTP side's
tokens/s against the Python side's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as app.py: idle OpenMP threads must not spin

import torch  # noqa: E402

from h2o_chat import ChatSession, cache_from_config, load_model  # noqa: E402
from h2o_chat.config import load_config  # noqa: E402

from .options import parse_counts, refuse_below  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["Why is the sky blue?", "Write a haiku about the sea.", "What is a heavy hitter?",
             "Explain recursion to a child.", "Name three rivers in Europe.", "How do bees make honey?",
             "What is the capital of Peru?", "Describe a cat in one sentence."]


def run_concurrently(count: int, reply: Callable[[int], float]) -> tuple[float, list[float]]:
    """Start ``count`` conversations at once (``reply(i)`` returns its time to first
    token from the common start); wall seconds until all ended, and the TTFTs."""
    ttfts = [0.0] * count
    start = threading.Barrier(count + 1)

    def run(index: int) -> None:
        start.wait()
        ttfts[index] = reply(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, ttfts


def python_reply(model, tokenizer, config, tokens: int) -> Callable[[int], float]:
    def reply(index: int) -> float:
        session = ChatSession(model, tokenizer, system_prompt=config.generation.system_prompt,
                              cache=cache_from_config(model, config.cache))
        began, first = time.perf_counter(), None
        for _ in session.send(QUESTIONS[index % len(QUESTIONS)], temperature=0, max_new_tokens=tokens,
                              min_new_tokens=tokens):
            first = first or time.perf_counter() - began
        return first
    return reply


def http_reply(url: str, tokens: int) -> Callable[[int], float]:
    from openai import OpenAI

    def reply(index: int) -> float:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        began, first = time.perf_counter(), None
        stream = client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
            stream=True, temperature=0, max_tokens=tokens, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - began
        return first
    return reply


@contextmanager
def server(max_clients: int, threads: int) -> Iterator[str]:
    """``app.py`` on a free port, allowing ``max_clients`` generations at once, on
    ``threads`` torch threads."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="h2o-chat-bench-", delete=False)
    with config:
        config.write(f"model:\n  threads: {threads}\nserver:\n  max_concurrent_generations: {max_clients}\n")
    errors = tempfile.TemporaryFile()  # read if the server ends before it answers
    process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port), "--config", config.name],
                               stdout=subprocess.DEVNULL, stderr=errors)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if process.poll() is not None:
                errors.seek(0)
                said = errors.read().decode(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"the server ended (status {process.returncode}) before it answered: "
                                   + " / ".join(said))
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError("the server did not become healthy within 2 minutes")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        errors.close()
        os.unlink(config.name)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m h2o_chat.bench api", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,2,4,8", help="comma list of concurrent conversations")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per reply (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side and N, alternating (default 2)")
    parser.add_argument("--threads", type=int, help="torch threads of each side (default: the config's)")
    args = parser.parse_args(argv)
    try:
        counts = parse_counts(args.clients)
    except ValueError:
        counts = []
    if not counts or max(counts) > 64:
        parser.error(f"--clients {args.clients!r}: must be a comma list of whole numbers from 1 to 64 "
                     "(server.max_concurrent_generations)")
    refuse_below(parser, args, ("tokens", "repeats", "threads"), 1)
    config = load_config()
    if args.threads:
        config.model.threads = args.threads
    model, tokenizer = load_model(config.model)
    local = python_reply(model, tokenizer, config, args.tokens)
    rows = []
    with server(max(counts), torch.get_num_threads()) as url:
        remote = http_reply(url, args.tokens)
        run_concurrently(1, remote)  # warm both sides up: first passes pay one-time costs
        run_concurrently(1, local)
        for count in counts:
            walls: dict[str, list[float]] = {"python": [], "http": []}
            ttfts: dict[str, list[float]] = {"python": [], "http": []}
            for _ in range(args.repeats):
                for side, reply in (("python", local), ("http", remote)):
                    wall, firsts = run_concurrently(count, reply)
                    walls[side].append(wall)
                    ttfts[side] += firsts
            rates = {side: count * args.tokens / statistics.median(w) for side, w in walls.items()}
            rows.append((count, rates, ttfts))
            print(f"N={count}: python {rates['python']:.1f} tok/s, http {rates['http']:.1f} tok/s", flush=True)
    print(f"\n{args.tokens}-token greedy replies, median of {args.repeats} runs per side; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print("| N | Python API tok/s | HTTP API tok/s | HTTP vs Python | TTFT p50 / p95 Python (s) | "
          "TTFT p50 / p95 HTTP (s) |")
    print("|---|---|---|---|---|---|")
    for count, rates, ttfts in rows:
        ratio = rates["http"] / rates["python"] - 1
        cells = [f"{percentile(ttfts[s], 0.5):.2f} / {percentile(ttfts[s], 0.95):.2f}" for s in ("python", "http")]
        print(f"| {count} | {rates['python']:.1f} | {rates['http']:.1f} | {ratio:+.1%} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
