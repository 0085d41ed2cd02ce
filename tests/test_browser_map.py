"""The retained-token map in the real app and Debian's chromium: a heat map that says what
its rows, colours and blocks are, a token box that keeps to the newest tokens, and
settings that explain their jargon."""

from __future__ import annotations

import base64
import re
from io import BytesIO
from pathlib import Path

from PIL import Image

from .browser_support import (
    configure, gauge, open_app, open_tab, show_settings, start_and_wait,
)

LONG_TEXT = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1-6.txt").read_text()[:2500]
AT_END = """() => {
  const map = document.querySelector('#chat-token-map .tokmap');
  return map !== null && map.scrollHeight > map.clientHeight &&
         map.scrollTop + map.clientHeight >= map.scrollHeight - 4;
}"""


def _long_message(page, max_new_tokens: int) -> None:
    """A ~700-token conversation on a 36-slot budget: most of it evicted."""
    configure(page, heavy=16, recent=16, max_new_tokens=max_new_tokens)
    page.fill("#chat-input textarea", f"Summarize this in one line: {LONG_TEXT}")


def test_the_heat_map_labels_its_layers_and_explains_colours_and_blocks(page):
    _long_message(page, max_new_tokens=8)
    start_and_wait(page, "#chat-send")
    heat = page.locator("#chat-heat-map")
    src = heat.locator("img").get_attribute("src")
    layers = Image.open(BytesIO(base64.b64decode(src.split(",", 1)[1]))).height
    rows = heat.locator(".hrows li")
    assert rows.count() == layers == 30  # one row, hover target and label, per layer
    seen = int(gauge(page, "chat-gauge")["seen"])
    for layer in range(layers):
        title = rows.nth(layer).get_attribute("title")
        match = re.fullmatch(rf"layer {layer}, all 3 KV heads: each keeps (\d+) of {seen} "
                             r"positions \((\d+) evicted\); (\d+) kept by at least one head", title)
        assert match, title
        kept, evicted, anywhere = map(int, match.groups())
        assert kept + evicted == seen and kept <= anywhere < seen
    labels = heat.locator(".hrows li b").all_inner_texts()
    assert labels[0] == "0" and labels[-1] == str(layers - 1)
    for label in heat.locator(".hrows li b").all():  # labels sit beside their row, not on it
        assert label.bounding_box()["x"] + label.bounding_box()["width"] <= heat.locator(
            "img").bounding_box()["x"] + 1
    legend = heat.locator(".maplegend").inner_text()
    assert "kept by every KV head" in legend and "evicted" in legend
    note = heat.locator(".heatnote").inner_text()
    assert "left: the first 4 tokens" in note and "21 pinned tokens" in note
    assert "right: the recent window, the newest 16 tokens" in note
    # The token map's runs carry their counts too.
    titles = page.locator("#chat-token-map .tokmap span").evaluate_all(
        "spans => spans.map(s => s.title)")
    odd = [t for t in titles if not re.fullmatch(
        r"#\d+(–\d+)?: (kept by \d+(–\d+)? of 90 pairs|evicted by every pair|not fed yet)", t)]
    assert titles and not odd, odd


def test_the_token_box_keeps_to_the_newest_tokens(browser, app_url):
    page = open_app(browser, app_url, width=700, height=900)
    try:
        _long_message(page, max_new_tokens=48)
        page.click("#chat-send")
        page.wait_for_function(AT_END, timeout=60_000)  # follows while the reply streams
        # Looking at another tab until the reply is over, then coming back: the box shows
        # the end of the reply, not its top.
        open_tab(page, "Story")
        page.wait_for_selector(".generating", state="detached", timeout=120_000)
        open_tab(page, "Chat")
        page.wait_for_function(AT_END, timeout=10_000)
        # Scrolled up to read, then a new chat: its map follows its newest tokens again.
        page.locator("#chat-token-map .tokmap").hover()
        page.mouse.wheel(0, -600)
        page.wait_for_function(f"() => !({AT_END})()", timeout=10_000)
        page.click("#chat-new")
        page.wait_for_function("() => !document.querySelector('#chat-token-map .tokmap')")
        _long_message(page, max_new_tokens=4)
        start_and_wait(page, "#chat-send")
        page.wait_for_function(AT_END, timeout=10_000)
    finally:
        page.context.close()


def test_the_live_map_shows_the_newest_tokens_then_all_at_the_end(page):
    _long_message(page, max_new_tokens=48)
    page.click("#chat-send")
    note = page.locator("#chat-token-map .mapnote")
    # Read as it shows: read again later, a busy machine had the reply over and the note gone.
    streaming_note = page.wait_for_function(
        "() => { const t = document.querySelector('#chat-token-map .mapnote')?.innerText;"
        " return t && t.includes('while the reply streams') ? t : null; }", timeout=60_000).json_value()
    assert re.fullmatch(r"showing the newest 500 of \d+ tokens while the reply streams; "
                        "all at its end", streaming_note)
    page.wait_for_selector(".generating", state="detached", timeout=120_000)
    tokens = int(gauge(page, "chat-gauge")["tokens"])
    assert note.inner_text() == ""
    tokmap = page.locator("#chat-token-map .tokmap")
    assert tokmap.get_attribute("data-tokens") == str(tokens)
    first, last = (tokmap.locator("span").nth(i).get_attribute("title") for i in (0, -1))
    assert first.startswith("#0") and re.match(rf"#(\d+–)?{tokens - 1}:", last), (first, last)


def test_the_cache_settings_say_what_each_budget_keeps(page):
    show_settings(page)
    explained = {
        "heavy": "older tokens kept because they drew the most attention",
        "recent": "the newest tokens, always kept",
        "sink": "the first tokens, always kept: attention leans on them",
        "policy": "which tokens the model keeps in memory once the budget is full",
    }
    for elem_id, line in explained.items():
        assert line in page.inner_text(f"#{elem_id}"), elem_id
