"""Many browsers on one model, through the real app and Debian's chromium: separate
conversations that equal the same ones run alone, a visible queue past the server's
generation limit, and sessions freed when their tabs close."""

from __future__ import annotations

import re
import socket

import pytest

from h2o_chat import ChatSession
from h2o_chat.bench.client import send_chat, wait_for_metrics
from h2o_chat.config import load_config
from h2o_chat.ui.settings import new_cache

from playwright.sync_api import expect

from .browser_support import (
    DONE_TIMEOUT_MS, LONG_COUNTING_REPLY, configure, messages, open_app, ran_with, running_app, seen,
    typed_settings, watch_progress,
)

CONVERSATIONS = [
    ["What is the capital of France?", "And of Spain?", "Which is bigger?", "Name a river there.",
     "Thanks!"],
    ["Name three colours.", "Which one is warm?", "Name a fruit of that colour.", "Is it sweet?",
     "Bye."],
    ["What is 2 + 2?", "Times three?", "Minus five?", "Is that prime?", "Good."],
    ["Say hello in French.", "In Spanish?", "In German?", "In Italian?", "Which is shortest?"],
]
MAX_NEW_TOKENS = 8
# Each page samples with a seed of its own (the app's default temperature is 0.7 and no
# seed): a page whose turn ran with other settings than typed answers something else.
SAMPLED = {"temperature": 1, "top_p": 0.9, "max_new_tokens": MAX_NEW_TOKENS}
SEEDS = [101, 102, 103, 104]
LIMIT = 2  # generations at once: four browsers make two of them wait
PAGE_CONVERSATIONS = 4  # open at once: as many as the four browsers above
MAX_MESSAGE_CHARS = 2000


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "load.yaml"
    config.write_text(f"server:\n  max_concurrent_generations: {LIMIT}\n"
                      f"  max_message_chars: {MAX_MESSAGE_CHARS}\n"
                      f"  max_page_conversations: {PAGE_CONVERSATIONS}\n")
    with running_app("--config", str(config)) as url:
        yield url


def _plain(text: str) -> str:
    """Text as a chatbot bubble shows it, give or take its Markdown (list markers are
    drawn, not text; emphasis marks vanish)."""
    text = re.sub(r"(?m)^\s*(\d+\.|[-+*])\s+", "", text)
    return re.sub(r"\s+", " ", re.sub(r"[*_`#]", "", text)).strip()


def _alone(model, tokenizer, questions: list[str], seed: int) -> list[str]:
    """The replies of the same conversation run alone, on the app's default cache, sampled
    as ``SAMPLED`` with ``seed``."""
    config = load_config()
    cache = config.cache
    session = ChatSession(model, tokenizer, new_cache(model, cache),
                          system_prompt=config.generation.system_prompt,
                          prefill_chunk_size=cache.prefill_chunk_size)
    return ["".join(session.send(q, seed=seed, **SAMPLED)) for q in questions]


def _server_line(page) -> str:
    return page.locator("#server-load").inner_text()


def _wait_until_open(page, count: int, timeout: float = 30_000) -> None:
    """Until the server line counts ``count`` conversations open."""
    page.wait_for_function(f"document.querySelector('#server-load').innerText"
                           f".includes('{count} conversation{'s' * (count != 1)} open')", timeout=timeout)


def _hold_conversations(pages, max_new_tokens: int) -> None:
    """Each page says "Hi!" in its chat, which opens a conversation there; back once every
    reply ended."""
    for page in pages:
        configure(page, max_new_tokens=max_new_tokens)
        page.fill("#chat-input textarea", "Hi!")
        page.click("#chat-send")
    for page in pages:
        page.wait_for_selector("#chatbot [data-testid=bot]", timeout=DONE_TIMEOUT_MS)
        page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)


def test_four_browsers_five_turns_each_equal_their_conversations_run_alone(browser, app_url, smollm):
    pages = [open_app(browser, app_url) for _ in CONVERSATIONS]
    queued = False
    try:
        for page, seed in zip(pages, SEEDS):
            configure(page, seed=seed, **SAMPLED)
        for turn in range(5):
            for page, questions in zip(pages, CONVERSATIONS):
                page.fill("#chat-input textarea", questions[turn])
            # Gradio shows a waiting event's place in the queue on its outputs.
            places = [watch_progress(page, "#chatbot", "queue:") for page in pages]
            for page in pages:
                page.click("#chat-send")
            for page in pages:
                page.wait_for_function(
                    f"document.querySelectorAll('#chatbot [data-testid=bot]').length == {turn + 1}",
                    timeout=DONE_TIMEOUT_MS)
                page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
            if turn == 0:
                queued = any(seen(place) for place in places)
            for page, seed in zip(pages, SEEDS):
                typed, ran = typed_settings(seed=seed, **SAMPLED), ran_with(page, "chat")
                assert {name: ran[name] for name in typed} == typed, f"turn {turn + 1} ran with {ran}"
        assert queued, "no page showed its place in the queue while two others generated"
        for page, questions, seed in zip(pages, CONVERSATIONS, SEEDS):
            assert messages(page, "chatbot", "user") == questions
            shown = [_plain(reply) for reply in messages(page, "chatbot", "bot")]
            assert shown == [_plain(reply) for reply in _alone(*smollm, questions, seed)]
    finally:
        for page in pages:
            page.context.close()


def test_a_message_over_the_limit_is_refused_in_the_page_and_the_chat_goes_on(browser, app_url):
    page = open_app(browser, app_url)
    try:
        configure(page, max_new_tokens=4)
        page.fill("#chat-input textarea", "Hi!")
        page.click("#chat-send")
        page.wait_for_selector("#chatbot [data-testid=bot]", timeout=DONE_TIMEOUT_MS)
        page.wait_for_selector(".generating", state="detached", timeout=DONE_TIMEOUT_MS)
        before = messages(page, "chatbot", "bot")
        page.fill("#chat-input textarea", "x" * (MAX_MESSAGE_CHARS + 1))
        page.click("#chat-send")
        page.get_by_text("the limit is 2,000 (server.max_message_chars)").first.wait_for(timeout=30_000)
        assert messages(page, "chatbot", "user") == ["Hi!"] and messages(page, "chatbot", "bot") == before
        page.fill("#chat-input textarea", "Thanks!")
        page.click("#chat-send")
        page.wait_for_function(
            "document.querySelectorAll('#chatbot [data-testid=bot]').length == 2", timeout=DONE_TIMEOUT_MS)
        assert messages(page, "chatbot", "user") == ["Hi!", "Thanks!"]
    finally:
        page.context.close()


def test_closing_tabs_frees_their_sessions_at_once(browser, app_url):
    pages = [open_app(browser, app_url) for _ in range(3)]
    try:
        _hold_conversations(pages, max_new_tokens=4)
        # Every earlier page of this module was closed too: only these three are open.
        _wait_until_open(pages[0], 3, timeout=20_000)
        for page in pages[1:]:
            page.context.close()
        _wait_until_open(pages[0], 1)
        assert "0 generating" in _server_line(pages[0])
    finally:
        pages[0].context.close()


def test_stop_while_waiting_in_the_queue_ends_the_turn_before_it_reads_a_token(browser, app_url):
    """Two pages hold both generation slots; a third asks for a reply, waits in the queue
    and presses Stop there. When a slot frees, its turn ends before it reads its prompt:
    no text comes, and its next message is answered as usual."""
    busy = [open_app(browser, app_url) for _ in range(LIMIT)]
    waiting = open_app(browser, app_url)
    try:
        for page in busy:
            # Greedy, this story runs all 1024 tokens (measured): the busy replies outlast
            # the waiting page's set-up however fast the machine (a 286-token sampled reply
            # ended before it on a quiet one, and nothing was left to queue behind).
            configure(page, max_new_tokens=1024)
            page.fill("#chat-input textarea", "Write a long story about a dragon.")
            page.click("#chat-send")
        for page in busy:
            page.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
                                   ".some(e => e.innerText.length > 0)", timeout=DONE_TIMEOUT_MS)
        configure(waiting, max_new_tokens=16)
        waiting.fill("#chat-input textarea", "Write a poem about the sea.")
        waiting.click("#chat-send")
        expect(waiting.locator("#chatbot [data-testid=status-tracker]:not(.hide)")).to_contain_text("queue:")
        waiting.click("#chat-stop")
        for page in busy:
            # Esc, not a click on Stop: on a loaded machine a busy reply may already have
            # ended (its slot free all the same), and a click would wait for a Stop gone.
            page.keyboard.press("Escape")
        expect(waiting.locator("#chat-send")).to_be_visible(timeout=DONE_TIMEOUT_MS)
        assert "".join(messages(waiting, "chatbot", "bot")).strip() in ("", "Continue")
        waiting.fill("#chat-input textarea", "Say hello.")
        waiting.click("#chat-send")
        waiting.wait_for_function("() => [...document.querySelectorAll('#chatbot [data-testid=bot]')]"
                                  ".some(e => e.innerText.trim().length > 8)", timeout=DONE_TIMEOUT_MS)
    finally:
        for page in [*busy, waiting]:
            page.context.close()


def _until(app_url: str, condition) -> dict[str, float]:
    return wait_for_metrics(app_url, condition, timeout=DONE_TIMEOUT_MS / 1000)


def _long_api_reply(app_url: str) -> socket.socket:
    """A streamed API request for a reply that outlasts the test (the test closes its
    socket to leave)."""
    return send_chat(app_url, {"messages": [{"role": "user", "content": "Count to five hundred."}],
                               "stream": True, "max_tokens": 32768, "ignore_eos": True})


def test_page_and_api_turns_share_one_admission(browser, app_url):
    """The server's generation limit holds over both doors: with both slots taken by API
    requests a page's turn waits (and says so), and with one taken by the page's long
    reply and one by the API a further API request waits."""
    page = open_app(browser, app_url)
    sockets = []
    try:
        sockets += [_long_api_reply(app_url) for _ in range(LIMIT)]
        _until(app_url, lambda m: m["h2o_chat_generations_running"] == LIMIT)
        configure(page, max_new_tokens=300, **LONG_COUNTING_REPLY)
        page.fill("#chat-input textarea", "Count from one to two hundred in words.")
        page.click("#chat-send")
        expect(page.locator("#chatbot [data-testid=bot]").last).to_contain_text(
            f"Waiting for a free generation slot: the server generates at most {LIMIT} replies at once")
        seen = _until(app_url, lambda m: m["h2o_chat_generations_waiting"] == 1)
        assert seen["h2o_chat_generations_running"] == LIMIT
        sockets.pop().close()  # an API client leaves: its slot goes to the page
        page.wait_for_function("() => /two|three/i.test([...document.querySelectorAll("
                               "'#chatbot [data-testid=bot]')].pop().innerText)", timeout=DONE_TIMEOUT_MS)
        sockets.append(_long_api_reply(app_url))  # the page and one API request hold both slots
        seen = _until(app_url, lambda m: m["h2o_chat_queued_requests"] == 1)
        assert (seen["h2o_chat_generations_running"], seen["h2o_chat_active_generations"]) == (LIMIT, 1)
        # The page's slot goes to the waiting API request (Esc: on a loaded machine the
        # page's reply may have ended on its own, its slot free all the same).
        page.keyboard.press("Escape")
        _until(app_url, lambda m: m["h2o_chat_queued_requests"] == 0 and m["h2o_chat_active_generations"] == 2)
    finally:
        for connection in sockets:
            connection.close()
        page.context.close()
    _until(app_url, lambda m: m["h2o_chat_generations_running"] == m["h2o_chat_generations_waiting"] == 0)


def test_a_conversation_past_the_pages_limit_is_refused_until_a_tab_closes(browser, app_url):
    pages = [open_app(browser, app_url) for _ in range(PAGE_CONVERSATIONS + 1)]
    *holding, last = pages
    try:
        # Every earlier page of this module was closed: none is open.
        _wait_until_open(last, 0)
        _hold_conversations(holding, max_new_tokens=2)
        configure(last, max_new_tokens=2)
        last.fill("#chat-input textarea", "Hello!")
        last.click("#chat-send")
        expect(last.locator("[data-testid=toast-body]", has_text=(
            f"The server holds {PAGE_CONVERSATIONS} conversations open in pages, its limit "
            "(server.max_page_conversations): close a tab you no longer use, or wait until one idle "
            "for 30 minutes is freed."))).to_have_count(1)
        assert messages(last, "chatbot", "user") == []
        assert last.input_value("#chat-input textarea") == "Hello!"  # kept, to send again
        holding.pop().context.close()
        _wait_until_open(last, PAGE_CONVERSATIONS - 1)
        last.click("#chat-send")
        last.wait_for_selector("#chatbot [data-testid=bot]", timeout=DONE_TIMEOUT_MS)
        assert messages(last, "chatbot", "user") == ["Hello!"]
    finally:
        for page in [*holding, last]:
            page.context.close()
