"""Decoding speed in the real app with the live retained-token map on and off:
``python -m tools.measure_map_speed [runs] [tokens]``.

Each run is a new chat with the same greedy prompt, read off the gauge (the session's own
decode rate); on and off alternate, so a neighbour's load on a shared machine hits both.
Also times one map render in process, the cost each throttled update adds.
"""

from __future__ import annotations

import statistics
import sys
import time

from playwright.sync_api import sync_playwright

from tests.browser_support import chromium, configure, gauge, open_app, running_app, send

PROMPT = "Write a long story about a dragon who guards a library."


def render_cost(tokens: int) -> tuple[float, int, int]:
    """Seconds per map render (token map + heat map, all layers and heads) for a
    conversation of about ``tokens`` on the default cache budget, and the characters of
    HTML it sends: the whole map, and the live map's newest tokens only."""
    from h2o_chat import ChatSession, load_model, make_cache
    from h2o_chat.ui.retention import LIVE_MAP_TOKENS, TokenPieces, maps_html

    model, tokenizer = load_model()
    session = ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=128, recent=128, sink=4))
    filler = " ".join(["The dragon read every book in the library twice."] * (tokens // 10))
    "".join(session.send(filler, temperature=0, max_new_tokens=2))
    pieces, kv_heads = TokenPieces(tokenizer), model.config.num_key_value_heads
    runs = 20
    started = time.perf_counter()
    for _ in range(runs):  # what one end-of-turn update does: stats, pieces, both maps
        maps_html(pieces(session.tokens), session.stats().cache, kv_heads, None, None)
    seconds = (time.perf_counter() - started) / runs
    whole, live = (sum(map(len, maps_html(pieces(session.tokens), session.stats().cache,
                                          kv_heads, None, None, max_tokens)))
                   for max_tokens in (len(session.tokens), LIVE_MAP_TOKENS))
    return seconds, whole, live


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 160
    rates: dict[bool, list[float]] = {True: [], False: []}
    with running_app() as url, sync_playwright() as playwright, chromium(playwright) as browser:
        page = open_app(browser, url)
        configure(page, max_new_tokens=tokens)
        for run in range(2 * runs):
            live = run % 2 == 0
            if page.locator("#chat-map-live input").is_checked() != live:
                page.click("#chat-map-live input")
            page.click("#chat-new")
            page.wait_for_function("() => document.querySelector('#chat-gauge .gauge').dataset.seen === '0'")
            send(page, "#chat-input", "#chat-send", PROMPT)
            rate = float(gauge(page, "chat-gauge")["tps"])
            rates[live].append(rate)
            print(f"run {run + 1}: live map {'on ' if live else 'off'} {rate:.2f} tokens/s", flush=True)
    for live, values in rates.items():
        print(f"live map {'on ' if live else 'off'}: median {statistics.median(values):.2f} tokens/s, "
              f"min {min(values):.2f}, max {max(values):.2f} over {len(values)} runs")
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"slowdown with the live map (medians): {100 * (1 - on / off):.1f}%")
    for n in (300, 3000):
        seconds, whole, live = render_cost(n)
        print(f"one map update at ~{n} tokens: {1000 * seconds:.1f} ms, {whole / 1000:.0f} kB "
              f"of HTML (live, newest tokens only: {live / 1000:.0f} kB)")


if __name__ == "__main__":
    main()
