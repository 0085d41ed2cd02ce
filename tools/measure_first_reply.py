"""How long a new user waits for a first chat reply on a small CPU, per max_new_tokens:
``python -m tools.measure_first_reply [threads] [limits...]`` (defaults 1, then 256 128).

Each typical first message goes to a fresh chat session of the app's defaults (cache,
system prompt, temperature, top-p; a fixed seed so every limit samples the same reply)
on the embedded model, with torch on ``threads`` threads. The table gives per limit the
median wall and CPU time of the whole reply (prefill included), the tokens it got, and
how many replies the limit cut short. On one thread the CPU time is about what a quiet
core would take, however busy the machine measuring it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as app.py: see the README

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from h2o_chat import ChatSession, cache_from_config, load_model  # noqa: E402
from h2o_chat.config import AppConfig  # noqa: E402

FIRST_MESSAGES = [
    "Hi! What can you do?",
    "Tell me about cats.",
    "How do I make a cup of tea?",
    "Explain what a KV cache is.",
    "Write a short poem about the sea.",
]
SEED = 1


def first_reply(model, tokenizer, config: AppConfig, text: str,
                limit: int) -> tuple[float, float, int, str]:
    """Wall and CPU seconds, tokens and finish reason of the first reply to ``text``."""
    generation = config.generation
    session = ChatSession(model, tokenizer, cache=cache_from_config(model, config.cache),
                          system_prompt=generation.system_prompt,
                          prefill_chunk_size=config.cache.prefill_chunk_size)
    started, cpu = time.perf_counter(), time.process_time()
    for _ in session.send(text, max_new_tokens=limit, temperature=generation.temperature,
                          top_p=generation.top_p, seed=SEED):
        pass
    return (time.perf_counter() - started, time.process_time() - cpu, len(session.reply),
            session.finish_reason)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    limits = [int(a) for a in sys.argv[2:]] or [256, 128]
    torch.set_num_threads(threads)
    config = AppConfig()
    model, tokenizer = load_model(config.model)
    first_reply(model, tokenizer, config, "Hello.", 8)  # warm-up: first calls allocate
    rows = [("max_new_tokens", "median wall s", "median CPU s", "max CPU s", "median tokens",
             "cut by the limit")]
    for limit in limits:
        runs = [first_reply(model, tokenizer, config, text, limit) for text in FIRST_MESSAGES]
        for text, (wall, cpu, tokens, finish) in zip(FIRST_MESSAGES, runs):
            print(f"  {limit}: {wall:5.1f} s wall {cpu:5.1f} s CPU {tokens:3d} tokens {finish:6s} "
                  f"{text}", flush=True)
        cpu = [r[1] for r in runs]
        rows.append((str(limit), f"{statistics.median(r[0] for r in runs):.1f}",
                     f"{statistics.median(cpu):.1f}", f"{max(cpu):.1f}",
                     f"{statistics.median(r[2] for r in runs):.0f}",
                     f"{sum(r[3] == 'length' for r in runs)} of {len(runs)}"))
    print(f"\nfirst replies on {threads} torch thread(s), load average {os.getloadavg()[0]:.2f}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    main()
