"""End to end: the real app (``app.py`` on the embedded model, a subprocess on a free port)
driven through Debian's chromium with Playwright."""

from __future__ import annotations

from playwright.sync_api import expect

from .browser_support import (
    DONE_TIMEOUT_MS, LONG_COUNTING_REPLY, configure, gauge, messages, open_app, open_tab, send,
    ran_with, set_number, start_and_wait, toasts,
)


# ---- chat --------------------------------------------------------------------------------


def test_chat_reply_streams_and_the_token_counter_moves(page):
    configure(page, max_new_tokens=32)
    before = gauge(page, "chat-gauge")
    assert before["seen"] == "0" and before["state"] == "empty"
    assert "budget not reached yet" in page.inner_text("#chat-gauge")
    page.fill("#chat-input textarea", "Tell me about cats.")
    # The reply's length each time the page redraws the chat while it streams (marked as
    # generating), noted in the page itself: polled from outside, a busy machine showed
    # the test a single length.
    drawn = page.evaluate_handle("""() => {
      const lengths = [];
      const chat = document.querySelector('#chatbot');
      new MutationObserver(() => document.querySelector('.generating') &&
          lengths.push([...chat.querySelectorAll('[data-testid=bot]')]
            .map(e => e.textContent).join('').length))
        .observe(chat, {subtree: true, childList: true, characterData: true});
      return lengths;
    }""")
    start_and_wait(page, "#chat-send")
    lengths = drawn.json_value()
    reply = messages(page, "chatbot", "bot")
    assert len(reply) == 1 and reply[0].strip()
    assert len({n for n in lengths if n}) >= 2, lengths  # seen at several lengths
    after = gauge(page, "chat-gauge")
    assert int(after["seen"]) > 21 and int(after["held"]) == int(after["seen"])
    assert after["state"] == "filling" and "budget not reached yet" in page.inner_text("#chat-gauge")
    # The map shows every token of the conversation, from the first to the newest.
    tokmap = page.locator("#chat-token-map .tokmap")
    assert tokmap.get_attribute("data-tokens") == after["tokens"]
    assert tokmap.locator("span").first.get_attribute("title").startswith("#0")
    assert f"{int(after['tokens']) - 1}:" in tokmap.locator("span").last.get_attribute("title")
    assert page.locator("#chat-heat-map img").count() == 1


def test_stop_during_a_long_reply_then_a_new_turn_works(page):
    configure(page, max_new_tokens=400, **LONG_COUNTING_REPLY)
    page.fill("#chat-input textarea", "Count from one to two hundred in words.")
    page.click("#chat-send")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
        ".some(e => e.innerText.length > 20)", timeout=DONE_TIMEOUT_MS)
    page.click("#chat-stop")
    page.wait_for_selector(".generating", state="detached", timeout=30_000)
    stopped = gauge(page, "chat-gauge")
    assert int(stopped["tokens"]) < 21 + 30 + 200  # far fewer than the 400 asked for
    set_number(page, "max-new-tokens", 16)
    send(page, "#chat-input", "#chat-send", "Thanks, that is enough.")
    assert messages(page, "chatbot", "user") == ["Count from one to two hundred in words.",
                                                  "Thanks, that is enough."]
    replies = messages(page, "chatbot", "bot")
    assert len(replies) == 2 and all(r.strip() for r in replies)
    assert int(gauge(page, "chat-gauge")["seen"]) > int(stopped["seen"])


def test_regenerate_and_undo_rebuild_the_chat(page):
    configure(page, max_new_tokens=24)
    send(page, "#chat-input", "#chat-send", "Name a fruit.")
    first = messages(page, "chatbot", "bot")
    start_and_wait(page, "#chat-regenerate")
    ran = ran_with(page, "chat")
    assert (ran["temperature"], ran["max-new-tokens"]) == ("0", "24")
    assert messages(page, "chatbot", "bot") == first  # greedy: the same reply again
    page.click("#chat-undo")
    page.wait_for_function("() => !document.querySelector('#chatbot [data-testid=user]')")
    assert page.input_value("#chat-input textarea") == "Name a fruit."
    page.wait_for_function("() => document.querySelector('#chat-gauge .gauge').dataset.seen === '0'")
    assert "nothing fed yet" in page.inner_text("#chat-gauge")


def _edit(page, nth: int, text: str) -> None:
    page.locator("#chatbot [data-testid=user]").nth(nth).hover()
    page.locator("#chatbot button[aria-label=Edit]").nth(nth).click()
    page.locator("#chatbot textarea.edit-textarea").fill(text)
    # Waited for like any other event: a refused edit's toast shows before its event ends,
    # so what a test reads after the toast could still change.
    start_and_wait(page, "#chatbot button[aria-label=Submit]")


def test_a_refused_edit_leaves_the_conversation_and_the_page_as_they_were(page):
    """QA: an edit to an empty message was refused, yet the server's chat went back to
    before that message while the page went on showing the edit; the next send then
    dropped the turns after it."""
    configure(page, max_new_tokens=8)
    for text in ("My name is Ann.", "I live in Oslo."):
        send(page, "#chat-input", "#chat-send", text)
    replies = messages(page, "chatbot", "bot")
    _edit(page, 0, "")
    expect(page.locator("[data-testid=toast-body]")).to_contain_text("message is empty")
    expect(page.locator("#chatbot [data-testid=user]").first).to_have_text("My name is Ann.")
    send(page, "#chat-input", "#chat-send", "Thanks.")
    assert messages(page, "chatbot", "user") == ["My name is Ann.", "I live in Oslo.", "Thanks."]
    assert messages(page, "chatbot", "bot")[:2] == replies


def test_html_in_a_message_shows_edits_and_copies_as_typed(page):
    """QA: the chat box rendered the HTML in a message: "What does <div> do?" showed
    "What does", and the rest of the message in a box of its own."""
    typed = "What does <div> do? And <b>x</b>, or a<b and </p>?"
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    configure(page, max_new_tokens=2)
    page.check("#chat-pin-message input")
    send(page, "#chat-input", "#chat-send", typed)
    message = page.locator("#chatbot [data-testid=user]").first
    expect(message.locator(".prose div, .prose b")).to_have_count(0)
    assert message.inner_text().replace("\u2060", "") == typed
    pin = page.locator("#chat-pin-list .pins tr.pin")
    expect(pin).to_contain_text(typed)

    message.hover()
    page.locator("#chatbot button[aria-label='Copy message']").first.click()  # the user's
    page.wait_for_function("async typed => (await navigator.clipboard.readText()) === typed", arg=typed)

    # An edit hands back the text as the box showed it, with more typed after it.
    message.hover()
    page.locator("#chatbot button[aria-label=Edit]").first.click()
    box = page.locator("#chatbot textarea.edit-textarea")
    box.press("End")
    box.press_sequentially(" Or <p>?")
    start_and_wait(page, "#chatbot button[aria-label=Submit]")
    expect(pin).to_contain_text(f"{typed} Or <p>?")
    assert "\u2060" not in pin.inner_text()

    # Compare's boxes too (Gradio shows a value through a per-session copy of a box made
    # from its class, once a handler has updated it: a display step added to one box
    # alone was lost there).
    open_tab(page, "Compare")
    send(page, "#compare-input", "#compare-send", typed)
    for side in ("full", "bounded"):
        message = page.locator(f"#compare-{side}-chat [data-testid=user]").first
        expect(message.locator(".prose div, .prose b")).to_have_count(0)
        assert message.inner_text().replace("\u2060", "") == typed


def test_regenerate_keeps_the_messages_pin_and_the_draft_in_the_box(page):
    """QA: Regenerate warned that the pinned message's pin was dropped and sent it again
    unpinned, and emptied the message box of a draft typed meanwhile."""
    configure(page, max_new_tokens=8)
    page.check("#chat-pin-message input")
    send(page, "#chat-input", "#chat-send", "My dog is Rex.")
    pins = page.locator("#chat-pin-list .pins")
    expect(pins).to_have_attribute("data-count", "2")  # the system prompt and the message
    page.fill("#chat-input textarea", "a draft")
    start_and_wait(page, "#chat-regenerate")
    expect(pins).to_have_attribute("data-count", "2")
    assert "My dog is Rex." in pins.locator("tr.pin").inner_text()
    assert not [t for t in toasts(page) if "dropped" in t]
    assert page.input_value("#chat-input textarea") == "a draft"


def test_two_browser_contexts_chat_at_once_with_separate_histories(browser, app_url):
    pages = [open_app(browser, app_url) for _ in range(2)]
    questions = ["What is the capital of France?", "Name three colours."]
    try:
        for page in pages:
            configure(page, max_new_tokens=24)
        for page, question in zip(pages, questions):
            page.fill("#chat-input textarea", question)
        for page in pages:
            page.click("#chat-send")
        for page in pages:
            page.wait_for_selector("#chatbot [data-testid=bot]", timeout=DONE_TIMEOUT_MS)
        for page in pages:
            page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
        for page, question in zip(pages, questions):
            assert messages(page, "chatbot", "user") == [question]
            replies = messages(page, "chatbot", "bot")
            assert len(replies) == 1 and replies[0].strip()
        assert messages(pages[0], "chatbot", "bot") != messages(pages[1], "chatbot", "bot")
    finally:
        for page in pages:
            page.context.close()


# ---- story -------------------------------------------------------------------------------


def test_story_continues_twice_with_the_cache_at_budget(page):
    open_tab(page, "Story")
    configure(page, heavy=16, recent=16)
    page.fill("#story-bible textarea", "Mira: a lighthouse keeper. Tomas: her brother, a fisherman.")
    beginning = "The storm reached the island at dusk."
    page.fill("#story-text textarea", beginning)
    set_number(page, "story-tokens", 40)
    texts, seen = [], []
    for _ in range(2):
        start_and_wait(page, "#story-continue")
        texts.append(page.input_value("#story-text textarea"))
        g = gauge(page, "story-gauge")
        seen.append(int(g["seen"]))
        # Held at budget: 16 heavy + 16 recent + 4 sink slots, plus the pinned bible.
        assert g["state"] == "at-budget" and int(g["held"]) == int(g["budget"]) > 36
    assert texts[0].startswith(beginning) and len(texts[0]) > len(beginning)
    assert texts[1].startswith(texts[0]) and len(texts[1]) > len(texts[0])
    assert seen[1] > seen[0] > int(g["budget"])
    evicted = page.locator("#story-token-map .tokmap span.ev").count()
    assert evicted > 0


# ---- compare -----------------------------------------------------------------------------


def test_compare_shows_both_replies_and_the_full_cache_grows_larger(page):
    open_tab(page, "Compare")
    configure(page, heavy=16, recent=16, max_new_tokens=24)
    questions = ["Name a fruit.", "What colour is it?", "Where does it grow?"]
    for question in questions:
        send(page, "#compare-input", "#compare-send", question)
    for chat in ("compare-bounded-chat", "compare-full-chat"):
        assert messages(page, chat, "user") == questions
        replies = messages(page, chat, "bot")
        assert len(replies) == 3 and all(r.strip() for r in replies)
    bounded, full = gauge(page, "compare-bounded-gauge"), gauge(page, "compare-full-gauge")
    assert int(full["kvBytes"]) > int(bounded["kvBytes"])
    assert int(full["held"]) > int(bounded["held"]) == int(bounded["budget"])
    assert float(bounded["tps"]) > 0 and float(full["tps"]) > 0
    assert "turn 3" in page.inner_text("#compare-divergence")
    for plot in ("compare-memory-plot", "compare-slots-plot"):
        assert page.locator(f"#{plot} canvas, #{plot} svg").count() > 0


def test_a_chat_loads_no_image_from_elsewhere(page):
    """Markdown in a message is drawn (an image included), but the browser fetches an
    image only from the page's own server: one from elsewhere could carry the
    conversation out in its address."""
    answered = []
    page.on("response", lambda response: "probe.png" in response.url and answered.append(response.url))
    blocked = page.evaluate_handle("""() => {
      const blocked = [];
      document.addEventListener('securitypolicyviolation', e => blocked.push(e.blockedURI));
      return blocked;
    }""")
    configure(page, max_new_tokens=1)
    send(page, "#chat-input", "#chat-send", "![a](http://127.0.0.2:9/elsewhere-probe.png) "
                                            "![b](/here-probe.png)")
    page.locator("#chatbot [data-testid=user] img").nth(1).wait_for(state="attached")
    page.wait_for_function("() => [...document.querySelectorAll('#chatbot img')].every(img => img.complete)")
    assert blocked.json_value() == ["http://127.0.0.2:9/elsewhere-probe.png"]
    assert [url.rsplit("/", 1)[1] for url in answered] == ["here-probe.png"]  # its own server's 404
