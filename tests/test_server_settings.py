"""A server whose cache settings its model cannot hold (a budget past the model's context,
within the config's own ranges): once the model is loaded, the page, ``/health`` and every
turn say so with the config's message naming the field, and the API answers with a
server-side status, never blaming the request. Through real HTTP: ``app.py`` started with
the flag, Debian's chromium on its page, ``httpx`` on its API; and the API served in this
process for a config file's setting."""

from __future__ import annotations

import time

import httpx
from playwright.sync_api import expect

from h2o_chat.config import load_config

from .api_support import MODEL_ID, serving
from .browser_support import running_app, toasts

# The embedded model at its float32 precision: a token takes 30 layers x 3 KV heads x
# (512 bytes of key and value + 14 of bookkeeping).
TOO_MANY_MEGABYTES = (
    "the server's cache settings do not fit the model: cache.budget_mb = 1000000.0: holds 21,123,785 tokens at "
    "47,340 bytes a token; must hold from 5 (the sink plus one) to 8,192 (the model's context, "
    "max_position_embeddings), i.e. from 0.2367 MB to 387.857 MB; change them in the config file or on the "
    "command line and restart the app")
TOO_MANY_SLOTS = (
    "the server's cache settings do not fit the model: cache.heavy + cache.recent + cache.sink = 100000 + 16 + 4 "
    "= 100020 slots: must be at most the model's context of 8,192 tokens (max_position_embeddings); change them in "
    "the config file or on the command line and restart the app")
USER = [{"role": "user", "content": "Hi"}]


def health_once_loaded(url: str) -> httpx.Response:
    """``/health`` once the model is no longer loading (the server checks its settings
    against the model as soon as it is loaded)."""
    deadline = time.monotonic() + 180
    while (response := httpx.get(url + "/health")).json()["status"] == "loading":
        assert time.monotonic() < deadline, "the model was still loading after 180 s"
        time.sleep(0.5)
    return response


def assert_unavailable(url: str, failure: str, model: str) -> None:
    health = health_once_loaded(url)
    assert health.status_code == 503
    assert health.json() == {"status": "error", "model": model, "error": failure}
    for stream in (False, True):
        reply = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "stream": stream}, timeout=60)
        assert reply.status_code == 503
        assert reply.json() == {"error": {"message": failure, "type": "unavailable_error", "param": None,
                                          "code": "model_unavailable"}}


def test_a_budget_past_the_models_context_on_the_command_line_is_refused_at_every_door(browser, tmp_path):
    log = tmp_path / "server.log"
    with running_app("--budget-mb", "1000000", log_path=log) as url:
        assert_unavailable(url.rstrip("/"), TOO_MANY_MEGABYTES, "SmolLM2-135M-Instruct.Q4_1")
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(url)
        expect(page.locator("#model-status")).to_have_text(f"The model cannot be used: {TOO_MANY_MEGABYTES}")
        page.fill("#chat-input textarea", "Hello there.")
        page.click("#chat-send")
        expect(page.locator("[data-testid=toast-body]", has_text=TOO_MANY_MEGABYTES)).to_have_count(1)
        shown = toasts(page)
        assert len(shown) == 1 and shown[0].startswith("Warning")  # a refusal, not a server error
        page.context.close()
    printed = log.read_text()
    assert f"h2o-chat: {TOO_MANY_MEGABYTES}\n" in printed and "Traceback" not in printed


def test_slots_past_the_models_context_in_the_config_are_refused_by_the_api(smollm):
    with serving(smollm, load_config(None, {"cache": {"heavy": 100_000}})) as url:
        assert_unavailable(url, TOO_MANY_SLOTS, MODEL_ID)
