"""End to end: the chat view's Save / load panel in the real app (``app.py`` on the
embedded model) driven through Debian's chromium: export, save, then resume in another
browser session, a refused file, and files of other cache settings (slots, or a budget
in bytes and bits) taken with them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from playwright.sync_api import Page, expect

from .browser_support import (DONE_TIMEOUT_MS, choose, configure, gauge, messages, open_app, open_tab, ran_with,
                              running_app, send, toasts)


@pytest.fixture(scope="module")
def app_url():
    with running_app("--heavy", "16", "--recent", "16", "--sink", "4") as url:
        yield url


STILL_STREAMING = "A reply is still streaming: press Stop (or Esc) first."


def open_files(page: Page) -> None:
    page.click("#chat-files .label-wrap")
    page.wait_for_selector("#chat-save-session", state="visible")


def download(page: Page, button: str, target) -> None:
    """Click ``button``, wait for the new download link it produces, save its file as
    ``target``."""
    links = page.locator("#chat-download a")
    before = links.first.get_attribute("href") if links.count() else None
    page.click(button)
    page.wait_for_function(
        "before => { const a = document.querySelector('#chat-download a');"
        " return a && a.getAttribute('href') !== before; }", arg=before, timeout=60_000)
    with page.expect_download() as event:
        links.first.click()
    event.value.save_as(target)


def upload(page: Page, button: str, path) -> None:
    # A page drawing a long streamed reply on a loaded machine takes its time to answer
    # the click as it does to draw the reply.
    with page.expect_file_chooser(timeout=DONE_TIMEOUT_MS) as chooser:
        page.click(button, timeout=DONE_TIMEOUT_MS)
    chooser.value.set_files(str(path), timeout=DONE_TIMEOUT_MS)


def test_save_then_resume_in_another_browser_session(browser, app_url, tmp_path):
    first = open_app(browser, app_url)
    configure(first, max_new_tokens=24)
    send(first, "#chat-input", "#chat-send", "Name three fruits.")
    send(first, "#chat-input", "#chat-send", "And three colours?")
    shown = messages(first, "chatbot", "bot")
    open_files(first)
    download(first, "#chat-export-json", tmp_path / "chat.json")
    exported = json.loads((tmp_path / "chat.json").read_text())
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"] * 2
    download(first, "#chat-save-session", tmp_path / "chat.h2o-session.zip")
    expect(first.locator("#chat-files-status")).to_contain_text("Saved")
    saved_gauge = gauge(first, "chat-gauge")

    second = open_app(browser, app_url)  # a new Gradio session, as after a restart
    configure(second, max_new_tokens=24)
    open_files(second)
    (tmp_path / "broken.h2o-session.zip").write_bytes(b"not a zip")
    upload(second, "#chat-resume-session", tmp_path / "broken.h2o-session.zip")
    expect(second.locator("#chat-files-status")).to_contain_text("Not loaded")
    upload(second, "#chat-resume-session", tmp_path / "chat.h2o-session.zip")
    expect(second.locator("#chat-files-status")).to_contain_text("Resumed", timeout=60_000)
    assert messages(second, "chatbot", "bot") == shown
    resumed_gauge = gauge(second, "chat-gauge")
    assert (resumed_gauge["seen"], resumed_gauge["held"]) == (saved_gauge["seen"], saved_gauge["held"])

    # Both go on with the same greedy reply: the resumed cache is the saved one.
    send(first, "#chat-input", "#chat-send", "Three animals?")
    send(second, "#chat-input", "#chat-send", "Three animals?")
    assert messages(second, "chatbot", "bot")[-1] == messages(first, "chatbot", "bot")[-1]
    first.context.close()
    second.context.close()


def test_a_resumed_session_lists_its_pins(browser, app_url, tmp_path):
    first = open_app(browser, app_url)
    configure(first, max_new_tokens=16)
    first.check("#chat-pin-message input")
    send(first, "#chat-input", "#chat-send", "My cat is called Odd.")
    pins = first.locator("#chat-pin-list .pins")
    expect(pins).to_have_attribute("data-count", "2")  # the system prompt and the message
    listed = pins.inner_text()
    open_files(first)
    download(first, "#chat-save-session", tmp_path / "pinned.h2o-session.zip")

    second = open_app(browser, app_url)
    open_files(second)
    upload(second, "#chat-resume-session", tmp_path / "pinned.h2o-session.zip")
    expect(second.locator("#chat-files-status")).to_contain_text("Resumed", timeout=60_000)
    resumed = second.locator("#chat-pin-list .pins")
    expect(resumed).to_have_attribute("data-count", "2")
    assert resumed.inner_text() == listed
    assert "My cat is called Odd." in listed
    first.context.close()
    second.context.close()


def test_a_file_of_another_type_is_refused_as_every_file_is(page, tmp_path):
    """A file whose name does not end as the button asks (.zip, .json) is refused with a
    warning and the status line, as every refused file is. (The upload buttons' own type
    check refused it in the page, with an error toast, leaving the status line of the
    action before.)"""
    (tmp_path / "notes.txt").write_text("hello")
    open_files(page)
    page.evaluate(_NOTE_TOASTS)
    page.click("#chat-save-session")
    status = page.locator("#chat-files-status")
    expect(status).to_have_text("Not saved: nothing to save yet: start a chat first")
    _refusal_shown_once(page, "nothing to save yet: start a chat first")
    for button, refused in (("#chat-resume-session", "notes.txt is not a .zip file"),
                            ("#chat-import-json", "notes.txt is not a .json file")):
        upload(page, button, tmp_path / "notes.txt")
        expect(status).to_have_text(f"Not loaded: {refused}")
        _refusal_shown_once(page, refused)
    # Its name shown as written: Markdown in it came out bold, with a link.
    marked = "my _notes_ [v2](x) #1.txt"
    (tmp_path / marked).write_text("hello")
    open_tab(page, "Story")
    page.click("#story-files .label-wrap")
    upload(page, "#story-resume-session", tmp_path / marked)
    expect(page.locator("#story-files-status")).to_have_text(f"Not loaded: {marked} is not a .zip file")
    _refusal_shown_once(page, f"{marked} is not a .zip file")


def test_save_and_export_while_a_reply_streams_are_refused_as_every_file_is(page):
    """Saving or exporting while a reply streams is refused with a warning and the status
    line (the refusal escaped as an error: a red toast, and "Error" over the status line)."""
    configure(page, max_new_tokens=1024)
    open_files(page)
    page.evaluate(_NOTE_TOASTS)
    for button, outcome in (("#chat-save-session", "Not saved"), ("#chat-export-json", "Not exported")):
        with _a_reply_streaming(page):
            page.click(button)
            expect(page.locator("#chat-files-status")).to_have_text(f"{outcome}: {STILL_STREAMING}")
        _refusal_shown_once(page, STILL_STREAMING)


@contextmanager
def _a_reply_streaming(page: Page) -> Iterator[None]:
    """The block runs while a long greedy reply streams (the story runs to the slider's
    longest: 1,024 tokens); then the reply goes on until Esc stops it, and Undo takes its
    turn back. A reply of its own for each refused action: one reply for all of them ended
    first on a loaded machine, where 1,024 tokens of 36 slots decode in about a minute and
    each refusal's toast takes 10 s to go."""
    page.fill("#chat-input textarea", "Write a long story about a dragon.")
    page.press("#chat-input textarea", "Enter")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
        ".some(e => e.innerText.length > 20)", timeout=DONE_TIMEOUT_MS)
    yield
    expect(page.locator("#chat-stop")).to_be_visible()  # the reply goes on
    page.keyboard.press("Escape")
    expect(page.locator("#chat-send")).to_be_visible(timeout=30_000)
    page.click("#chat-undo")
    expect(page.locator("#chatbot [data-testid=bot]")).to_have_count(0)


# Every toast the page shows, noted as it appears: a toast lives 10 s, and a machine busy
# enough delayed the test's look past its end.
_NOTE_TOASTS = """() => {
  const shown = [];
  new MutationObserver(records => records.forEach(r => r.addedNodes.forEach(node => {
    if (!(node instanceof Element)) return;
    for (const body of [node, ...node.querySelectorAll('.toast-body')])
      if (body.classList.contains('toast-body'))
        shown.push([['error', 'warning'].find(kind => body.classList.contains(kind)) || 'other', body.innerText]);
  }))).observe(document.body, {childList: true, subtree: true});
  window.__toastsShown = shown;
}"""


def _refusal_shown_once(page: Page, text: str) -> None:
    """The warning that says ``text`` showed, once, and no error; then it goes by itself
    (10 s), so that the next refusal's warning is a toast of its own (Gradio adds a
    warning shown while another shows to that one, which closes both when its own time is
    up). Toasts are noted from the first call on, and taken by each call."""
    page.wait_for_function("text => window.__toastsShown.some(([kind, said]) => kind === 'warning' && "
                           "said.includes(text))", arg=text)
    shown = page.evaluate("() => window.__toastsShown.splice(0)")
    assert [kind for kind, said in shown if text in said] == ["warning"], shown
    assert "error" not in [kind for kind, _ in shown], shown
    expect(page.locator(".toast-body.warning", has_text=text)).to_have_count(0, timeout=60_000)


def next_replies_are_the_same(first: Page, second: Page, text: str) -> None:
    """``text`` sent on the saved page and on the page that resumed its file: both replies
    run greedy with 16 new tokens and are the same. Each alone on the model: a reply
    batched with another (a page of an earlier test still stopping) rounds differently
    and may pick other greedy tokens. Closes both pages."""
    for page in (first, second):
        expect(page.locator("#server-load")).to_contain_text("· 0 generating")
        send(page, "#chat-input", "#chat-send", text)
    replies = messages(second, "chatbot", "bot")
    for page in (first, second):
        ran = ran_with(page, "chat")
        assert (ran["temperature"], ran["max-new-tokens"]) == ("0", "16"), f"the reply ran with {ran}"
    assert len(replies) == 2 and replies[-1] == messages(first, "chatbot", "bot")[-1]
    first.context.close()
    second.context.close()


def test_a_file_of_other_cache_settings_lists_them_all_and_resumes_with_them(browser, app_url, tmp_path):
    first = open_app(browser, app_url)
    configure(first, max_new_tokens=16)
    send(first, "#chat-input", "#chat-send", "Name three fruits.")
    open_files(first)
    download(first, "#chat-save-session", tmp_path / "fruits.h2o-session.zip")

    second = open_app(browser, app_url)
    configure(second, max_new_tokens=16, heavy=24, recent=8)
    open_files(second)
    adopt = second.locator("#chat-adopt-settings")
    expect(adopt).to_be_hidden()
    upload(second, "#chat-resume-session", tmp_path / "fruits.h2o-session.zip")
    status = second.locator("#chat-files-status")
    listed = ("cache.heavy = 16 in the file, 24 on the page; cache.recent = 16 in the file, 8 on the page")
    expect(status).to_contain_text(listed, timeout=60_000)
    assert any(listed in toast for toast in toasts(second))
    assert messages(second, "chatbot", "bot") == []  # nothing resumed yet

    adopt.click()
    expect(status).to_contain_text("Resumed with the file's cache settings (heavy 16, recent 16)",
                                   timeout=60_000)
    expect(adopt).to_be_hidden()
    expect(second.locator("#heavy input")).to_have_value("16")
    expect(second.locator("#recent input")).to_have_value("16")
    assert messages(second, "chatbot", "bot") == messages(first, "chatbot", "bot")

    # The next reply works, and equals the saved session's own: the cache is the file's.
    next_replies_are_the_same(first, second, "And three colours?")


# Typed storage settings, what a page counting slots at the model's precision lists as the
# file's, and what it says it took. 1 MB buys 88 slots at K8/V4 (11,340 bytes a token);
# K4/V4 with 16 exact tokens pays 368,640 for the rings and buys 74 at 8,460.
STORED = {
    "K8/V4": (dict(key_bits="8", value_bits="4", exact_window="0"),
              "cache.budget_bytes = 1000000 in the file, not used on the page; cache.heavy = 79 in the file, 16 on "
              "the page; cache.key_bits = 8 in the file, not used on the page; cache.recent = 5 in the file, 16 on "
              "the page; cache.value_bits = 4 in the file, not used on the page",
              "budget_mb 1, heavy 79, key_bits 8, recent 5, value_bits 4"),
    "K4/V4 +16 exact": (dict(key_bits="4", value_bits="4", exact_window="16"),
                        "cache.budget_bytes = 1000000 in the file, not used on the page; cache.exact_window = 16 in "
                        "the file, not used on the page; cache.heavy = 66 in the file, 16 on the page; "
                        "cache.key_bits = 4 in the file, not used on the page; cache.recent = 4 in the file, 16 on "
                        "the page; cache.value_bits = 4 in the file, not used on the page",
                        "budget_mb 1, exact_window 16, heavy 66, key_bits 4, recent 4, value_bits 4"),
}


@pytest.mark.parametrize("stored", STORED)
def test_a_file_saved_with_a_byte_budget_and_bits_resumes_with_them(browser, app_url, tmp_path, stored):
    """Saved at 1 MB with quantized slots, resumed into a page that counts slots at the
    model's precision: the page lists every difference, takes the file's settings on
    request, and the next reply is the saved session's own."""
    typed, differences, taken = STORED[stored]
    first = open_app(browser, app_url)
    configure(first, max_new_tokens=16)
    choose(first, "key-bits", typed["key_bits"])
    choose(first, "value-bits", typed["value_bits"])
    first.fill("#exact-window input", typed["exact_window"])
    first.locator("#exact-window input").press("Tab")
    first.fill("#budget-mb textarea", "1")
    first.locator("#budget-mb textarea").press("Tab")
    send(first, "#chat-input", "#chat-send", "Tell me about the sea and its ships, every one of them. " * 4)
    saved = gauge(first, "chat-gauge")
    assert (saved["budgetBytes"], saved["keyBits"], saved["valueBits"], saved["exactWindow"]) == (
        "1000000", typed["key_bits"], typed["value_bits"], typed["exact_window"])
    open_files(first)
    download(first, "#chat-save-session", tmp_path / "stored.h2o-session.zip")

    second = open_app(browser, app_url)
    configure(second, max_new_tokens=16)
    open_files(second)
    upload(second, "#chat-resume-session", tmp_path / "stored.h2o-session.zip")
    status = second.locator("#chat-files-status")
    expect(status).to_contain_text(differences, timeout=60_000)
    second.locator("#chat-adopt-settings").click()
    expect(status).to_contain_text(f"Resumed with the file's cache settings ({taken})", timeout=60_000)
    expect(second.locator("#budget-mb textarea")).to_have_value("1")
    expect(second.locator("#key-bits input")).to_have_value(typed["key_bits"])
    expect(second.locator("#value-bits input")).to_have_value(typed["value_bits"])
    expect(second.locator("#exact-window input")).to_have_value(typed["exact_window"])
    resumed = gauge(second, "chat-gauge")
    compared = ("budgetBytes", "keyBits", "valueBits", "exactWindow", "seen", "held")
    assert {k: resumed[k] for k in compared} == {k: saved[k] for k in compared}
    assert messages(second, "chatbot", "bot") == messages(first, "chatbot", "bot")

    next_replies_are_the_same(first, second, "And its lighthouses?")


def test_nothing_replaces_the_conversation_while_its_reply_streams(browser, app_url, tmp_path):
    """Resume and import during a streaming reply are refused, as a second send is: the
    page would go on showing the streaming conversation over the file's session."""
    page = open_app(browser, app_url)
    try:
        configure(page, max_new_tokens=1024)
        open_files(page)
        (tmp_path / "other.json").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
        (tmp_path / "other.h2o-session.zip").write_bytes(b"PK\x05\x06" + bytes(18))
        refusal = page.locator("[data-testid=toast-body]", has_text=STILL_STREAMING)
        for button, file in (("#chat-import-json", "other.json"), ("#chat-resume-session", "other.h2o-session.zip")):
            with _a_reply_streaming(page):
                upload(page, button, tmp_path / file)
                # Answered while the reply decodes, which on a loaded machine delays it long.
                expect(refusal).to_have_count(1, timeout=DONE_TIMEOUT_MS)
                expect(page.locator("#chat-files-status")).to_have_text(f"Not loaded: {STILL_STREAMING}")
                assert messages(page, "chatbot", "user") == ["Write a long story about a dragon."]
            # The next refusal shows anew once this one's toast has gone by itself (10 s;
            # clicking its close button races with that on a loaded machine).
            expect(refusal).to_have_count(0, timeout=60_000)
    finally:
        page.context.close()
