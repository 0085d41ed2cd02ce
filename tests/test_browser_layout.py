"""The page's layout in the real app and Debian's chromium: at 400 px wide nothing is cut
off and a short chat is a short page, on a phone each view's message or Continue row is
in view (on a small, short or sideways one, below the reply's end and the story), a tap
shows what hovering shows, and at 1366 × 768 no chat icon covers the conversation and
the edit box is wide enough to edit in."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

from .browser_support import (
    configure, messages, open_app, open_tab, send, set_number, settled_box, show_settings,
    start_and_wait,
)

NARROW = {"width": 400, "height": 768}
PHONE = {"width": 390, "height": 844}
WIDE = {"width": 1366, "height": 768}
# A tablet upright, where Gradio's page is 768 px wide, and a small laptop.
TABLET, SMALL_LAPTOP = {"width": 768, "height": 1024}, {"width": 1024, "height": 768}
# The chat and story views at 400 px with a two-turn chat: 3,184 and 2,304 px tall before
# their secondary panels folded on narrow screens.
SHORT_PAGE_PX = 2000
QUESTIONS = ["Hi! Who are you?", "Name three fruits."]

# Texts a reader cannot see whole: text running out of the box that clips it (or out of
# the window, or out of its own box, as a button's label wider than the button), and
# input values wider than their input. Screen-reader-only text is meant to be clipped,
# and Gradio measures its tab bar in a hidden copy.
CUT_TEXTS = """() => {
  const cut = [];
  const windowWidth = document.documentElement.clientWidth;
  const where = e => `${e.closest('[id]')?.id}: ${(e.value || e.textContent).trim().slice(0, 40)}`;
  const clipper = e => {
    for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
      if (getComputedStyle(a).overflowX !== 'visible') return a;
    return null;
  };
  const texts = document.querySelectorAll(
    'label, span, button, p, li, td, th, input[type=text], input:not([type])');
  for (const e of texts) {
    if (!e.checkVisibility() || e.closest('.sr-only, .visually-hidden')) continue;
    const box = e.getBoundingClientRect();
    if (!box.width || !box.height) continue;
    if (e.tagName === 'INPUT') {
      if (e.scrollWidth > e.clientWidth + 1) cut.push('value cut: ' + where(e));
      continue;
    }
    if (![...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())) continue;
    const clip = clipper(e)?.getBoundingClientRect();
    if (box.right > windowWidth + 1 || box.left < -1) cut.push('off the window: ' + where(e));
    else if (clip && (box.right > clip.right + 1 || box.left < clip.left - 1))
      cut.push('cut by its box: ' + where(e));
    else if (getComputedStyle(e).display !== 'inline' && e.scrollWidth > e.clientWidth + 1)
      cut.push('runs out of its box: ' + where(e));
  }
  return cut;
}"""

# For each user message of a chat, scrolled to the top of the conversation: the chat's
# icons outside the conversation (Clear, ...) that overlap it.
ICONS_OVER_TOP_MESSAGES = """(chat) => {
  let box = chat.querySelector('[role=log]');
  while (!(box.scrollHeight > box.clientHeight + 4 &&
           /auto|scroll/.test(getComputedStyle(box).overflowY))) box = box.parentElement;
  const icons = [...chat.querySelectorAll('button')].filter(
    b => !box.contains(b) && b.checkVisibility() && b.getBoundingClientRect().width);
  const covered = [];
  for (const message of chat.querySelectorAll('[data-testid=user]')) {
    const bubble = message.closest('.message-row') || message;
    box.scrollTop += bubble.getBoundingClientRect().top - box.getBoundingClientRect().top;
    const [m, view] = [bubble.getBoundingClientRect(), box.getBoundingClientRect()];
    const top = Math.max(m.top, view.top), bottom = Math.min(m.bottom, view.bottom);
    for (const icon of icons) {
      const i = icon.getBoundingClientRect();
      if (i.left < m.right - 1 && i.right > m.left + 1 && i.top < bottom - 1 && i.bottom > top + 1)
        covered.push(`${icon.getAttribute('aria-label')} over "${message.textContent.trim()}"`);
    }
  }
  return covered;
}"""



def _page_height(page) -> int:
    return page.evaluate("() => document.documentElement.scrollHeight")


def _nothing_cut(page) -> None:
    """No text stays cut off (while the page settles, the tab bar measures itself)."""
    try:
        page.wait_for_function(f"() => ({CUT_TEXTS})().length === 0", timeout=5_000)
    except PlaywrightTimeout:
        pytest.fail(f"cut off: {page.evaluate(CUT_TEXTS)}")


def _unfold(page, panel: str) -> None:
    header = page.locator(f"#{panel} > .label-wrap")
    if "open" not in header.get_attribute("class").split():
        header.click()
    expect(header).to_have_class(re.compile(r"\bopen\b"))


def test_at_400_px_nothing_is_cut_and_a_short_chat_is_a_short_page(browser, app_url):
    page = open_app(browser, app_url, **NARROW)
    try:
        configure(page, max_new_tokens=24)
        _nothing_cut(page)  # the settings
        show_settings(page, False)
        for question in QUESTIONS:
            send(page, "#chat-input", "#chat-send", question)
        assert _page_height(page) < SHORT_PAGE_PX
        _nothing_cut(page)
        for panel in ("chat-pins", "chat-map"):  # folded, still there
            _unfold(page, panel)
        _nothing_cut(page)
        # The heat map's axis: its ends under the image's ends, the caption apart.
        image = page.locator("#chat-heat-map .heat img").bounding_box()
        first, caption, last = (page.locator("#chat-heat-map .heataxis span").nth(i).bounding_box()
                                for i in range(3))
        assert abs(first["x"] - image["x"]) <= 2
        assert abs(last["x"] + last["width"] - image["x"] - image["width"]) <= 2
        assert caption["y"] >= max(first["y"] + first["height"], last["y"] + last["height"]) - 1
        open_tab(page, "Story")
        expect(page.locator("#story-text")).to_be_visible()
        assert _page_height(page) < SHORT_PAGE_PX
        _nothing_cut(page)
        open_tab(page, "Compare")
        expect(page.locator("#compare-input")).to_be_visible()
        _nothing_cut(page)
    finally:
        page.context.close()


@pytest.mark.parametrize("size", [TABLET, SMALL_LAPTOP], ids=["768x1024", "1024x768"])
def test_the_send_row_is_whole_and_in_view_on_a_tablet_and_a_small_laptop(browser, app_url, size):
    # At both sizes "pin this message" was squeezed to 80 px and cut ("pin th messa"); at
    # 768 x 1024 Send wrapped under the box, 60 px below the window, and the pins' table
    # ran out of its panel.
    page = open_app(browser, app_url, **size)
    try:
        for elem_id in ("chat-input", "chat-pin-message", "chat-send"):
            box = settled_box(page, f"#{elem_id}")
            assert box["y"] + box["height"] <= size["height"], (elem_id, box)
        _nothing_cut(page)
        configure(page, max_new_tokens=4)
        show_settings(page, False)
        send(page, "#chat-input", "#chat-send", "Hi!")
        expect(page.locator("#chat-pin-list .pins")).to_have_attribute("data-count", "1")
        _nothing_cut(page)
    finally:
        page.context.close()


def _in_window(page, selector: str, size: dict[str, int]) -> None:
    box = settled_box(page, selector)
    assert 0 <= box["x"] and box["x"] + box["width"] <= size["width"], (selector, box)
    assert 0 <= box["y"] and box["y"] + box["height"] <= size["height"], (selector, box)


def _chat(page) -> None:
    # The conversation ends above the row, which so covers no reply's end (where it streams).
    chat = settled_box(page, "#chatbot")
    assert chat["y"] + chat["height"] <= settled_box(page, "#chat-send-row")["y"] + 1
    send(page, "#chat-input", "#chat-send", "Name a fruit.")
    assert [m.strip() for m in messages(page, "chatbot", "user")] == ["Name a fruit."]
    assert messages(page, "chatbot", "bot")[0].strip()


def _story(page) -> None:
    beginning = "The storm reached the island at dusk."
    page.fill("#story-text textarea", beginning)
    set_number(page, "story-tokens", 8)
    start_and_wait(page, "#story-continue")
    story = page.locator("#story-text textarea").input_value()
    assert story.startswith(beginning) and story[len(beginning):].strip(), story


def _compare(page) -> None:
    send(page, "#compare-input", "#compare-send", "Name a fruit.")
    for chat in ("compare-bounded-chat", "compare-full-chat"):
        assert [m.strip() for m in messages(page, chat, "user")] == ["Name a fruit."], chat
        assert messages(page, chat, "bot")[0].strip(), chat


# Each view's tab, what must be in view on a phone (what is typed into, what sends), and
# a turn from there. When the view opened at 390 x 844, the chat's Send was 150 px below
# the window, Continue 70, and compare's Send 590 (after its description and two chats).
PHONE_VIEWS = {
    "chat": ("Chat", ("#chat-input textarea", "#chat-send"), _chat),
    "story": ("Story", ("#story-continue",), _story),
    "compare": ("Compare", ("#compare-input textarea", "#compare-send"), _compare),
}


@pytest.mark.parametrize("view", PHONE_VIEWS)
def test_on_a_phone_each_views_message_row_is_in_view_and_sends(browser, app_url, view):
    tab, row, turn = PHONE_VIEWS[view]
    page = open_app(browser, app_url, has_touch=True, is_mobile=True, **PHONE)
    try:
        open_tab(page, tab)
        for selector in row:
            _in_window(page, selector, PHONE)
        assert page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"]
        configure(page, max_new_tokens=8)
        show_settings(page, False)
        turn(page)
        for selector in row:  # still, once the settings opened and folded scrolled the page
            _in_window(page, selector, PHONE)
    finally:
        page.context.close()


# A small phone, a short window and a phone held sideways (the two-column layout).
SMALL_PHONE = {"width": 320, "height": 568}
SHORT_PHONES = {"390x400": {"width": 390, "height": 400}, "844x390": {"width": 844, "height": 390}}

# The last line of the chat's latest reply, and the part of the conversation shown (the
# box it scrolls in), in the window's coordinates.
LAST_LINE = """chat => {
  const replies = chat.querySelectorAll('[data-testid=bot]');
  const range = document.createRange();
  range.selectNodeContents(replies[replies.length - 1]);
  const lines = [...range.getClientRects()].filter(r => r.height);
  const shown = chat.querySelector('.bubble-wrap').getBoundingClientRect();
  return {top: lines.at(-1).top, bottom: lines.at(-1).bottom,
          shownTop: shown.top, shownBottom: shown.bottom};
}"""


def test_on_a_small_phone_a_long_reply_ends_above_the_message_row(browser, app_url):
    # At 320 x 568 "pin this message" and Send wrapped to a line each, and the row, 185 px
    # tall, stuck over the conversation: a reply's last lines streamed behind it.
    page = open_app(browser, app_url, has_touch=True, is_mobile=True, **SMALL_PHONE)
    try:
        configure(page, max_new_tokens=60)
        show_settings(page, False)
        page.evaluate("() => scrollTo(0, 0)")  # as the page opens: the row covers the chat
        send(page, "#chat-input", "#chat-send", "Describe the sea in a long paragraph.")
        row = settled_box(page, "#chat-send-row")
        line = page.locator("#chatbot").evaluate(LAST_LINE)
        assert line["shownTop"] - 1 <= line["top"], line  # scrolled to the reply's end
        assert line["bottom"] <= min(line["shownBottom"], row["y"]) + 1, (line, row)
        for selector in ("#chat-input textarea", "#chat-send"):
            _in_window(page, selector, SMALL_PHONE)
        assert settled_box(page, "#chat-send")["y"] == settled_box(page, "#chat-pin-message")["y"]
        send(page, "#chat-input", "#chat-send", "Thanks.")
        assert len(messages(page, "chatbot", "bot")) == 2
    finally:
        page.context.close()


@pytest.mark.parametrize("size", SHORT_PHONES.values(), ids=SHORT_PHONES)
def test_on_a_short_phone_the_story_opens_above_its_continue_row(browser, app_url, size):
    # At 390 x 400 the story's text opened below the window, behind the stuck Continue
    # row once scrolled to; sideways, the row did not stick and was 400 px below.
    page = open_app(browser, app_url, has_touch=True, is_mobile=True, **size)
    try:
        open_tab(page, "Story")
        story = settled_box(page, "#story-text")
        assert 0 <= story["y"], story
        assert story["y"] + story["height"] <= settled_box(page, "#story-continue-row")["y"] + 1
        _in_window(page, "#story-continue", size)
        _story(page)
        _in_window(page, "#story-continue", size)
    finally:
        page.context.close()


def test_a_tap_on_a_token_shows_its_count(browser, app_url):
    page = open_app(browser, app_url, has_touch=True, is_mobile=True, **NARROW)
    try:
        configure(page, max_new_tokens=8)
        show_settings(page, False)
        send(page, "#chat-input", "#chat-send", QUESTIONS[0])
        _unfold(page, "chat-map")
        token = page.locator("#chat-token-map .tokmap span[title]").first
        count = token.get_attribute("title")
        assert re.fullmatch(r"#0(–\d+)?: kept by \d+(–\d+)? of \d+ pairs", count), count
        token.tap()
        expect(page.get_by_text(count, exact=True)).to_be_visible()
    finally:
        page.context.close()


def test_no_chat_icon_covers_the_message_at_the_top(browser, app_url):
    page = open_app(browser, app_url, **WIDE)
    try:
        configure(page, max_new_tokens=40)
        show_settings(page, False)
        questions = ["Name three fruits and describe each.", "Now three vegetables, described.",
                     "And three trees."]
        for question in questions:
            send(page, "#chat-input", "#chat-send", question)
        assert page.locator("#chatbot").evaluate(ICONS_OVER_TOP_MESSAGES) == []
        open_tab(page, "Compare")
        for question in questions[:2]:
            send(page, "#compare-input", "#compare-send", question)
        for chat in ("#compare-bounded-chat", "#compare-full-chat"):
            assert page.locator(chat).evaluate(ICONS_OVER_TOP_MESSAGES) == [], chat
    finally:
        page.context.close()


def test_the_edit_box_spans_the_chat(browser, app_url):
    page = open_app(browser, app_url, **WIDE)
    try:
        configure(page, max_new_tokens=8)
        show_settings(page, False)
        send(page, "#chat-input", "#chat-send", "Hi!")
        page.locator("#chatbot button[aria-label=Edit]").click()
        edit = page.locator("#chatbot textarea.edit-textarea")
        expect(edit).to_have_value("Hi!")
        chat = page.locator("#chatbot [role=log]").bounding_box()
        assert edit.bounding_box()["width"] >= 0.6 * chat["width"]
    finally:
        page.context.close()
