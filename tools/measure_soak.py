"""A long soak: one chat session, many turns, memory and cache size per turn:
``python -m tools.measure_soak [turns] [max_new_tokens]`` (defaults 300 and 16).

The user turns are the MT-Bench questions (both turns of each, in order, then again),
replies greedy, on the app's default cache. Prints the process's resident memory now and
its peak so far, the cache's slots and KV bytes at turns 1, 10, 100 and the last.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time

import psutil
import torch

from h2o_chat import ChatSession, load_model
from h2o_chat.bench.data import mt_bench_questions
from h2o_chat.config import load_config
from h2o_chat.ui.settings import new_cache

REPORTED = {1, 10, 100}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def main(turns: int = 300, max_new_tokens: int = 16) -> None:
    config = load_config()
    model, tokenizer = load_model(config.model)
    cache = config.cache
    session = ChatSession(model, tokenizer, new_cache(model, cache),
                          system_prompt=config.generation.system_prompt,
                          prefill_chunk_size=cache.prefill_chunk_size)
    questions = [turn for q in mt_bench_questions() for turn in q["turns"]]
    process = psutil.Process()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; cache {session.cache.policy.describe()}")
    print("| turn | tokens seen | slots held | KV MB (allocated) | RSS MB | peak RSS MB | s/turn |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    started = time.perf_counter()
    for turn in range(1, turns + 1):
        "".join(session.send(questions[(turn - 1) % len(questions)], temperature=0,
                             max_new_tokens=max_new_tokens))
        if turn in REPORTED or turn == turns:
            stats = session.stats().cache
            print(f"| {turn} | {stats.seen} | {stats.held} | {stats.kv_bytes / 2**20:.1f} | "
                  f"{process.memory_info().rss / 2**20:.0f} | {peak_mb():.0f} | "
                  f"{(time.perf_counter() - started) / turn:.2f} |", flush=True)


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:]))
