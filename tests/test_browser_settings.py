"""What the user typed is what runs: settings typed into a fresh page are the ones every
reply runs with (its small print says so), on a page that lags too; and a page loaded
again says that what it held was reset.

Run it beside the serving benchmark to check it on a loaded machine (docs/testing.md)."""

from __future__ import annotations

from playwright.sync_api import expect

from .browser_support import (
    after_next_frame, configure, gauge, open_app, open_tab, ran_with, running_app, send, set_number, show_settings,
    shown_settings, start_and_wait, typed_settings,
)

# Each page its own settings, none of them the defaults (temperature 0.7, top-p 0.9,
# 128 tokens, no seed), sampled: a reply at the defaults differs from one at these.
PAGES = [
    {"temperature": 1, "top_p": 0.8, "seed": 11, "max_new_tokens": 12},
    {"temperature": 0, "top_p": 0.5, "seed": 3, "max_new_tokens": 9},
    {"temperature": 1.3, "top_p": 0.95, "seed": 5, "max_new_tokens": 15},
]
TURNS = ["Name a fruit.", "And a vegetable?"]
VIEWS = [("Chat", "chat", "#chat-input", "#chat-send"),
         ("Compare", "compare", "#compare-input", "#compare-send")]

# Held animation frames, as on a loaded machine where the page's frames come late: the
# callbacks wait until ``releaseFrames()``. Playwright's own waits run in a world of
# their own, which this does not touch.
HOLD_FRAMES = """() => {
  const held = [];
  const run = window.requestAnimationFrame.bind(window);
  let holding = true;
  window.requestAnimationFrame = callback => holding ? (held.push(callback), 0) : run(callback);
  window.releaseFrames = () => { holding = false; held.splice(0).forEach(callback => run(callback)); };
}"""


def assert_ran_with_typed(page, view: str, settings: dict[str, float]) -> None:
    """The page still shows the typed settings, and the view's latest reply ran with them."""
    typed = typed_settings(**settings)
    assert shown_settings(page, *typed) == typed, "the page no longer shows the typed settings"
    ran = ran_with(page, view)
    assert {name: ran[name] for name in typed} == typed, f"the reply ran with {ran}"


def test_every_reply_runs_with_the_settings_typed_into_a_fresh_page(browser, app_url):
    for settings in PAGES:
        page = open_app(browser, app_url)
        try:
            configure(page, **settings)
            for tab, view, box, button in VIEWS:
                open_tab(page, tab)
                for text in TURNS:
                    send(page, box, button, text)
                    assert_ran_with_typed(page, view, settings)
                    ran = ran_with(page, view)
                    assert (ran["policy"], ran["budget"]) == ("turns", "260 slots")
        finally:
            page.context.close()


def test_settings_typed_while_the_page_lags_are_the_ones_the_reply_runs_with(browser, app_url):
    """The settings panel's controls hold what was typed into them before the page's next
    animation frame: Gradio used to hand a control drawn late its first value in that
    frame, which undid the typing without a word."""
    page = open_app(browser, app_url)
    try:
        page.evaluate(HOLD_FRAMES)
        configure(page, **PAGES[0])
        page.evaluate("() => window.releaseFrames()")
        after_next_frame(page)  # Gradio's old hand-over, held until now, has run
        send(page, "#chat-input", "#chat-send", TURNS[0])
        assert_ran_with_typed(page, "chat", PAGES[0])
    finally:
        page.context.close()


def test_story_continues_with_the_typed_settings_and_says_so(page):
    configure(page, **PAGES[1])
    open_tab(page, "Story")
    page.fill("#story-text textarea", "The storm reached the island at dusk.")
    start_and_wait(page, "#story-continue")
    ran = ran_with(page, "story")
    typed = typed_settings(**PAGES[1])
    # The story's length per continue is its own slider's (64 unless moved).
    assert {name: ran[name] for name in typed if name != "max-new-tokens"} == {
        name: value for name, value in typed.items() if name != "max-new-tokens"}
    assert ran["max-new-tokens"] == "64"
    # A story has no turns: the page's turns setting runs as h2o on the same slots.
    assert (ran["policy"], ran["budget"]) == ("h2o", "260 slots")
    assert gauge(page, "story-gauge")["budget"] == "260"


def test_a_page_loaded_again_says_its_conversation_and_settings_were_reset(page):
    expect(page.locator("#page-reset")).to_be_hidden()
    configure(page, max_new_tokens=8)
    send(page, "#chat-input", "#chat-send", TURNS[0])
    page.reload()
    expect(page.locator("#page-reset")).to_contain_text("reset to the defaults")
    expect(page.locator("#chatbot [data-testid=bot]")).to_have_count(0)
    show_settings(page)
    assert shown_settings(page, "temperature", "max-new-tokens") == {
        "temperature": "0.7", "max-new-tokens": "128"}


def test_logging_in_is_not_taken_for_a_page_loaded_again(browser):
    """Gradio's login form reloads the page once the login is taken: that first page says
    nothing was reset (it had nothing), and a page the user reloads after it still does."""
    with running_app(env={"H2O_CHAT_USERNAME": "ada", "H2O_CHAT_PASSWORD": "lovelace"}) as url:
        page = browser.new_page()
        try:
            page.goto(url, wait_until="domcontentloaded")
            page.locator("input[type=text]").first.fill("ada")
            page.locator("input[type=password]").fill("lovelace")
            page.locator("input[type=password]").press("Enter")
            page.wait_for_selector("body[data-reload-checked]", timeout=60_000)
            after_next_frame(page)  # an update the check returned is drawn by now
            assert page.evaluate("performance.getEntriesByType('navigation')[0].type") == "reload"
            expect(page.locator("#page-reset")).to_be_hidden()
            page.reload()
            expect(page.locator("#page-reset")).to_contain_text("reset to the defaults")
        finally:
            page.context.close()


def test_a_slider_whose_box_is_emptied_keeps_its_value(page):
    """Gradio's slider took its minimum for a number box left empty, without a word
    (temperature 0, top-p 0.05, one new token): the box gets back what it showed."""
    configure(page, **PAGES[0])
    open_tab(page, "Story")
    for elem_id in ("temperature", "top-p", "max-new-tokens", "story-tokens"):
        box = page.locator(f"#{elem_id} input[type=number]")
        box.fill("")
        box.blur()
    assert shown_settings(page, "story-tokens") == {"story-tokens": "64"}
    open_tab(page, "Chat")
    send(page, "#chat-input", "#chat-send", TURNS[0])
    assert_ran_with_typed(page, "chat", PAGES[0])


def test_a_value_typed_past_a_sliders_end_runs_as_typed_or_is_refused_by_name(page):
    """Gradio's slider put a value typed into its box back inside the slider's ends without
    a word (5000 new tokens ran as 1024, temperature 3 as 2). A value the config's rules
    allow runs as typed; one they do not is refused by name, the message kept to send again."""
    # Top-p 0.01 keeps only the likeliest token: the reply ends as a greedy one does.
    configure(page, temperature=3, top_p=0.01, max_new_tokens=1500)
    send(page, "#chat-input", "#chat-send", TURNS[0])
    ran = ran_with(page, "chat")
    assert (ran["temperature"], ran["top-p"], ran["max-new-tokens"]) == ("3", "0.01", "1500")
    set_number(page, "max-new-tokens", 40000)
    page.fill("#chat-input textarea", TURNS[1])
    page.click("#chat-send")
    expect(page.locator("[data-testid=toast-body]",
                        has_text="generation.max_new_tokens = 40000: must be an integer from 1 to 32768")
           ).to_have_count(1)
    expect(page.locator("#chat-input textarea")).to_have_value(TURNS[1])
    open_tab(page, "Story")
    set_number(page, "story-tokens", 0)
    page.fill("#story-text textarea", "The storm reached the island at dusk.")
    page.click("#story-continue")
    expect(page.locator("[data-testid=toast-body]",
                        has_text="generation.max_new_tokens = 0: must be an integer from 1 to 32768")
           ).to_have_count(1)
