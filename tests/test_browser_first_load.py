"""The first start of a fresh install, in the real app and Debian's chromium: the model is
converted from its GGUF first (into a cache folder of the test's own, so the load takes
its real first-start time), and what the user sends meanwhile shows at once."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import expect

from .browser_support import DONE_TIMEOUT_MS, messages, open_tab, running_app

LOADING = "Loading the model"
WAITING = "(waiting for the model to load…)"


ATTEMPTS = 3
# Whether an element matching the selector ever shows the text, from now on (a waiting
# note is replaced by the reply once the model is up, so it is watched, not looked for).
_WATCH_TEXT = """([selector, text]) => {
  const state = {seen: false};
  const look = () => {
    if ([...document.querySelectorAll(selector)].some(e => e.textContent.includes(text))) {
      state.seen = true;
      observer.disconnect();
    }
  };
  const observer = new MutationObserver(look);
  observer.observe(document.body, {subtree: true, childList: true, characterData: true});
  look();
  return state;
}"""


def _watch_text(page, selector: str, text: str):
    return page.evaluate_handle(_WATCH_TEXT, [selector, text])


def _loading(url: str) -> bool:
    """The server's own word: the model is not up yet (it never goes back to loading)."""
    return httpx.get(url + "health").json()["status"] == "loading"


def test_messages_sent_while_the_model_loads_show_at_once(browser, tmp_path):
    # Each try starts the app on an empty conversion cache, so the model's real first-start
    # conversion runs. A busy machine may finish it before the server has taken the sends
    # of all three views (the server says so before the views are looked at); such a try
    # cannot test what happens while the model loads, and the next one starts afresh.
    # Short greedy replies by the config file, not typed into the page: on a loaded
    # machine typing them took long enough for the model to be up before the sends.
    config = tmp_path / "short-replies.yaml"
    config.write_text("generation:\n  temperature: 0\n  max_new_tokens: 8\n")
    for attempt in range(ATTEMPTS):
        with running_app("--config", str(config),
                         env={"H2O_CHAT_CACHE": str(tmp_path / f"converted-models-{attempt}")}) as url:
            if _sent_while_loading(browser, url):
                return
    pytest.fail(f"the model loaded before the server had taken every view's send, {ATTEMPTS} times")


def _send(page, button: str, text: str) -> None:
    """Click ``button`` and wait until the server has queued the event that sends ``text``
    (its answer to the page's join request)."""
    with page.expect_response(lambda r: "queue/join" in r.url and text in (r.request.post_data or "")):
        page.click(button)


def _sent_while_loading(browser, url: str) -> bool:
    """Send in the chat, compare and story views while the model loads; False if it was up
    before the server had queued the last send. Each view must show at once that it waits
    (watched from before the sends: the note goes once the model is up), then answer once
    the model is up."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(url)
        expect(page.locator("#model-status")).to_contain_text(LOADING, timeout=60_000)
        waits = [_watch_text(page, f"#{chat} [data-testid=bot]", WAITING)
                 for chat in ("chatbot", "compare-bounded-chat", "compare-full-chat")]
        waits.append(_watch_text(page, "[data-testid=toast-body]", "Waiting for the model to load"))

        page.fill("#chat-input textarea", "Hello?")
        _send(page, "#chat-send", "Hello?")
        open_tab(page, "Compare")
        page.fill("#compare-input textarea", "Hi both!")
        _send(page, "#compare-send", "Hi both!")
        open_tab(page, "Story")
        page.fill("#story-text textarea", "The storm reached the island at dusk.")
        _send(page, "#story-continue", "The storm reached the island at dusk.")
        if not _loading(url):
            return False
        # Every send was queued while the model loads, and a free generation slot runs
        # it at once (four slots, three sends): each view says it waits.
        for wait in waits:
            page.wait_for_function("state => state.seen", arg=wait, timeout=30_000)

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
        return True
    finally:
        page.context.close()
