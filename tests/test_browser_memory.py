"""The limit on cache memory (``server.max_cache_mb``) in the real page: a message whose
turn would pass it is refused before anything is read, with the limit's message, and
stays in its box; one that fits is answered."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .browser_support import DONE_TIMEOUT_MS, configure, messages, open_tab, running_app, send

MAX_CACHE_MB = 40
# About 1,500 tokens: a full cache's turn on it is counted at more than 40 MB.
LONG = "The lighthouse keeper wrote down every ship that passed the rocks that winter. " * 75
# About 300 tokens: one full cache's turn on it fits in 40 MB, two do not.
MIDDLE = LONG[: len(LONG) // 5]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "memory.yaml"
    config.write_text(f"cache:\n  policy: full\nserver:\n  max_cache_mb: {MAX_CACHE_MB}\n")
    with running_app("--config", str(config)) as url:
        yield url


def test_a_message_past_the_cache_memory_is_refused_and_stays_in_its_box(page):
    configure(page, max_new_tokens=8)
    page.fill("#chat-input textarea", LONG)
    page.click("#chat-send")
    toast = page.locator("[data-testid=toast-body]")
    expect(toast).to_contain_text("this turn's caches may take up to ")
    expect(toast).to_contain_text(f"past what all conversations' caches may hold (server.max_cache_mb "
                                  f"= {MAX_CACHE_MB}): start a new conversation, use a bounded cache")
    expect(page.locator("#chat-input textarea")).to_have_value(LONG)
    assert messages(page, "chatbot", "user") == []
    send(page, "#chat-input", "#chat-send", "Hello!")
    expect(page.locator("#chatbot [data-testid=bot]")).to_have_count(1, timeout=DONE_TIMEOUT_MS)
    assert messages(page, "chatbot", "user") == ["Hello!"]


def test_a_compare_turn_whose_two_sides_fit_only_alone_is_refused_whole(page):
    """Both sides are full caches here (the page's cache is the config's, full): each
    side's turn on this message fits in the limit, the two together do not."""
    configure(page, max_new_tokens=8)
    open_tab(page, "Compare")
    page.fill("#compare-input textarea", MIDDLE)
    page.click("#compare-send")
    toast = page.locator("[data-testid=toast-body]")
    expect(toast).to_contain_text("this turn's caches may take up to ")
    expect(toast).to_contain_text(f"(server.max_cache_mb = {MAX_CACHE_MB})")
    expect(page.locator("#compare-input textarea")).to_have_value(MIDDLE)
    assert messages(page, "compare-bounded-chat", "user") == messages(page, "compare-full-chat", "user") == []
