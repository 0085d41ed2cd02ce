"""Replies cut short, in the real app and Debian's chromium: the marker under a reply
that reached max new tokens or was stopped, and Continue, which extends the same reply
with the model's own text (the marker never becomes part of the conversation)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from h2o_chat import ChatSession
from h2o_chat.config import load_config
from h2o_chat.ui.settings import new_cache

from .browser_support import (
    DONE_TIMEOUT_MS, configure, messages, open_tab, send, set_number, start_and_wait,
)

LONG = "Write a long story about a dragon."  # greedy, far more than 24 tokens to say


def _chips(page, chatbot: str) -> list[str]:
    """The markers (with their continue) under the last reply of a chat box."""
    return page.locator(f"#{chatbot} .option").all_inner_texts()


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _greedy_replies(model, tokenizer, turns: list[tuple[str, int]]) -> list[str]:
    """The replies of a chat on the app's default cache and system prompt, each turn
    ``(message, max_new_tokens)`` run at once."""
    config = load_config()
    session = ChatSession(model, tokenizer, new_cache(model, config.cache),
                          system_prompt=config.generation.system_prompt,
                          prefill_chunk_size=config.cache.prefill_chunk_size)
    return ["".join(session.send(text, temperature=0, max_new_tokens=limit)) for text, limit in turns]


def test_a_reply_cut_at_the_limit_is_marked_and_continue_extends_it(page, smollm):
    configure(page, max_new_tokens=12)
    send(page, "#chat-input", "#chat-send", LONG)
    first = messages(page, "chatbot", "bot")
    assert _chips(page, "chatbot") == ["… cut at the 12-token limit · continue"]
    start_and_wait(page, "#chatbot .option")
    # The same assistant message goes on: no new turn, the reply longer.
    continued = messages(page, "chatbot", "bot")
    assert messages(page, "chatbot", "user") == [LONG] and len(continued) == 1
    assert continued[0].startswith(first[0]) and len(continued[0]) > len(first[0])
    assert _chips(page, "chatbot") == ["… cut at the 12-token limit · continue"]  # cut again
    # The conversation goes on from the model's own text, as if the reply had run 24
    # tokens at once: the marker was never fed to it.
    send(page, "#chat-input", "#chat-send", "Thanks!")
    reference = _greedy_replies(*smollm, [(LONG, 24), ("Thanks!", 12)])
    assert [_plain(r) for r in messages(page, "chatbot", "bot")] == [_plain(r) for r in reference]
    assert messages(page, "chatbot", "user") == [LONG, "Thanks!"]


def test_a_stopped_reply_is_marked_and_continues(page):
    # The slider's longest reply: greedy, the story repeats itself for all of it, so it
    # outlasts a page that shows the stream late on a loaded machine (300 tokens did not).
    configure(page, max_new_tokens=1024)
    page.fill("#chat-input textarea", LONG)
    page.click("#chat-send")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
        ".some(e => e.innerText.length > 20)", timeout=DONE_TIMEOUT_MS)
    page.click("#chat-stop")
    expect(page.locator("#chat-send")).to_be_visible(timeout=30_000)
    page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
    assert _chips(page, "chatbot") == ["⏹ stopped · continue"]
    stopped = messages(page, "chatbot", "bot")
    set_number(page, "max-new-tokens", 8)
    start_and_wait(page, "#chatbot .option")
    continued = messages(page, "chatbot", "bot")
    assert len(continued) == 1 and len(continued[0]) > len(stopped[0])
    assert _chips(page, "chatbot") == ["… cut at the 8-token limit · continue"]
    # Undo takes back the whole turn, marker included.
    page.click("#chat-undo")
    expect(page.locator("#chatbot [data-testid=bot]")).to_have_count(0)
    assert _chips(page, "chatbot") == [] and page.input_value("#chat-input textarea") == LONG


def test_compare_marks_both_sides_and_continue_extends_both_in_the_same_turn(page):
    open_tab(page, "Compare")
    configure(page, max_new_tokens=12)
    send(page, "#compare-input", "#compare-send", LONG)
    chats = ["compare-bounded-chat", "compare-full-chat"]
    first = {chat: messages(page, chat, "bot") for chat in chats}
    for chat in chats:
        assert _chips(page, chat) == ["… cut at the 12-token limit · continue"]
    start_and_wait(page, "#compare-full-chat .option")
    for chat in chats:
        continued = messages(page, chat, "bot")
        assert messages(page, chat, "user") == [LONG] and len(continued) == 1
        assert len(continued[0]) > len(first[chat][0])
    expect(page.locator("#compare-divergence li")).to_have_count(1)  # still turn 1
    assert "24 tokens" in page.inner_text("#compare-divergence")


def test_a_stopped_story_continues(page):
    open_tab(page, "Story")
    set_number(page, "story-tokens", 300)
    beginning = "The storm reached the island at dusk."
    page.fill("#story-text textarea", beginning)
    page.click("#story-continue")
    page.wait_for_function(
        "n => document.querySelector('#story-text textarea').value.length > n",
        arg=len(beginning) + 20, timeout=DONE_TIMEOUT_MS)
    page.click("#story-stop")
    expect(page.locator("#story-continue")).to_be_visible(timeout=30_000)
    page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
    stopped = page.input_value("#story-text textarea")
    set_number(page, "story-tokens", 8)
    start_and_wait(page, "#story-continue")
    continued = page.input_value("#story-text textarea")
    assert continued.startswith(stopped) and len(continued) > len(stopped)


def test_the_story_box_is_read_only_while_a_continuation_streams(page):
    """Each streamed update rewrote the story box from the text the turn began with, so
    what the user typed there meanwhile was lost without a word: the box is read-only
    while Stop shows, and editable again once Continue is back."""
    open_tab(page, "Story")
    set_number(page, "story-tokens", 300)
    box = page.locator("#story-text textarea")
    box.fill("The storm reached the island at dusk.")
    page.click("#story-continue")
    expect(page.locator("#story-stop")).to_be_visible()
    expect(box).to_have_js_property("readOnly", True)
    box.click()
    page.keyboard.press("End")
    page.keyboard.type(" TYPED")
    page.click("#story-stop")
    expect(page.locator("#story-continue")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    expect(box).to_have_js_property("readOnly", False)
    story = box.input_value()
    assert "TYPED" not in story
    box.click()
    page.keyboard.press("Control+End")
    page.keyboard.type(" Then")
    assert box.input_value() == story + " Then"


def test_stop_holds_its_place_while_a_story_streams(page):
    """The story box grew a line at a time as a continuation streamed in, moving Stop
    below it away from the pointer (a click aimed at it landed on the slider above):
    the box holds its height while Stop shows, the text scrolling in it, and grows to fit
    once the continuation ends."""
    open_tab(page, "Story")
    configure(page)  # greedy: the story runs to the slider's longest
    set_number(page, "story-tokens", 1024)
    box = page.locator("#story-text textarea")
    box.fill("The storm reached the island at dusk.")
    page.click("#story-continue")
    stop = page.locator("#story-stop")
    expect(stop).to_be_visible()
    placed, opened = stop.bounding_box(), box.bounding_box()
    # Half as much story again as the box shows.
    page.wait_for_function("() => { const box = document.querySelector('#story-text textarea');"
                           " return box.scrollHeight > 1.5 * box.clientHeight; }", timeout=DONE_TIMEOUT_MS)
    assert (stop.bounding_box()["y"], box.bounding_box()["height"]) == (placed["y"], opened["height"])
    stop.click()
    expect(page.locator("#story-continue")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    expect(box).to_have_js_property("readOnly", False)
    page.wait_for_function(f"() => document.querySelector('#story-text textarea').offsetHeight > {opened['height']}")


# About 3,300 tokens: read on both sides, seconds of prefill on a small CPU, so the Stop
# that follows the click lands before either side's first token.
PASTE = " ".join(f"Line {i}: the keeper of the lighthouse counted {i * 7} ships tonight." for i in range(300))


VIEWS = {"Chat": ("chat", ["chatbot"]), "Compare": ("compare", ["compare-bounded-chat", "compare-full-chat"])}


@pytest.mark.parametrize("view", VIEWS)
def test_a_turn_stopped_before_the_first_token_gives_the_message_back(page, view):
    """A turn stopped while its message is read is taken back (both sides, in compare):
    the chats as before, the message back in its box to send again or edit. The next
    message gets whole replies: kept, the empty assistant turn taught the model to answer
    with nothing (in compare every later reply came out empty, on both sides)."""
    prefix, chats = VIEWS[view]
    open_tab(page, view)
    configure(page, max_new_tokens=12)
    page.fill(f"#{prefix}-input textarea", PASTE)
    page.click(f"#{prefix}-send")
    page.click(f"#{prefix}-stop")
    expect(page.locator(f"#{prefix}-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    expect(page.locator(f"#{prefix}-input textarea")).to_have_value(PASTE)
    for chat in chats:
        assert messages(page, chat, "user") == messages(page, chat, "bot") == []
    send(page, f"#{prefix}-input", f"#{prefix}-send", "Name three fruits.")
    for chat in chats:
        assert messages(page, chat, "user") == ["Name three fruits."]
        [reply] = messages(page, chat, "bot")
        assert len(reply.strip()) > 4, reply
