"""The first start of a fresh install, in the real app and Debian's chromium: the model is
converted from its GGUF first (into a cache folder of this module's own, so the load
takes its real first-start time), and what the user sends meanwhile shows at once."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .browser_support import (
    DONE_TIMEOUT_MS, configure, messages, open_tab, running_app, set_number, show_settings,
)

LOADING = "Loading the model"
WAITING = "(waiting for the model to load…)"


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    with running_app(env={"H2O_CHAT_CACHE": str(tmp_path_factory.mktemp("converted-models"))}) as url:
        yield url


def _still_loading(page) -> None:
    """Fails the test, as inconclusive, once the model is up: what it checked must have
    shown while the model was loading."""
    assert LOADING in page.inner_text("#model-status"), "the model loaded before the check"


def test_messages_sent_while_the_model_loads_show_at_once(browser, app_url):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(app_url)
        expect(page.locator("#model-status")).to_contain_text(LOADING, timeout=60_000)
        configure(page, max_new_tokens=8)  # short replies once it is up
        show_settings(page, False)
        page.fill("#chat-input textarea", "Hello?")
        page.click("#chat-send")
        expect(page.locator("#chatbot [data-testid=user]")).to_have_text(["Hello?"])
        expect(page.locator("#chatbot [data-testid=bot]")).to_have_text([WAITING])
        _still_loading(page)

        open_tab(page, "Compare")
        page.fill("#compare-input textarea", "Hi both!")
        page.click("#compare-send")
        for chat in ("compare-bounded-chat", "compare-full-chat"):
            expect(page.locator(f"#{chat} [data-testid=user]")).to_have_text(["Hi both!"])
            expect(page.locator(f"#{chat} [data-testid=bot]")).to_have_text([WAITING])
        _still_loading(page)

        open_tab(page, "Story")
        set_number(page, "story-tokens", 8)
        page.fill("#story-text textarea", "The storm reached the island at dusk.")
        page.click("#story-continue")
        expect(page.locator("[data-testid=toast-body]", has_text="Waiting for the model to load")
               ).to_have_count(1)
        _still_loading(page)

        # Once loaded, every view answers what it was sent.
        expect(page.locator("#model-status")).to_contain_text("Model ready", timeout=DONE_TIMEOUT_MS)
        page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
        for chat, text in [("chatbot", "Hello?"), ("compare-bounded-chat", "Hi both!"),
                           ("compare-full-chat", "Hi both!")]:
            # Stripped: the chats of tabs not in view give their text a trailing newline.
            assert [m.strip() for m in messages(page, chat, "user")] == [text]
            replies = [m.strip() for m in messages(page, chat, "bot")]
            assert len(replies) == 1 and replies[0] and replies[0] != WAITING
        story = page.input_value("#story-text textarea")
        assert story.startswith("The storm reached the island at dusk.") and len(story) > 37
    finally:
        page.context.close()
