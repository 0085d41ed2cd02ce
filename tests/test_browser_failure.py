"""Turns that end badly, in the real app (with a failure injected, see ``failing_app.py``)
and Debian's chromium: a reply that fails inside its turn (the page says so, Send or
Continue comes back in every view, the conversation goes on), and a view reset while its
reply streams (refused: the turn would go on drawing over the new conversation)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from .browser_support import DONE_TIMEOUT_MS, LONG_COUNTING_REPLY, configure, messages, open_tab, running_app
from .failing_app import FAIL_FIRST_MARK, FAIL_MARK

STREAMING = "A reply is still streaming: press Stop (or Esc) first."
FAILED = ("The reply failed: RuntimeError: injected failure mid-reply. The conversation keeps what "
          "was generated before the failure; you can send again.")
FAILED_FIRST = "The reply failed before it began: RuntimeError: injected failure before the reply; "
MESSAGE_BACK = FAILED_FIRST + "the message is back in its box, and the conversation is as it was before it."
# Gradio's mark on each output of an event that raised: a red "Error" pill over it, the
# message box included.
ERROR_PILL = "[data-testid=status-tracker] .error"


@pytest.fixture(scope="module")
def app_url():
    with running_app(script=Path(__file__).parent / "failing_app.py") as url:
        yield url


def _failed_then_back(page, send: str, stop: str) -> None:
    """The failure's message shows once, Send (Continue) comes back, and the message goes
    by itself (10 s) before the next failure: Gradio 6.31 adds an error that comes while
    another shows to the same toast (one toast per kind), so a second view's failure
    within 10 s read as the first one's message twice."""
    failed = page.locator("[data-testid=toast-text]", has_text=FAILED)
    expect(failed).to_have_count(1, timeout=DONE_TIMEOUT_MS)
    expect(page.locator(send)).to_be_visible(timeout=30_000)
    expect(page.locator(stop)).to_be_hidden()
    # Send is back: the steps chained on the failure (the swap back) have run, and none
    # showed the message again.
    assert page.locator("[data-testid=toast-text]").all_inner_texts() == [FAILED]
    assert page.locator(ERROR_PILL).count() == 0
    expect(failed).to_have_count(0, timeout=60_000)


def test_after_a_failed_reply_send_comes_back_in_every_view(page):
    configure(page, max_new_tokens=8)
    page.fill("#chat-input textarea", f"{FAIL_MARK} Say something.")
    page.click("#chat-send")
    _failed_then_back(page, "#chat-send", "#chat-stop")
    page.fill("#chat-input textarea", "Are you there?")
    page.click("#chat-send")
    expect(page.locator("#chatbot [data-testid=bot]")).to_have_count(2, timeout=DONE_TIMEOUT_MS)
    expect(page.locator("#chat-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    assert messages(page, "chatbot", "user")[-1] == "Are you there?"

    open_tab(page, "Story")
    page.fill("#story-text textarea", f"{FAIL_MARK} Once upon a time")
    page.click("#story-continue")
    _failed_then_back(page, "#story-continue", "#story-stop")

    open_tab(page, "Compare")
    page.fill("#compare-input textarea", f"{FAIL_MARK} Say something.")
    page.click("#compare-send")
    _failed_then_back(page, "#compare-send", "#compare-stop")


def test_a_chat_reply_that_fails_before_its_first_token_gives_the_message_back(page):
    """The session takes such a turn back (the conversation is as it was), so the page
    puts the message back in its box, pin tick and all: lost, it would have to be typed
    again (a turn refused by the cache memory as it begins fails so)."""
    configure(page, max_new_tokens=8)
    message = f"{FAIL_FIRST_MARK} Say something."
    page.fill("#chat-input textarea", message)
    page.check("#chat-pin-message input")
    page.click("#chat-send")
    failed = page.locator("[data-testid=toast-text]", has_text=MESSAGE_BACK)
    expect(failed).to_have_count(1, timeout=DONE_TIMEOUT_MS)
    expect(page.locator("#chat-send")).to_be_visible(timeout=30_000)
    expect(page.locator("#chat-input textarea")).to_have_value(message)
    expect(page.locator("#chat-pin-message input")).to_be_checked()
    assert messages(page, "chatbot", "user") == []
    assert page.locator(ERROR_PILL).count() == 0
    expect(failed).to_have_count(0, timeout=60_000)  # the next view's note stands alone


def test_a_story_or_compare_reply_that_fails_before_its_first_token_keeps_the_text(page):
    """The story box keeps the text the writer added (the session took it back with the
    turn, so the box showed the story without it); compare gives its message back and
    both sides stay as they were."""
    configure(page, max_new_tokens=8)
    open_tab(page, "Story")
    story = f"Once upon a time there was a lighthouse. {FAIL_FIRST_MARK}"
    page.fill("#story-text textarea", story)
    page.click("#story-continue")
    taken_back = FAILED_FIRST + "the story is as it was before it, and your text stays in its box."
    failed = page.locator("[data-testid=toast-text]", has_text=taken_back)
    expect(failed).to_have_count(1, timeout=DONE_TIMEOUT_MS)
    expect(page.locator("#story-continue")).to_be_visible(timeout=30_000)
    expect(page.locator("#story-text textarea")).to_have_value(story)
    assert page.locator(ERROR_PILL).count() == 0
    expect(failed).to_have_count(0, timeout=60_000)

    open_tab(page, "Compare")
    message = f"{FAIL_FIRST_MARK} Say something."
    page.fill("#compare-input textarea", message)
    page.click("#compare-send")
    expect(page.locator("[data-testid=toast-text]", has_text=MESSAGE_BACK)).to_have_count(1, timeout=DONE_TIMEOUT_MS)
    expect(page.locator("#compare-send")).to_be_visible(timeout=30_000)
    expect(page.locator("#compare-input textarea")).to_have_value(message)
    assert messages(page, "compare-bounded-chat", "user") == messages(page, "compare-full-chat", "user") == []
    assert page.locator(ERROR_PILL).count() == 0
    page.fill("#compare-input textarea", "Hello!")
    page.click("#compare-send")
    expect(page.locator("#compare-full-chat [data-testid=bot]")).to_have_count(1, timeout=DONE_TIMEOUT_MS)
    expect(page.locator("#compare-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    assert messages(page, "compare-bounded-chat", "user") == messages(page, "compare-full-chat", "user") == ["Hello!"]


def test_a_view_reset_while_its_reply_streams_is_refused(page):
    configure(page, max_new_tokens=300, **LONG_COUNTING_REPLY)
    page.fill("#chat-input textarea", "Count from one to two hundred in words.")
    page.click("#chat-send")
    page.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
                           ".some(e => e.innerText.length > 20)", timeout=DONE_TIMEOUT_MS)
    page.click("#chat-new")
    expect(page.locator("[data-testid=toast-body]", has_text=STREAMING)).to_have_count(1)
    assert messages(page, "chatbot", "user") == ["Count from one to two hundred in words."]
    page.click("#chat-stop")
    expect(page.locator("#chat-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    page.click("#chat-new")  # once the reply stopped, New chat clears it
    expect(page.locator("#chatbot [data-testid=user]")).to_have_count(0)
