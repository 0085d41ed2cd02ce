"""How smooth the page stays while replies stream: ``python -m tools.measure_page``.

Drives the real app in Debian's chromium through a fixed script (4 chat turns, 4 compare
turns then Reset, one story continue; ``long-chat``: a ~1,500-token pasted text, then 3
measured turns; ``long-reply-chat``, only when named: one greedy reply of
--max-new-tokens) and prints, per view, the longest gap between two animation frames,
the total long-task time (PerformanceObserver ``longtask``: main thread busy > 50 ms,
also as a share of the streaming time) and all the main thread's busy time as a share
of it (Chrome's ``TaskDuration`` metric: tasks of any length) while streaming, whether
the token map's box ended scrolled to its newest tokens, and the console errors and
uncaught page errors of the whole visit (the compare Reset included).

``--map-off-too --repeat 2`` measures each view with the live map on, then off, twice
over, so a neighbour's load on a shared machine hits both; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from tests.browser_support import (
    DONE_TIMEOUT_MS, chromium, configure, open_app, open_tab, page_errors, running_app,
    set_number, start_and_wait,
)

CHAT_TURNS = ["Name a fruit.", "What colour is it?", "Where does it grow?",
              "Write one sentence about it."]
LONG_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "pride_and_prejudice_ch1-6.txt"
LONG_CHAT_TURNS = ["Who are the people in this text?", "What does Mrs Bennet want?",
                   "Tell the story of the ball in a few sentences."]
LONG_REPLY_TURN = "Write a long story about a dragon."
STORY_BEGINNING = "The storm reached the island at dusk, and Mira climbed the stairs."

# Started before the page's own scripts: frame gaps and long tasks are recorded only
# while window.__measure.on is set, i.e. while a reply streams.
_PROBE = """
window.__measure = {on: false, gap: 0, longtask: 0, last: null};
new PerformanceObserver(list => {
  if (!window.__measure.on) return;
  for (const entry of list.getEntries()) window.__measure.longtask += entry.duration;
}).observe({type: "longtask", buffered: false});
(function frame(now) {
  const m = window.__measure;
  if (m.on && m.last !== null) m.gap = Math.max(m.gap, now - m.last);
  m.last = m.on ? now : null;
  requestAnimationFrame(frame);
})(performance.now());
"""


class MainThread:
    """The seconds a page's main thread has spent in tasks since this was made."""

    def __init__(self, page: Page) -> None:
        self._metrics = page.context.new_cdp_session(page)
        self._metrics.send("Performance.enable")

    def busy_s(self) -> float:
        return next(m["value"] for m in self._metrics.send("Performance.getMetrics")["metrics"]
                    if m["name"] == "TaskDuration")


@dataclass
class ViewResult:
    view: str
    turns: int = 0
    streaming_s: float = 0.0
    longest_gap_ms: float = 0.0
    longtask_ms: float = 0.0
    busy_s: float = 0.0
    main_thread: MainThread | None = field(default=None, repr=False)
    map_at_newest: bool | None = None
    errors: list[str] = field(default_factory=list)


def _streamed_turn(page: Page, result: ViewResult, start: Callable[[], None]) -> None:
    """One turn, measured from the click until the page has no running event left."""
    page.evaluate("() => Object.assign(window.__measure, {on: true, last: null})")
    busy = result.main_thread.busy_s()
    began = time.monotonic()
    start()
    # Attached, not visible: the first output marked may be one the page does not show.
    page.wait_for_selector(".generating", state="attached", timeout=10_000)
    page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
    result.streaming_s += time.monotonic() - began
    result.busy_s += result.main_thread.busy_s() - busy
    page.evaluate("() => { window.__measure.on = false; }")
    result.turns += 1


def _send(page: Page, box: str, button: str, text: str) -> Callable[[], None]:
    def start() -> None:
        page.fill(f"{box} textarea", text)
        page.click(button)
    return start


def chat(page: Page, result: ViewResult) -> None:
    for text in CHAT_TURNS:
        _streamed_turn(page, result, _send(page, "#chat-input", "#chat-send", text))


def long_chat(page: Page, result: ViewResult) -> None:
    """Measured once the chat is long: the turn that pastes the text is not."""
    text = LONG_TEXT.read_text()[:6000]
    page.fill("#chat-input textarea", f"Read this and tell me what it is about.\n\n{text}")
    start_and_wait(page, "#chat-send")
    for text in LONG_CHAT_TURNS:
        _streamed_turn(page, result, _send(page, "#chat-input", "#chat-send", text))


def long_reply_chat(page: Page, result: ViewResult) -> None:
    """One reply as long as --max-new-tokens: greedy, the story runs on."""
    _streamed_turn(page, result, _send(page, "#chat-input", "#chat-send", LONG_REPLY_TURN))


def compare(page: Page, result: ViewResult) -> None:
    for text in CHAT_TURNS:
        _streamed_turn(page, result, _send(page, "#compare-input", "#compare-send", text))
    page.click("#compare-reset")
    page.wait_for_function(
        "() => !document.querySelector('#compare-full-chat [data-testid=bot]')", timeout=30_000)
    time.sleep(2)  # errors a reset throws arrive after the chat clears


def story(page: Page, result: ViewResult) -> None:
    page.fill("#story-text textarea", STORY_BEGINNING)
    set_number(page, "story-tokens", 96)
    _streamed_turn(page, result, lambda: page.click("#story-continue"))


VIEWS: dict[str, Callable[[Page, ViewResult], None]] = {
    "chat": chat, "compare": compare, "story": story, "long-chat": long_chat, "long-reply-chat": long_reply_chat,
}


def measure(url: str, browser, view: str, max_new_tokens: int, live_map: bool = True) -> ViewResult:
    result = ViewResult(view if live_map else f"{view} (map not live)")
    tab = view.split("-")[-1]
    page = open_app(browser, url, width=1366, height=768)
    try:
        result.errors = page_errors(page)
        page.evaluate(_PROBE)
        result.main_thread = MainThread(page)
        open_tab(page, tab.title())
        configure(page, heavy=16, recent=16, max_new_tokens=max_new_tokens, seed=1)
        if not live_map:
            page.locator(f"#{tab}-map-live input").uncheck(force=True)
        VIEWS[view](page, result)
        numbers = page.evaluate("() => window.__measure")
        result.longest_gap_ms, result.longtask_ms = numbers["gap"], numbers["longtask"]
        result.map_at_newest = page.evaluate(_AT_NEWEST, f"#{tab}-token-map .tokmap")
    finally:
        page.context.close()
    return result


# Whether a scrolling token map shows its end (None: the map does not scroll).
_AT_NEWEST = """selector => {
  const map = document.querySelector(selector);
  if (!map || map.scrollHeight <= map.clientHeight) return null;
  return map.scrollTop + map.clientHeight >= map.scrollHeight - 4;
}"""


def table(results: list[ViewResult]) -> str:
    rows = [("view", "turns", "streaming s", "longest frame gap s", "long tasks s",
             "long tasks %", "main thread busy %", "map at newest", "console errors")]
    rows += [(r.view, str(r.turns), f"{r.streaming_s:.1f}", f"{r.longest_gap_ms / 1000:.2f}",
              f"{r.longtask_ms / 1000:.1f}", f"{r.longtask_ms / 10 / max(r.streaming_s, 1e-9):.0f}",
              f"{100 * r.busy_s / max(r.streaming_s, 1e-9):.0f}",
              {None: "-", True: "yes", False: "NO"}[r.map_at_newest], str(len(r.errors)))
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--views", nargs="+", choices=list(VIEWS),
                        default=[view for view in VIEWS if view != "long-reply-chat"])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--map-off-too", action="store_true",
                        help="measure each view again with the live map off")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure the whole list this many times over")
    args = parser.parse_args(argv)
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    with running_app() as url, sync_playwright() as playwright, chromium(playwright) as browser:
        results = []
        for _ in range(args.repeat):
            for view in args.views:
                for live in [True, False][: 1 + args.map_off_too]:
                    results.append(measure(url, browser, view, args.max_new_tokens, live))
                    print(table(results[-1:]).splitlines()[-1], flush=True)
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(table(results))
    for result in results:
        for error in sorted(set(result.errors))[:5]:
            print(f"{result.view}: {result.errors.count(error)}x {error[:200]}")


if __name__ == "__main__":
    main()
