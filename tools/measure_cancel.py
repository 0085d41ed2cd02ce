"""How fast a request whose client leaves stops costing: ``python -m tools.measure_cancel
[--repeats 5] [--lines 300]``.

Starts ``app.py`` (the embedded model, one generation at a time) and sends a long prompt
on a socket of its own, as any client would; the client closes the connection 5 ms,
20 ms or 200 ms after sending, or while its request waits behind another generation.
From the close, it polls the server's /metrics until the cancelled turn is counted and no
turn runs, queues or holds the scheduler. Prints per case the seconds that took (median
and worst), the stage the server counted and the prompt tokens it fed, next to the same
prompt read whole by a client that stays (max_tokens 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request

from h2o_chat.bench.api import server
from h2o_chat.bench.client import Metrics, at_rest, send_chat, wait_for_metrics

STAGES = ("queued", "prefill", "decode")


def cancelled(seen: Metrics) -> dict[str, float]:
    return {stage: seen[f'h2o_chat_cancelled_turns_total{{stage="{stage}"}}'] for stage in STAGES}


def until(url: str, condition) -> Metrics:
    return wait_for_metrics(url, condition, timeout=600, poll_s=0.01)


def leave(url: str, prompt: str, after_s: float | None) -> tuple[float, str, float]:
    """Send ``prompt`` and close after ``after_s`` (None: once it waits behind another
    request). Seconds from the close until the server is at rest with the turn counted,
    the stage counted and the prompt tokens fed."""
    before = until(url, at_rest)
    blocker = None
    if after_s is None:
        blocker = send_chat(url, {"messages": [{"role": "user", "content": "Count to a thousand."}],
                                  "stream": True, "max_tokens": 2000, "ignore_eos": True})
        until(url, lambda m: m["h2o_chat_scheduler_turns"] == 1)
    connection = send_chat(url, {"messages": [{"role": "user", "content": prompt}], "stream": True,
                                 "max_tokens": 16, "temperature": 0})
    if after_s is None:
        until(url, lambda m: m["h2o_chat_queued_requests"] == 1)
    else:
        time.sleep(after_s)
    connection.close()
    closed = time.perf_counter()
    counted = sum(cancelled(before).values()) + 1
    seen = until(url, lambda m: sum(cancelled(m).values()) >= counted
                 and m["h2o_chat_queued_requests"] == 0
                 and m["h2o_chat_scheduler_turns"] == (1 if blocker else 0))
    took = time.perf_counter() - closed
    if blocker is not None:
        blocker.close()
        until(url, at_rest)
    stage = next(s for s in STAGES if cancelled(seen)[s] > cancelled(before)[s])
    return took, stage, seen["h2o_chat_prefill_tokens_total"] - before["h2o_chat_prefill_tokens_total"]


def read_whole(url: str, prompt: str) -> tuple[float, int]:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        usage = json.load(response)["usage"]
    return time.perf_counter() - began, usage["prompt_tokens"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.measure_cancel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="tries per case (default 5)")
    parser.add_argument("--lines", type=int, default=300, help="lines of the long prompt (default 300)")
    args = parser.parse_args(argv)
    # Held-out wording each run: numbers change, so no conversation is ever reused.
    prompt = " ".join(f"Entry {i}: the ferry left pier {i % 17} carrying {i * 13} crates of "
                      f"{['salt', 'tea', 'wool', 'tin'][i % 4]}." for i in range(args.lines))
    cases = [("closed at 5 ms", 0.005), ("closed at 20 ms", 0.02), ("closed at 200 ms", 0.2),
             ("closed while queued", None)]
    with server(1) as url:
        read_whole(url, "Hello.")  # the first pass pays one-time costs
        whole_s, prompt_tokens = read_whole(url, prompt)
        rows = []
        for name, after_s in cases:
            tries = [leave(url, prompt, after_s) for _ in range(args.repeats)]
            seconds = [t[0] for t in tries]
            stages = sorted({t[1] for t in tries})
            fed = [t[2] for t in tries]
            rows.append((name, statistics.median(seconds), max(seconds), "/".join(stages), max(fed)))
            print(f"{name}: {rows[-1]}", flush=True)
    print(f"\nPrompt of {prompt_tokens} tokens, read whole in {whole_s:.1f} s by a client that stays; "
          f"{args.repeats} tries per case; load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| client | seconds from close to no turn running, median / worst | stage counted | "
          "prompt tokens fed, most |")
    print("|---|---|---|---|")
    for name, median, worst, stages, fed in rows:
        print(f"| {name} | {median:.2f} / {worst:.2f} | {stages} | {fed:.0f} of {prompt_tokens} |")


if __name__ == "__main__":
    main()
