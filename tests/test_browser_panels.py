"""The compare view's panels in the real app and Debian's chromium: a fidelity panel that
takes no room while off and opens its detail at the highlighted tokens, gauges and the
memory plot telling the same numbers, and a server line that follows this page's turn."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from playwright.sync_api import expect

from .browser_support import (
    DONE_TIMEOUT_MS, choose, configure, gauge, open_app, open_tab, send,
)

DATA = Path(__file__).parent / "data"


def test_the_fidelity_panel_takes_no_room_while_off(page):
    open_tab(page, "Compare")
    expect(page.locator("#compare-fidelity-on")).to_be_visible()
    # Nothing to show yet: no plot, token box, or blank summary and detail frames.
    for part in ("plot", "step", "summary", "detail"):
        expect(page.locator(f"#compare-fidelity-{part}")).to_be_hidden()
    configure(page, max_new_tokens=4)
    send(page, "#compare-input", "#compare-send", "Hi!")
    expect(page.locator("#compare-fidelity-summary")).to_contain_text("fidelity gauge off")
    for part in ("plot", "step", "detail"):
        expect(page.locator(f"#compare-fidelity-{part}")).to_be_hidden()


def test_the_fidelity_detail_opens_at_its_first_highlighted_token(browser, app_url):
    # Narrow (but wider than a phone, where the panel starts folded), so the conversation
    # overflows its box; the sink holds the first 200 tokens, so every forgotten
    # (highlighted) token lies below the box's first lines.
    page = open_app(browser, app_url, width=700, height=900)
    try:
        open_tab(page, "Compare")
        configure(page, sink=200, heavy=8, recent=8, max_new_tokens=8)
        page.check("#compare-fidelity-on input")
        text = (DATA / "pride_and_prejudice_ch1-6.txt").read_text()[:1500]
        send(page, "#compare-input", "#compare-send", f"Summarize in one line: {text}")
        box = page.locator("#compare-fidelity-detail .fidtext")
        first = box.locator("mark").first
        assert int(first.get_attribute("data-pos")) >= 200
        page.wait_for_function(
            """() => {
              const box = document.querySelector('#compare-fidelity-detail .fidtext');
              const mark = box.querySelector('mark').getBoundingClientRect();
              const shown = box.getBoundingClientRect();
              return mark.top >= shown.top && mark.bottom <= shown.bottom;
            }""", timeout=10_000)
    finally:
        page.context.close()


def test_the_gauges_and_the_memory_plot_say_the_same(page):
    open_tab(page, "Compare")
    # An empty full cache: an empty bar, not a full one.
    expect(page.locator("#compare-full-gauge .gauge")).to_have_attribute("data-state", "empty")
    assert page.locator("#compare-full-gauge .gbar div").bounding_box()["width"] == 0
    configure(page, heavy=8, recent=8, max_new_tokens=8)
    send(page, "#compare-input", "#compare-send", "Tell me about the rivers and bridges of Paris.")
    plot = page.locator("#compare-memory-plot svg")
    expect(plot.locator("[aria-label^='turn: 1;']").first).to_be_attached()  # drawn
    labels = plot.locator("[aria-label]").evaluate_all(
        "marks => marks.map(m => m.getAttribute('aria-label'))")
    y_axis = next(label for label in labels if label.startswith("Y-axis"))
    assert re.search(r"values from 0(\.0+)? to", y_axis), y_axis
    plotted = {cache: float(mb) for mb, cache in
               (re.fullmatch(r"turn: 1; KV MB in use: ([\d.]+); cache: (.+)", label).groups()
                for label in labels if label.startswith("turn: 1;"))}
    for side in ("bounded", "full"):
        shown = gauge(page, f"compare-{side}-gauge")
        title = page.locator(f"#compare-{side}-gauge .glabel").inner_text()
        assert plotted[title] == round(int(shown["heldBytes"]) / 1e6, 3), (side, plotted, shown)


def _regular_line_polls(url: str) -> set[int]:
    """The events that refresh the server line on a timer every page runs from the start
    (the rare poll that also catches other browsers' turns)."""
    with urllib.request.urlopen(url + "config") as response:
        config = json.load(response)
    line = next(c["id"] for c in config["components"] if c["props"].get("elem_id") == "server-load")
    always = {c["id"] for c in config["components"] if c["type"] == "timer" and c["props"]["active"]}
    return {d["id"] for d in config["dependencies"]
            if line in d["outputs"] and any(target in always for target, _ in d["targets"])}


def test_the_server_line_follows_this_pages_turn(browser, app_url):
    polls = _regular_line_polls(app_url)
    assert polls
    page = open_app(browser, app_url)
    try:
        # Without the rare poll, only what this page's own turn sets off updates the line.
        def join(route):
            if json.loads(route.request.post_data)["fn_index"] in polls:
                route.fulfill(json={"event_id": "held back by the test"})
            else:
                route.continue_()

        page.route("**/queue/join*", join)
        # The slider's longest reply (greedy, the story runs all of it), stopped once seen:
        # a 64-token reply could end before a poll came through on a loaded machine.
        configure(page, max_new_tokens=1024)
        line = page.locator("#server-load")
        expect(line).to_contain_text("· 0 generating")
        page.fill("#chat-input textarea", "Write a long story about a lighthouse keeper.")
        page.click("#chat-send")
        # The server counts a turn only while it streams: seen, it was seen in time.
        expect(line).to_contain_text("· 1 generating", timeout=DONE_TIMEOUT_MS)
        page.keyboard.press("Escape")
        expect(page.locator("#chat-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
        expect(line).to_contain_text("· 0 generating")
    finally:
        page.context.close()


def test_compare_at_equal_bytes_with_8_and_4_bit_slots(page):
    """The bounded side gets a budget in megabytes at 8-bit keys and 4-bit values; its
    title names the megabytes and its gauge the bits, bytes and slots the budget buys."""
    open_tab(page, "Compare")
    configure(page, max_new_tokens=6)
    choose(page, "key-bits", "8")
    choose(page, "value-bits", "4")
    page.fill("#budget-mb textarea, #budget-mb input", "0.8")
    page.locator("#budget-mb textarea, #budget-mb input").press("Tab")
    # The idle side follows the settings: its title and its empty gauge name the bytes.
    expect(page.locator("#compare-bounded-gauge .gauge")).to_have_attribute("data-budget-bytes", "800000")
    expect(page.get_by_text("turns cache (0.8 MB, K8/V4)").first).to_be_visible()
    send(page, "#compare-input", "#compare-send", "Tell me about the rivers and bridges of Paris. " * 8)
    bounded, full = gauge(page, "compare-bounded-gauge"), gauge(page, "compare-full-gauge")
    assert (bounded["keyBits"], bounded["valueBits"], bounded["budgetBytes"]) == ("8", "4", "800000")
    assert bounded["state"] == "at-budget" and int(bounded["heldBytes"]) <= 800_000
    assert (full["keyBits"], full["valueBits"], full["budgetBytes"]) == ("32", "32", "")
    # Equal bytes buy the 8/4-bit cache more tokens than float32 slots would.
    assert int(full["heldBytes"]) // int(full["held"]) > 3 * (int(bounded["heldBytes"]) // int(bounded["held"]))
    expect(page.locator("#compare-bounded-gauge")).to_contain_text("keys 8-bit, values 4-bit")
