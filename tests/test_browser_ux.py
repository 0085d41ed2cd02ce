"""What a new user meets first, in the real app and Debian's chromium: sampling that
varies, refusals as one message, a compare view that stays responsive and resets
cleanly."""

from __future__ import annotations

import base64
import json
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image
from playwright.sync_api import expect

from .browser_support import (
    DONE_TIMEOUT_MS, LONG_COUNTING_REPLY, configure, gauge, messages, open_app, open_tab, page_errors, send,
    set_number, settled_box, show_settings, start_and_wait, toasts,
)


DATA = Path(__file__).parent / "data"
STORY = "Write a long story about a dragon."


def _expect_toast(page, text: str) -> None:
    expect(page.locator("[data-testid=toast-body]", has_text=text)).to_have_count(1)


def _no_error_pills(page) -> None:
    """No output is marked failed (Gradio paints a red "Error" over each)."""
    expect(page.get_by_text("Error", exact=True)).to_have_count(0)


def test_empty_seed_samples_anew_and_a_fixed_seed_repeats(page):
    show_settings(page)
    assert page.locator("#seed").locator("input, textarea").input_value() == ""  # config: null
    configure(page, temperature=1.0, top_p=1.0, max_new_tokens=24)
    send(page, "#chat-input", "#chat-send", "Tell me a one-line story about a cat.")
    replies = [messages(page, "chatbot", "bot")[-1]]
    for _ in range(2):
        start_and_wait(page, "#chat-regenerate")
        replies.append(messages(page, "chatbot", "bot")[-1])
    assert len(set(replies)) > 1, replies  # three identical samples: the seed was fixed
    set_number(page, "seed", 7)
    fixed = []
    for _ in range(2):
        start_and_wait(page, "#chat-regenerate")
        fixed.append(messages(page, "chatbot", "bot")[-1])
    assert fixed[0] == fixed[1]


def test_refusals_are_one_message_naming_the_setting(page, app_log):
    configure(page, heavy=-5, max_new_tokens=8)
    page.fill("#chat-input textarea", "Hello there.")
    page.click("#chat-send")
    _expect_toast(page, "cache.heavy = -5: must be an integer >= 0")
    _no_error_pills(page)
    set_number(page, "heavy", 2.5)  # refused, not run as 2
    page.click("#chat-send")
    _expect_toast(page, "cache.heavy = 2.5: expected int, got float; must be an integer >= 0")
    _no_error_pills(page)
    assert page.input_value("#chat-input textarea") == "Hello there."  # kept, to send again
    page.fill("#chat-input textarea", " \u200b\u200f ")  # a zero-width space and a direction mark
    page.click("#chat-send")
    _expect_toast(page, "Type a message first.")
    _no_error_pills(page)
    set_number(page, "heavy", 16)
    send(page, "#chat-input", "#chat-send", "Hello there.")  # every control still works
    assert messages(page, "chatbot", "user") == ["Hello there."]
    assert messages(page, "chatbot", "bot")[0].strip()
    _no_error_pills(page)
    assert "Traceback" not in app_log.read_text()


def test_a_story_bible_over_its_limit_is_refused_and_the_story_goes_on(page, app_log):
    """A bible one character over server.max_system_prompt_chars (20,000) is one message
    and changes nothing: the story, its Continue button and its cache stay (a bible of
    exactly the limit is taken: test_session.py)."""
    open_tab(page, "Story")
    set_number(page, "story-tokens", 8)
    page.fill("#story-bible textarea", "Ada keeps a lighthouse.")
    page.fill("#story-text textarea", "The storm came.")
    start_and_wait(page, "#story-continue")
    story, seen = page.input_value("#story-text textarea"), gauge(page, "story-gauge")["seen"]
    page.fill("#story-bible textarea", "B" * 20_001)
    page.click("#story-continue")
    _expect_toast(page, "the story bible is 20,001 characters long; the limit is 20,000 "
                        "(server.max_system_prompt_chars)")
    _no_error_pills(page)
    expect(page.locator("#story-continue")).to_be_visible()
    assert page.input_value("#story-text textarea") == story
    page.fill("#story-bible textarea", "Ada keeps a lighthouse.")  # the story it was: it goes on
    start_and_wait(page, "#story-continue")
    grown = page.input_value("#story-text textarea")
    assert grown.startswith(story) and len(grown) > len(story)
    assert int(gauge(page, "story-gauge")["seen"]) > int(seen)
    assert "Traceback" not in app_log.read_text()


# How Send refuses a budget the model cannot hold (its context is 8,192 tokens), and
# Continue, which runs the turns policy's slots as h2o's even split (config.for_story).
PAST_CONTEXT = ("cache.heavy + cache.recent + cache.sink = 9000 + 16 + 4 = 9020 slots: must be at most "
                "the model's context of 8,192 tokens (max_position_embeddings)")
STORY_PAST_CONTEXT = PAST_CONTEXT.replace("9000 + 16 + 4", "4508 + 4508 + 4")


def test_a_reset_to_a_budget_past_the_models_context_is_refused_and_the_conversation_stays(page):
    """New chat, New story and compare Reset refuse at once, as Send refuses it, a budget
    the model cannot hold (they took it, and the view's next Send refused it); each view's
    conversation stays."""
    configure(page, max_new_tokens=4)
    send(page, "#chat-input", "#chat-send", "Hello.")
    open_tab(page, "Compare")
    send(page, "#compare-input", "#compare-send", "Hello.")
    open_tab(page, "Story")
    set_number(page, "story-tokens", 4)
    page.fill("#story-text textarea", "The storm came.")
    start_and_wait(page, "#story-continue")
    story = page.input_value("#story-text textarea")
    set_number(page, "heavy", 9000)
    for tab, reset, refusal in (("Story", "#story-new", STORY_PAST_CONTEXT),
                                ("Compare", "#compare-reset", PAST_CONTEXT), ("Chat", "#chat-new", PAST_CONTEXT)):
        open_tab(page, tab)
        page.click(reset)
        _expect_toast(page, refusal)
        # Gone by itself (10 s) before the next: one shown meanwhile would join this toast.
        expect(page.locator("[data-testid=toast-body]", has_text=refusal)).to_have_count(0, timeout=60_000)
    for chat in ("chatbot", "compare-bounded-chat", "compare-full-chat"):
        assert [m.strip() for m in messages(page, chat, "user")] == ["Hello."], chat
        assert len(messages(page, chat, "bot")) == 1, chat
    open_tab(page, "Story")
    assert page.input_value("#story-text textarea") == story
    page.fill("#story-text textarea", "Another story.")  # a new story, on these settings
    page.click("#story-continue")
    _expect_toast(page, STORY_PAST_CONTEXT)
    _no_error_pills(page)


# Sent in place of what a dropdown holds, by a page whose request was edited on its way:
# what the page's endpoints can be sent, though no dropdown offers it.
CRAFTED_SETTINGS = [
    ("key-bits", 3, "cache.key_bits = 3: must be one of 32, 16, 8, 4, or model's dtype"),
    ("value-bits", 0, "cache.value_bits = 0: must be one of 32, 16, 8, 4, or model's dtype"),
    ("key-bits", "8.0", "cache.key_bits = '8.0': expected int or null, got str; must be one of 32, 16, 8, 4"),
    ("value-bits", ["8"], "cache.value_bits = ['8']: expected int or null, got list; must be one of 32, 16, 8, 4"),
    ("policy", "h3o", "cache.policy = 'h3o': must be one of full, h2o, recent, sink"),
]


def test_settings_no_dropdown_offers_are_refused_by_name_without_a_traceback(page, app_log):
    # Where each control's value travels in the request of the chat's Send.
    where = page.evaluate("""() => {
      const config = window.gradio_config;
      const id = elemId => config.components.find(c => c.props && c.props.elem_id === elemId).id;
      const send = id('chat-send'), inputs = ['key-bits', 'value-bits', 'policy'];
      const turn = config.dependencies.find(d => d.targets.some(([target, event]) => target === send && event === 'click')
                                              && d.inputs.includes(id('key-bits')));
      return {fn_index: turn.id, index: Object.fromEntries(inputs.map(name => [name, turn.inputs.indexOf(id(name))]))};
    }""")
    crafted: dict = {}

    def edit(route) -> None:
        body = json.loads(route.request.post_data)
        if body.get("fn_index") == where["fn_index"]:
            for elem_id, value in crafted.items():
                body["data"][where["index"][elem_id]] = value
        route.continue_(post_data=json.dumps(body))

    configure(page, max_new_tokens=8)
    page.route("**/gradio_api/queue/join*", edit)
    for elem_id, value, message in CRAFTED_SETTINGS:
        crafted = {elem_id: value}
        page.fill("#chat-input textarea", "Hello there.")
        page.click("#chat-send")
        _expect_toast(page, message)
        expect(page.locator("#chat-send")).to_be_visible()
    _no_error_pills(page)
    assert messages(page, "chatbot", "user") == []  # no turn ran on a bad setting
    crafted = {}
    send(page, "#chat-input", "#chat-send", "Hello there.")  # the page's own values still work
    assert messages(page, "chatbot", "bot")[0].strip()
    assert "Traceback" not in app_log.read_text()


def test_compare_streams_plots_after_each_turn_and_resets_without_errors(page):
    errors = page_errors(page)
    open_tab(page, "Compare")
    configure(page, heavy=16, recent=16, max_new_tokens=16)
    for question in ["Name a fruit.", "What colour is it?"]:
        send(page, "#compare-input", "#compare-send", question)
    for plot in ("compare-memory-plot", "compare-slots-plot"):
        assert page.locator(f"#{plot} canvas, #{plot} svg").count() > 0
    assert int(gauge(page, "compare-full-gauge")["held"]) > int(gauge(page, "compare-bounded-gauge")["held"])
    # The fidelity gauge is off: no empty plot or token box takes room.
    for off in ("compare-fidelity-plot", "compare-fidelity-step"):
        expect(page.locator(f"#{off}")).to_be_hidden()
    expect(page.locator("#compare-fidelity-summary")).to_contain_text("fidelity gauge off")
    start_and_wait(page, "#compare-reset")  # what a reset throws arrives after the views clear
    page.wait_for_function("() => !document.querySelector('#compare-full-chat [data-testid=bot]')")
    page.wait_for_function(
        "() => document.querySelector('#compare-bounded-gauge .gauge').dataset.state === 'empty'")
    page.check("#compare-fidelity-on input")
    send(page, "#compare-input", "#compare-send", "Name a colour.")
    assert len(messages(page, "compare-full-chat", "bot")) == 1
    expect(page.locator("#compare-fidelity-plot")).to_be_visible()
    assert page.locator("#compare-fidelity-plot canvas, #compare-fidelity-plot svg").count() > 0
    # A reset hides the drawn plot (it threw two page errors); the next reply draws it again.
    start_and_wait(page, "#compare-reset")
    page.wait_for_function("() => !document.querySelector('#compare-full-chat [data-testid=bot]')")
    expect(page.locator("#compare-fidelity-plot")).to_be_hidden()
    send(page, "#compare-input", "#compare-send", "Name a fruit.")
    expect(page.locator("#compare-fidelity-plot")).to_be_visible()
    assert errors == []
    assert not toasts(page)


# What must be on screen, without scrolling, in each view at 1366 x 768.
IN_VIEW = {
    "Chat": ["chat-input", "chat-send", "chat-regenerate", "chat-undo", "chat-new"],
    "Compare": ["compare-input", "compare-send", "compare-reset"],
    "Story": ["story-continue", "story-new"],
}


def test_controls_in_view_send_turns_into_stop_and_esc_stops(browser, app_url):
    page = open_app(browser, app_url, width=1366, height=768)
    try:
        for tab, ids in IN_VIEW.items():
            open_tab(page, tab)
            for elem_id in ids:
                box = settled_box(page, f"#{elem_id}")
                assert box and box["y"] + box["height"] <= 768, (elem_id, box)
        open_tab(page, "Chat")
        # Greedy, the story repeats itself for the slider's longest reply: Esc lands long
        # before the limit however loaded the machine, and the marker says which ended it.
        configure(page, max_new_tokens=1024)
        show_settings(page, False)
        page.fill("#chat-input textarea", STORY)
        page.press("#chat-input textarea", "Enter")
        expect(page.locator("#chat-stop")).to_be_visible()
        expect(page.locator("#chat-send")).to_be_hidden()
        page.wait_for_function(
            "() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
            ".some(e => e.innerText.length > 20)")
        page.fill("#chat-input textarea", "And then?")  # a second Enter is answered, not lost
        page.press("#chat-input textarea", "Enter")
        _expect_toast(page, "A reply is still streaming: press Stop (or Esc) first.")
        expect(page.locator("#chat-stop")).to_be_visible()
        page.keyboard.press("Escape")
        expect(page.locator("#chat-send")).to_be_visible(timeout=30_000)
        expect(page.locator("#chat-stop")).to_be_hidden()
        page.wait_for_selector(".generating", state="detached")
        assert page.locator("#chatbot .option").all_inner_texts() == ["⏹ stopped · continue"]
        assert messages(page, "chatbot", "user") == [STORY]
        assert page.input_value("#chat-input textarea") == "And then?"
    finally:
        page.context.close()


def test_a_click_on_send_leaves_the_focus_in_the_message_box_named_for_screen_readers(page):
    # The clicked Send, hidden for Stop, took the focus with it to the page itself: the
    # next message needed a click in the box first. The box is found by the name a
    # screen reader reads out (it was "Textbox").
    configure(page, max_new_tokens=8)
    show_settings(page, False)
    for view, tab, name in (("chat", "Chat", "Message"), ("compare", "Compare", "Message for both")):
        open_tab(page, tab)
        send(page, f"#{view}-input", f"#{view}-send", "Name a fruit.")
        expect(page.get_by_role("textbox", name=name, exact=True)).to_be_focused()
        page.keyboard.type("And a colour?")
        expect(page.locator(f"#{view}-input textarea")).to_have_value("And a colour?")


def test_after_continue_the_focus_is_back_on_continue(page):
    # Continue, hidden for Stop while the story streams, took the focus with it to the
    # page itself: a keyboard user had to find the way back to continue again. The turn
    # gives it back, stopped (Esc, on the longest greedy story: it cannot end first) or
    # finished.
    open_tab(page, "Story")
    configure(page)
    set_number(page, "story-tokens", 1024)
    page.fill("#story-text textarea", "The storm reached the island at dusk.")
    page.click("#story-continue")
    page.wait_for_function("() => document.querySelector('#story-text textarea').value.length > 60")
    page.keyboard.press("Escape")
    expect(page.locator("#story-continue")).to_be_focused()
    set_number(page, "story-tokens", 8)
    start_and_wait(page, "#story-continue")
    expect(page.locator("#story-continue")).to_be_focused()


# The page's ids of a tab's swap back to Send: the events after each turn that answer
# (send, stop).
SWAP_BACK_EVENTS = """prefix => {
  const config = window.gradio_config;
  const id = name => config.components.find(c => c.props.elem_id === `${prefix}-${name}`).id;
  const send = id("send"), stop = id("stop");
  return config.dependencies
    .filter(d => d.trigger_after != null && d.outputs.length === 2
            && d.outputs[0] === send && d.outputs[1] === stop)
    .map(d => d.id);
}"""


def test_a_refused_turn_answered_late_leaves_send_to_the_running_one(page):
    """A second Enter while a reply streams is refused; its swap event is held in flight
    (as a busy server answers late) while Esc ends the reply: the reply's own swap event
    must still run and show Send. (Gradio's default for such an event, "once", dropped
    the second while the first was pending: Stop stayed, with nothing to stop.)"""
    events = set(page.evaluate(SWAP_BACK_EVENTS, "chat"))
    # Send, regenerate, edit and continue, each chained after success and after failure.
    assert len(events) == 8
    held = []

    def hold_the_first_swap(route):
        if not held and (route.request.post_data_json or {}).get("fn_index") in events:
            held.append(route)
        else:
            route.continue_()

    page.route("**/gradio_api/run/predict", hold_the_first_swap)  # queue=False events
    configure(page, max_new_tokens=300, **LONG_COUNTING_REPLY)
    show_settings(page, False)
    page.fill("#chat-input textarea", "Count from one to two hundred in words.")
    page.press("#chat-input textarea", "Enter")
    page.wait_for_function(
        "() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
        ".some(e => e.innerText.length > 20)")
    with page.expect_request(lambda request: request.url.endswith("/run/predict") and (
            request.post_data_json or {}).get("fn_index") in events):
        page.fill("#chat-input textarea", "And then?")
        page.press("#chat-input textarea", "Enter")
    _expect_toast(page, "A reply is still streaming: press Stop (or Esc) first.")
    assert held  # the refused turn's swap waits
    page.keyboard.press("Escape")
    expect(page.locator("#chat-send")).to_be_visible(timeout=30_000)
    expect(page.locator("#chat-stop")).to_be_hidden()
    held[0].continue_()
    assert messages(page, "chatbot", "user") == ["Count from one to two hundred in words."]


def test_one_budget_that_follows_the_settings(page):
    open_tab(page, "Compare")
    configure(page, heavy=16, recent=16)
    # Before the first message the bounded side's title and gauge follow the settings.
    expect(page.locator("#compare-bounded-title")).to_contain_text("turns cache (36 slots)")
    expect(page.locator("#compare-bounded-gauge .gauge")).to_have_attribute("data-budget", "36")
    open_tab(page, "Story")
    expect(page.locator("#story-gauge .gauge")).to_have_attribute("data-budget", "36")
    page.fill("#story-text textarea", "The storm reached the island at dusk.")
    set_number(page, "story-tokens", 48)
    start_and_wait(page, "#story-continue")
    assert gauge(page, "story-gauge")["state"] == "at-budget"
    # Pin the newest words (still held everywhere): the gauge keeps saying the cache is
    # evicting, and "budget" stays the settings' 36 with the pins on top.
    newest = " ".join(page.input_value("#story-text textarea").split()[-3:])
    page.fill("#story-pin-text textarea", newest)
    page.click("#story-pin")
    expect(page.locator("#story-pin-list .pins")).to_have_attribute("data-count", "1")
    expect(page.locator("#story-gauge")).to_contain_text("tokens evicted per layer and head")
    pinned = page.locator("#story-pin-list .pins").get_attribute("data-pinned")
    expect(page.locator("#story-gauge")).to_contain_text(f"budget 36 + {pinned} pinned")
    assert gauge(page, "story-gauge")["state"] == "at-budget"


# WCAG contrast of an element's text against the first opaque background behind it.
CONTRAST = """selector => {
  const element = document.querySelector(selector);
  if (!element) return null;
  const rgb = colour => (colour.match(/[\\d.]+/g) || []).map(Number);
  let behind = [255, 255, 255];
  for (let e = element; e; e = e.parentElement) {
    const c = rgb(getComputedStyle(e).backgroundColor);
    if (c.length === 3 || c[3] > 0.5) { behind = c.slice(0, 3); break; }
  }
  const channel = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  const lum = ([r, g, b]) => 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b);
  const [a, b] = [lum(rgb(getComputedStyle(element).color).slice(0, 3)), lum(behind)];
  return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
}"""


def test_dark_mode_keeps_the_gauge_and_the_maps_readable(browser, app_url):
    page = open_app(browser, app_url + "?__theme=dark")
    try:
        assert page.evaluate("() => document.body.classList.contains('dark')")
        open_tab(page, "Story")
        configure(page, heavy=16, recent=16)
        page.fill("#story-text textarea", "The storm reached the island at dusk.")
        set_number(page, "story-tokens", 64)
        start_and_wait(page, "#story-continue")
        for selector, least in [
            ("#story-gauge .gstate", 4.5), ("#story-gauge .gnums", 3),
            ("#story-token-map .maplegend .k1", 4.5), ("#story-token-map .maplegend .ev", 3),
            ("#story-token-map .tokmap .ev", 3), ("#story-heat-map .heataxis", 3),
        ]:
            contrast = page.evaluate(CONTRAST, selector)
            assert contrast is not None and contrast >= least, (selector, contrast)
        src = page.locator("#story-heat-map img").get_attribute("src")
        image = Image.open(BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGBA")
        pixels = np.asarray(image)
        shown = pixels[..., 3] > 0
        assert not shown.all()  # evicted cells are see-through: they show the dark page
        assert not (shown & (pixels[..., :3].min(axis=-1) > 230)).any()  # none glaring white
    finally:
        page.context.close()


def test_the_token_map_follows_the_newest_tokens(browser, app_url):
    page = open_app(browser, app_url, width=700, height=900)
    try:
        configure(page, max_new_tokens=8)
        text = (DATA / "pride_and_prejudice_ch1-6.txt").read_text()[:2500]
        send(page, "#chat-input", "#chat-send", f"Summarize this in one line: {text}")
        tokmap = page.locator("#chat-token-map .tokmap")
        assert tokmap.evaluate("m => m.scrollHeight > m.clientHeight")  # it does scroll
        page.wait_for_function(
            "() => { const m = document.querySelector('#chat-token-map .tokmap');"
            " return m.scrollTop + m.clientHeight >= m.scrollHeight - 30; }", timeout=5_000)
    finally:
        page.context.close()


def test_nothing_floats_over_the_top_of_the_chats(browser, app_url):
    page = open_app(browser, app_url, height=720)
    try:
        configure(page, max_new_tokens=40)
        show_settings(page, False)
        questions = ["Name three fruits and describe each.", "Now three vegetables, described."]
        for question in questions:
            send(page, "#chat-input", "#chat-send", question)
        assert _top_edge_reaches_the_conversation(page, "chatbot") == [True, True, True]
        open_tab(page, "Compare")
        for question in questions:
            send(page, "#compare-input", "#compare-send", question)
        for chat in ("compare-bounded-chat", "compare-full-chat"):
            assert _top_edge_reaches_the_conversation(page, chat) == [True, True, True], chat
    finally:
        page.context.close()


def _top_edge_reaches_the_conversation(page, chatbot: str):
    """Along the top edge of the chat's scrolled conversation (bar the corner, where the
    Clear icon stays), whether a click reaches the conversation itself, not a label or an
    icon floating over it."""
    return page.locator(f"#{chatbot} [role=log]").evaluate("""log => {
      let box = log;
      while (box !== document.body && !(box.scrollHeight > box.clientHeight + 4 &&
             /auto|scroll/.test(getComputedStyle(box).overflowY))) box = box.parentElement;
      if (box === document.body || box.scrollTop === 0) return "not scrolled";
      const r = box.getBoundingClientRect();
      return [[r.left + 14, r.top + 14], [(r.left + r.right) / 2, r.top + 14],
              [r.right - 50, r.top + 14]].map(([x, y]) => {
        const hit = document.elementFromPoint(x, y);
        return box.contains(hit) && !hit.closest("button, [data-testid=block-label]");
      });
    }""")


def _send_by_mouse(page) -> None:
    """Send a message with a real click at Send's centre, the pointer left there."""
    configure(page, max_new_tokens=64)
    show_settings(page, False)
    page.fill("#chat-input textarea", "Name three fruits.")
    send = page.locator("#chat-send").bounding_box()
    page.mouse.click(send["x"] + send["width"] / 2, send["y"] + send["height"] / 2)
    expect(page.locator("#chat-stop")).to_be_visible()


def test_the_second_click_of_a_double_click_on_send_is_no_stop(page):
    """QA: the second click of a double-click on Send landed on the Stop shown in its
    place and stopped the turn before its reply ("Stopped before the reply began")."""
    _send_by_mouse(page)
    page.mouse.down(click_count=2)  # the pointer is still there: one click, the browser's second
    page.mouse.up(click_count=2)
    expect(page.locator("#chat-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    page.wait_for_selector(".generating", state="detached")
    assert messages(page, "chatbot", "user") == ["Name three fruits."]
    assert not [chip for chip in page.locator("#chatbot .option").all_inner_texts() if "stopped" in chip]


def test_the_second_click_of_a_double_click_on_send_touches_nothing_beside_it(page):
    """QA: in the frame where Send is hidden and Stop not drawn yet, the control beside them
    slid under the pointer, and the second click of a fast double-click on Send ticked
    "pin this message". That click, wherever it lands, is part of the click on Send."""
    _send_by_mouse(page)
    pin = page.locator("#chat-pin-message input")
    # The turn's first update unticks the box, so a tick is caught as it happens.
    pin.evaluate("box => box.addEventListener('change', () => { window.pinTicked = true; })")
    place = pin.bounding_box()
    # The control that slid under the pointer takes the browser's second click.
    page.mouse.move(place["x"] + place["width"] / 2, place["y"] + place["height"] / 2)
    page.mouse.down(click_count=2)
    page.mouse.up(click_count=2)
    expect(page.locator("#chat-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
    assert not page.evaluate("window.pinTicked"), "the second click ticked 'pin this message'"
    expect(pin).not_to_be_checked()
    assert messages(page, "chatbot", "user") == ["Name three fruits."]
    pin.click()  # a click of its own still ticks it
    expect(pin).to_be_checked()
