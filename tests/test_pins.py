"""Pinned memory: pin text of a conversation, keep it through evictions, unpin it."""

import re
from dataclasses import replace

import gradio as gr
import pytest
import torch

from h2o_chat import ChatSession, StorySession, make_cache
from h2o_chat.config import load_config
from h2o_chat.sessions.pins import decode, find_span, token_pieces
from h2o_chat.ui.chat_tab import ChatState, ChatTab
from h2o_chat.ui.gauges import Gauge, gauge_html
from h2o_chat.ui.pin_panel import pins_html, warn_dropped_pins
from h2o_chat.runtime import ModelProvider
from h2o_chat.ui.settings import Settings

from playwright.sync_api import expect

from .browser_support import configure, gauge, send, show_settings, start_and_wait
from .helpers import BOOK_EXCERPT, fail_next_update, feed

FACT = "My name is Marisol Quentaro and my locker code is 4817."
GREEDY = dict(temperature=0, max_new_tokens=8)


def h2o(model, heavy, recent, sink=4):
    return make_cache(model, "h2o", heavy=heavy, recent=recent, sink=sink)


def holders(cache, start, end) -> list[int]:
    """For each position in [start, end): how many (layer, row, KV head) triples hold it."""
    counts = torch.zeros(end - start, dtype=torch.long)
    for layer in cache.stats().layers:
        inside = layer.positions[(layer.positions >= start) & (layer.positions < end)]
        counts += torch.bincount(inside - start, minlength=end - start)
    return counts.tolist()


def heads(cache) -> int:
    return sum(layer.positions.shape[0] * layer.positions.shape[1] for layer in cache.stats().layers)


def book_paste(tokenizer, tokens: int) -> str:
    text = BOOK_EXCERPT.read_text(encoding="utf-8")[5000:40000]
    return tokenizer.decode(tokenizer(text).input_ids[:tokens])


# ---- the cache: protect and unprotect --------------------------------------------------


@pytest.mark.parametrize("policy", ["h2o", "recent"])
def test_unprotect_returns_a_span_to_eviction(tiny_model, policy):
    torch.manual_seed(7)
    ids = torch.randint(0, 128, (1, 400))
    budgets = dict(heavy=6, recent=6, sink=2) if policy == "h2o" else dict(recent=14)
    cache = make_cache(tiny_model, policy, **budgets)
    feed(tiny_model, cache, ids[:, :12], 12)  # under the 14 slots: nothing evicted yet
    cache.protect(4, 10)  # all past
    cache.protect(8, 20)  # half past, half future (pinned as it arrives)
    feed(tiny_model, cache, ids[:, 12:200], 1)  # 188 steps, each evicting a token
    stats = cache.stats()
    assert holders(cache, 4, 20) == [heads(cache)] * 16
    assert stats.pinned == 16 and stats.held == stats.budget == 14 + 16
    assert all(layer.held == 30 for layer in stats.layers)

    cache.unprotect(8, 20)
    stats = cache.stats()
    # 8 and 9 stay pinned by the other span; the cache is back at budget at once.
    assert stats.pinned == 6 and all(layer.held == 14 + 6 for layer in stats.layers)
    assert holders(cache, 4, 10) == [heads(cache)] * 6
    feed(tiny_model, cache, ids[:, 200:400], 1)
    left = holders(cache, 10, 20)
    if policy == "recent":
        assert left == [0] * 10  # out of the window: gone
    else:
        # Ordinary candidates again: each head keeps at most its 6 heavy hitters of them.
        assert sum(left) < heads(cache) * 6 and 0 in left
    assert cache.stats().held == 20


def test_protect_and_unprotect_refuse_bad_spans_and_change_nothing(tiny_model):
    cache = make_cache(tiny_model, "h2o", heavy=4, recent=4, sink=2)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 60)), 1)
    cache.protect(56, 70)  # the recent window and the future
    before = [layer.positions.clone() for layer in cache.stats().layers], list(cache.spans.ranges)
    assert cache.evicted(10, 20) == list(range(10, 20)) and cache.evicted(56, 70) == []
    with pytest.raises(ValueError, match=r"cannot protect \[10, 20\): 10 of those tokens were already evicted"):
        cache.protect(10, 20)
    with pytest.raises(ValueError, match=r"\[10, 20\) is not a protected span"):
        cache.unprotect(10, 20)
    after = [layer.positions for layer in cache.stats().layers], cache.spans.ranges
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1]


# ---- sessions: pin, pins, unpin ----------------------------------------------------------


def test_pinned_text_survives_evictions_and_unpinning_lets_it_go(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model, 40, 40), prefill_chunk_size=32)
    system = len(session.tokens)
    "".join(session.send(FACT, **GREEDY))
    assert session.cache.stats().held < 84  # under 4 + 40 + 40 slots: nothing evicted yet
    pin = session.pin("marisol Quentaro   and my locker code\nis 4817".replace("marisol", "Marisol"))
    assert pin.text.strip() == "Marisol Quentaro and my locker code is 4817" and not pin.fixed
    assert [p.fixed for p in session.pins()] == ["system prompt", None]

    paste = book_paste(tokenizer, 600)
    "".join(session.send(paste + "\n\nWho speaks first?", **GREEDY))  # ~20 chunks, each evicting
    cache = session.cache
    stats = cache.stats()
    assert stats.seen > 650 and stats.pinned == system + pin.tokens
    assert all(layer.held == stats.budget == 84 + system + pin.tokens for layer in stats.layers)
    assert holders(cache, pin.start, pin.end) == [heads(cache)] * pin.tokens

    # The paste's first words are gone from some heads: pinning them now is refused.
    before = [layer.positions.clone() for layer in stats.layers], list(cache.spans.ranges)
    first_words = " ".join(paste.split()[:6])
    with pytest.raises(ValueError, match="already evicted from the cache, and an evicted token cannot come back"):
        session.pin(first_words)
    assert before[1] == cache.spans.ranges
    assert all(torch.equal(a, b.positions) for a, b in zip(before[0], cache.stats().layers))

    assert session.unpin(pin.id) == pin
    stats = cache.stats()
    assert stats.pinned == system and all(layer.held == 84 + system for layer in stats.layers)
    "".join(session.send(book_paste(tokenizer, 300) + "\n\nAnd then?", **GREEDY))
    held = holders(cache, pin.start, pin.end)
    assert sum(held) < heads(cache) * pin.tokens / 2, held  # mostly evicted now
    assert [p.fixed for p in session.pins()] == ["system prompt"]


def test_a_message_pinned_as_sent_is_its_content_and_always_works(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model, 8, 8))  # a tiny budget
    system = len(session.tokens)
    "".join(session.send(FACT, pin=True, **GREEDY))
    [pin] = [p for p in session.pins() if not p.fixed]
    assert pin.text == FACT and pin.start > system  # the content, not the template
    assert session.tokens[pin.start:pin.end] == tokenizer(FACT, add_special_tokens=False).input_ids
    "".join(session.send("Tell me about the weather today, in detail please.", **GREEDY))
    stats = session.cache.stats()
    assert stats.held == stats.budget == 20 + system + pin.tokens  # 4 + 8 + 8
    assert holders(session.cache, pin.start, pin.end) == [heads(session.cache)] * pin.tokens
    # Text already fed under this budget is gone: pinning it afterwards is refused.
    with pytest.raises(ValueError, match="already evicted"):
        session.pin("Tell me about the weather")


def test_a_history_message_pins_its_own_tokens_not_a_later_copy(smollm):
    """A chat started from a history pins message ``i`` itself: the text's last copy is a
    reply quoting it, whose pin would leave the message to eviction."""
    model, tokenizer = smollm
    history = [{"role": "user", "content": "The code is 7421."},
               {"role": "assistant", "content": "Noted. The code is 7421."}]
    session = ChatSession(model, tokenizer, cache=h2o(model, 8, 8), history=history)
    pin = session.pin_history(0)
    reply = session.pin_history(1)
    assert pin.text == "The code is 7421." and reply.text == "Noted. The code is 7421."
    assert pin.end <= reply.start
    with pytest.raises(ValueError, match="is already pinned"):
        session.pin_history(0)


def test_matching_ignores_whitespace_and_keeps_characters_whole(smollm):
    model, tokenizer = smollm
    history = [{"role": "user", "content": "Café naïve 🙂 and   spaced\n\nwords."},
               {"role": "assistant", "content": "The café is closed. Café!"}]
    session = ChatSession(model, tokenizer, cache=h2o(model, 8, 8), history=history)
    # Nothing is fed yet, so any text can be pinned; each pin is undone to try the next.
    cases = {"spaced words": "spaced\n\nwords", "café": "café", "aïv": "aïv", "🙂": "🙂"}
    for text, inside in cases.items():
        pin = session.pin(text)
        assert inside in pin.text and "\ufffd" not in pin.text, (text, pin.text)
        session.unpin(pin.id)
    last, first = session.pin("Café"), session.pin("Café", near=0)
    assert last.text.strip() == "Café" and last.start > first.start
    assert "naïve" not in last.text and "Café" in first.text
    with pytest.raises(ValueError, match="already pinned"):
        session.pin(" Café ")
    with pytest.raises(ValueError, match="does not occur"):
        session.pin("Quentaro")
    for blank in (" \n ", "\u200b\u200e"):  # a zero-width space and a direction mark show nothing
        with pytest.raises(ValueError, match="nothing to pin: the text is empty"):
            session.pin(blank)
    with pytest.raises(ValueError, match="the system prompt: it always stays pinned"):
        session.unpin(session.pins()[0].id)
    with pytest.raises(ValueError, match="there is no pin 99"):
        session.unpin(99)
    # Sent later, the pins hold under a budget of 20 slots.
    "".join(session.send("Thanks.", **GREEDY))
    pinned = sum(p.tokens for p in session.pins())
    assert session.cache.stats().held == 20 + pinned


def test_text_spans_are_found_with_a_tokenizer_alone(smollm):
    _, tokenizer = smollm
    text = "Café naïve 🙂 and   spaced\n\nwords. Café!"
    tokens = tokenizer(text, add_special_tokens=False).input_ids
    firsts, pieces = token_pieces(tokenizer, tokens)
    assert "".join(pieces) == decode(tokenizer, tokens) and firsts[0] == 0 and firsts[-1] == len(tokens)
    assert all("\ufffd" not in piece for piece in pieces)  # the emoji's bytes stay in one piece
    last, first = find_span(tokenizer, tokens, "Café"), find_span(tokenizer, tokens, "Café", near=0)
    assert first[0] == 0 and last[0] > first[0]
    assert decode(tokenizer, tokens[slice(*last)]).strip() == "Café"
    assert "🙂" in decode(tokenizer, tokens[slice(*find_span(tokenizer, tokens, "🙂"))])
    assert decode(tokenizer, tokens[slice(*find_span(tokenizer, tokens, "spaced words"))]).split() == ["spaced", "words"]
    with pytest.raises(ValueError, match="'Quentaro' does not occur in the conversation"):
        find_span(tokenizer, tokens, "Quentaro")


def test_story_bible_stays_pinned_and_new_text_can_be_pinned(smollm, recwarn):
    model, tokenizer = smollm
    story = StorySession(model, tokenizer, cache=h2o(model, 8, 8), bible="Mira keeps the lighthouse.")
    "".join(story.send("The storm came at night.", pin=True, temperature=0, max_new_tokens=30))
    bible, pin = story.pins()
    assert bible.fixed == "story bible" and bible.text == "Mira keeps the lighthouse."
    assert pin.text == "The storm came at night." and pin.fixed is None
    with pytest.raises(ValueError, match="story bible"):
        story.unpin(bible.id)
    with pytest.raises(ValueError, match="nothing to pin"):
        story.send("", pin=True)
    assert story.cache.stats().held == 20 + bible.tokens + pin.tokens  # 12 pinned of 41 seen
    assert holders(story.cache, 0, 12) == [heads(story.cache)] * 12
    # Edited at the start, the story is read into a fresh session: the view warns.
    warn_dropped_pins(story)
    assert "1 pin(s) dropped" in str(recwarn.pop(UserWarning).message)
    warn_dropped_pins(StorySession(model, tokenizer, bible="Mira keeps the lighthouse."))
    warn_dropped_pins(None)
    assert not recwarn.list  # the bible alone is no loss


def test_a_turn_that_fails_takes_its_pin_back(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model, 64, 64))
    fail_next_update(session.cache.layers[3])
    with pytest.raises(RuntimeError, match="injected"):
        "".join(session.send(FACT, pin=True, **GREEDY))
    assert [p.fixed for p in session.pins()] == ["system prompt"]
    "".join(session.send("Hello!", **GREEDY))
    assert session.cache.stats().pinned == session.pins()[0].tokens


def test_pinning_waits_for_the_reply_to_end(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model, 64, 64))
    stream = session.send(FACT, **GREEDY)
    next(stream)  # the turn is running
    with pytest.raises(RuntimeError, match="while a reply is being generated"):
        session.pin("Marisol")
    "".join(stream)
    assert session.pin("Marisol").text.strip() == "Marisol"


# ---- the view ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_tab(smollm):
    config = load_config()
    provider = ModelProvider(lambda: smollm, "SmolLM2").start()
    provider.get()
    with gr.Blocks():
        tab = ChatTab(provider, Settings(config), config)
    return tab


def values_of(tab, state, changes=None):
    """The inputs a handler of ``tab`` receives: the components' defaults, a small
    budget, short greedy replies, and ``changes`` ({component: value})."""
    components = {tab.state, tab.text, tab.system_prompt, tab.pin_message, tab.pins.text,
                  tab.pins.choice, *tab.settings.components, tab.map.live, *tab.map.pickers, tab.swap.signal}
    values = {c: c.value for c in components} | {tab.state: state}
    values[tab.settings.heavy], values[tab.settings.recent] = 16, 16
    values[tab.settings.max_new_tokens], values[tab.settings.temperature] = 8, 0
    return values | (changes or {})


def test_pin_panel_pins_lists_and_unpins(chat_tab, recwarn):
    tab = chat_tab
    assert tab.pins.on_pin(values_of(tab, None, {tab.pins.text: "Marisol"})) == tab.pins.unchanged
    assert "send a message first" in str(recwarn.pop(UserWarning).message)

    # Send with "pin this message" ticked: the box unticks, the panel lists the pin.
    updates = list(tab.on_send(values_of(tab, None, {tab.text: FACT, tab.pin_message: True})))
    state = updates[0][tab.state]
    assert updates[0][tab.pin_message] is False
    listed = updates[-1][tab.pins.list]
    assert 'data-count="2"' in listed and "Marisol Quentaro" in listed
    [pin] = [p for p in state.session.pins() if not p.fixed]
    assert pin.text == FACT

    # A bad pin: a warning, nothing changes.
    spans = list(state.session.cache.spans.ranges)
    assert tab.pins.on_pin(values_of(tab, state, {tab.pins.text: "not in the chat"})) == tab.pins.unchanged
    assert "does not occur" in str(recwarn.pop(UserWarning).message)
    assert state.session.cache.spans.ranges == spans

    reply = state.session.messages[-1]["content"]
    update = tab.pins.on_pin(values_of(tab, state, {tab.pins.text: reply}))
    assert update[tab.pins.text] == "" and 'data-count="3"' in update[tab.pins.list]
    assert tab.gauge in update  # the gauge shows the new pinned count
    choices = [value for _, value in update[tab.pins.choice].choices]
    assert len(choices) == 2 and state.session.pins()[0].id not in choices

    # While a reply streams, the panel refuses (a warning) instead of touching the cache.
    with state.running():
        assert tab.pins.on_pin(values_of(tab, state, {tab.pins.text: "Marisol"})) == tab.pins.unchanged
    assert "still streaming" in str(recwarn.pop(UserWarning).message)

    assert tab.pins.on_unpin(values_of(tab, state, {tab.pins.choice: None})) == tab.pins.unchanged
    assert "Choose a pin" in str(recwarn.pop(UserWarning).message)
    update = tab.pins.on_unpin(values_of(tab, state, {tab.pins.choice: choices[-1]}))
    assert 'data-count="2"' in update[tab.pins.list]
    stats = state.session.cache.stats()
    assert f'data-pinned="{stats.pinned}"' in update[tab.pins.list]
    assert stats.pinned == sum(p.tokens for p in state.session.pins())


def test_rebuilding_a_chat_carries_its_pins(smollm, recwarn):
    loaded = ModelProvider(lambda: smollm, "SmolLM2").start().get()
    state = ChatState(loaded, load_config().cache, "Be brief.")
    "".join(state.session.send(FACT, pin=True, **GREEDY))
    "".join(state.session.send("What is my name?", pin=True, **GREEDY))
    shown = state.shown()
    state.rebuild(shown[:2])  # undo the last turn: its pinned message is gone
    [pin] = [p for p in state.session.pins() if not p.fixed]
    assert pin.text == FACT
    assert "does not occur" in str(recwarn.pop(UserWarning).message)
    html = pins_html(state.session.pins(), state.session.cache.stats())
    assert "not read yet" in html and 'data-pinned="0"' in html


def test_regenerate_keeps_a_pin_inside_the_message_it_sends_again(chat_tab, recwarn):
    """QA: the pin was looked for before the re-sent message only, so Regenerate (and an
    edit keeping the text) dropped it, warning that its text did not occur."""
    tab = chat_tab
    room = {tab.settings.heavy: 64, tab.settings.recent: 64}  # nothing evicted before the pin
    turn = tab.on_send(values_of(tab, None, {tab.text: "Hello there."} | room))
    state = next(turn)[tab.state]
    list(turn)
    list(tab.on_send(values_of(tab, state, {tab.text: "My secret code word is zebra42, please remember it."})))
    tab.pins.on_pin(values_of(tab, state, {tab.pins.text: "secret code word is zebra42"}))
    [before] = [p for p in state.session.pins() if not p.fixed]
    list(tab.on_regenerate(values_of(tab, state)))
    assert not [w for w in recwarn if "dropped" in str(w.message)]
    [after] = [p for p in state.session.pins() if not p.fixed]
    assert after.text == before.text and after.end <= state.session.fed
    assert state.session.cache.evicted(after.start, after.end) == []
    assert state.session.messages[-2]["content"] == "My secret code word is zebra42, please remember it."
    messages = list(state.session.messages)
    with pytest.raises(ValueError, match="does not occur"):
        state.session.send("Thanks!", pin_parts=["zebra42"])  # in the history, not in this message
    assert state.session.messages == messages


def test_pin_panel_in_the_browser(page):
    """The real app: pin a message as it is sent, pin copied text, a refused pin warns
    and leaves the panel working, unpin."""
    configure(page, heavy=24, recent=24, max_new_tokens=8)
    show_settings(page, False)
    page.check("#chat-pin-message input")
    send(page, "#chat-input", "#chat-send", FACT)
    assert not page.is_checked("#chat-pin-message input")  # for one message only
    assert pin_list(page)["count"] == "2"  # system prompt + the message

    page.fill("#chat-pin-text textarea", "not in the chat")
    page.click("#chat-pin")
    expect(page.locator(".toast-body.warning")).to_contain_text("does not occur")
    assert page.input_value("#chat-pin-text textarea") == "not in the chat"

    page.fill("#chat-pin-text textarea", "Quentaro and my")
    start_and_wait(page, "#chat-pin")
    expect(page.locator("#chat-pin-list .pins")).to_have_attribute("data-count", "3")
    assert page.input_value("#chat-pin-text textarea") == ""
    assert gauge(page, "chat-gauge")["budget"] == str(52 + int(pin_list(page)["pinned"]))

    page.locator("#chat-unpin-choice input").click()
    page.get_by_role("option", name=re.compile(r"^3: Quentaro and my")).click()
    start_and_wait(page, "#chat-unpin")
    expect(page.locator("#chat-pin-list .pins")).to_have_attribute("data-count", "2")
    assert page.locator(".toast-body.error").count() == 0  # no handler failed


def pin_list(page) -> dict[str, str]:
    return page.locator("#chat-pin-list .pins").evaluate("e => ({...e.dataset})")


def test_the_pin_headline_counts_a_pin_inside_the_system_prompt_as_yours(smollm):
    loaded = ModelProvider(lambda: smollm, "SmolLM2").start().get()
    state = ChatState(loaded, load_config().cache, "Be brief and kind.")
    "".join(state.session.send("Hello!", **GREEDY))
    pin = state.session.pin("brief and kind")  # only in the system prompt
    [fixed] = [p for p in state.session.pins() if p.fixed]
    assert fixed.start <= pin.start < pin.end <= fixed.end
    stats = state.session.cache.stats()
    html = pins_html(state.session.pins(), stats)
    assert stats.pinned == fixed.tokens  # the pin adds no slot: overlaps count once
    assert f'data-fixed="{fixed.tokens}"' in html and f'data-yours="{pin.tokens}"' in html
    assert f"({fixed.tokens} fixed, {pin.tokens} yours, overlaps counted once)" in html


def test_the_budget_shown_before_the_first_send_counts_the_pins_not_read_yet(smollm):
    """QA: before a chat's first send (an imported one's too) a budget in bytes showed as
    the budget less the system prompt's slots in the gauge, and the pin panel counted those
    slots as left for the rest; a budget in slots said fewer slots held at most."""
    loaded = ModelProvider(lambda: smollm, "SmolLM2").start().get()
    for budget_mb in (1.0, None):
        state = ChatState(loaded, replace(load_config().cache, budget_mb=budget_mb, heavy=16), "Be brief and kind.")
        shown = []
        for _ in range(2):
            gauge = gauge_html(Gauge.of("h2o", state.session.stats()))
            headline = pins_html(state.session.pins(), state.session.cache.stats())
            shown.append((re.search(r"budget <b>([^<]+)</b>", gauge)[1],
                          re.search(r"(within|on top of) the .*?per layer and KV head", headline)[0]))
            "".join(state.session.send("Hello!", **GREEDY))
        [fixed] = [p for p in state.session.pins() if p.fixed]
        assert state.session.cache.stats().pinned == fixed.tokens > 0
        assert shown[0] == shown[1], budget_mb


def test_the_pin_headline_of_a_budget_in_bytes_puts_the_pins_within_it(smollm):
    """QA: it said the pins came on top of the budget, where a budget in bytes holds them."""
    loaded = ModelProvider(lambda: smollm, "SmolLM2").start().get()
    state = ChatState(loaded, replace(load_config().cache, budget_mb=1.0), "Be brief and kind.")
    "".join(state.session.send("Hello!", **GREEDY))
    stats = state.session.cache.stats()
    assert stats.budget_bytes == 1_000_000 and stats.pinned > 0
    assert (f"within the budget of <b>{stats.budget}</b> slots (1 MB): <b>{stats.budget - stats.pinned}</b> "
            "left for the rest") in pins_html(state.session.pins(), stats)
