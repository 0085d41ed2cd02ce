"""Clients that leave at every stage of their turn, over the real server: they close the
connection right after sending (5 ms, 20 ms), while their request waits for a generation
slot, and the server's own metrics say what stopped, at which stage and how much of the
prompt it had read. (How fast it stops is the benchmark's business: tools/measure_cancel.py.)"""

from __future__ import annotations

import time

import httpx
import pytest

from h2o_chat.bench.client import at_rest, send_chat, wait_for_metrics

from .api_support import api_config, serving

# About 3,300 prompt tokens: read whole, the prompt would take seconds on a small CPU.
PROMPT = " ".join(f"Line {i}: the keeper of the lighthouse counted {i * 7} ships tonight." for i in range(300))
PIECES = 4 * 256  # what the server may read after the client left: the chunk under way, and more


@pytest.fixture(scope="module")
def url(smollm):
    # One generation at a time, so a second request waits for the slot.
    with serving(smollm, api_config(max_concurrent_generations=1, api_max_queued=4)) as url:
        yield url


def cancelled(stage: str) -> str:
    return f'h2o_chat_cancelled_turns_total{{stage="{stage}"}}'


def answered(status: int) -> str:
    return f'h2o_chat_requests_total{{endpoint="/v1/chat/completions",status="{status}"}}'


def long_request(stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}], "stream": stream, "max_tokens": 64,
            "temperature": 0}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("after_s", [0.005, 0.02])
def test_a_client_gone_right_after_its_request_stops_the_prefill(url, stream, after_s):
    before = wait_for_metrics(url, at_rest)
    connection = send_chat(url, long_request(stream))
    time.sleep(after_s)
    connection.close()
    stages = ("queued", "prefill", "decode")
    seen = wait_for_metrics(url, lambda m: at_rest(m) and sum(m[cancelled(s)] for s in stages)
                 > sum(before[cancelled(s)] for s in stages))
    assert seen[cancelled("prefill")] - before[cancelled("prefill")] == 1
    assert seen["h2o_chat_generated_tokens_total"] == before["h2o_chat_generated_tokens_total"]
    assert seen["h2o_chat_prefill_tokens_total"] - before["h2o_chat_prefill_tokens_total"] < PIECES
    assert seen["h2o_chat_api_conversations"] == before["h2o_chat_api_conversations"]


def test_a_client_gone_while_queued_never_starts(url):
    before = wait_for_metrics(url, at_rest)
    first = send_chat(url, {"messages": [{"role": "user", "content": "Count to five hundred."}],
                           "stream": True, "max_tokens": 500, "temperature": 0, "ignore_eos": True})
    wait_for_metrics(url, lambda m: m["h2o_chat_active_generations"] == m["h2o_chat_scheduler_turns"] == 1)
    waiting = send_chat(url, long_request(True))
    wait_for_metrics(url, lambda m: m["h2o_chat_queued_requests"] == 1)
    waiting.close()
    seen = wait_for_metrics(url, lambda m: m["h2o_chat_queued_requests"] == 0)
    assert seen[cancelled("queued")] - before[cancelled("queued")] == 1
    assert seen["h2o_chat_active_generations"] == 1  # the first goes on
    first.close()
    # Both answered 499 (the first's 200 went out before it left, but nobody read its reply).
    seen = wait_for_metrics(url, lambda m: at_rest(m) and m.get(answered(499), 0) - before.get(answered(499), 0) >= 2)
    assert seen[answered(499)] - before.get(answered(499), 0) == 2
    assert seen.get(answered(200), 0) == before.get(answered(200), 0)
    assert seen[cancelled("decode")] - before[cancelled("decode")] == 1
    assert seen[cancelled("prefill")] == before[cancelled("prefill")]
    # Only the first request's short prompt was read, never the waiting one's.
    assert seen["h2o_chat_prefill_tokens_total"] - before["h2o_chat_prefill_tokens_total"] < 100
    assert seen["h2o_chat_generated_tokens_total"] - before["h2o_chat_generated_tokens_total"] < 500


def test_a_client_that_stays_gets_the_whole_reply_after_others_left(url):
    """The server stays whole: a request after the abandoned ones is answered in full,
    and its prompt is read in full."""
    before = wait_for_metrics(url, at_rest)
    reply = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    seen = wait_for_metrics(url, at_rest)
    assert seen["h2o_chat_prefill_tokens_total"] - before["h2o_chat_prefill_tokens_total"] == \
        reply.json()["usage"]["prompt_tokens"]
