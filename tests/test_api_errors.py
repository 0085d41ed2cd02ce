"""Every refusal of the API, through the ``openai`` package and raw ``httpx``: OpenAI's
error shape, the right status, and a message naming the field and what it may be."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from h2o_chat.bench.client import read_metrics

from .api_support import MODEL_ID, api_config, client, serving
from .helpers import fail_next_forward

KEY = "test-key-123"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def url(smollm):
    # One generation at a time and no queue, so a second request meets a full queue.
    config = api_config(api_key=KEY, max_message_chars=200, max_system_prompt_chars=100,
                        max_conversation_messages=5, api_max_request_mb=1,
                        max_concurrent_generations=1, api_max_queued=0)
    with serving(smollm, config) as url:
        yield url


def refusal(url, status, **request):
    """The error body of a request the openai client sends, checking the status."""
    with pytest.raises(openai.APIStatusError) as caught:
        client(url, KEY).chat.completions.create(**{"model": MODEL_ID, "messages": USER, "max_tokens": 2,
                                                    **request})
    assert caught.value.status_code == status
    return caught.value.body


@pytest.mark.parametrize("request_fields, param, message", [
    ({"temperature": 11}, "temperature", "temperature = 11: must be a number from 0 to 10 (0 = greedy decoding)"),
    ({"top_p": 0}, "top_p", "top_p = 0: must be a number > 0 and <= 1"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens = 0: must be an integer from 1 to 32768"),
    ({"max_completion_tokens": 40000}, "max_completion_tokens",
     "max_completion_tokens = 40000: must be an integer from 1 to 32768"),
    ({"temperature": "hot"}, "temperature",
     "temperature = 'hot': expected float, got str; must be a number from 0 to 10 (0 = greedy decoding)"),
    ({"max_tokens": "5"}, "max_tokens", "max_tokens = '5': expected int, got str; must be an integer from 1 to 32768"),
    # Too long to be read as a number at all, yet refused as the integer it is.
    ({"max_tokens": 10**22}, "max_tokens", "max_tokens = <a 23-digit number>: must be an integer from 1 to 32768"),
    ({"temperature": -10**22}, "temperature",
     "temperature = <a 23-digit number>: must be a number from 0 to 10 (0 = greedy decoding)"),
    ({"seed": -1}, "seed", "seed = -1: must be an integer from 0 to 9223372036854775807, or null"),
    ({"seed": 2**63}, "seed", "seed = 9223372036854775808: must be an integer from 0 to 9223372036854775807, "
                              "or null"),
    ({"seed": 10**20}, "seed", "seed = <a 21-digit number>: must be an integer from 0 to 9223372036854775807, "
                               "or null"),
    ({"n": 2}, "n", "n = 2: must be 1 (one choice per request)"),
    ({"stop": ["a"] * 17}, "stop", "stop must be a string or an array of at most 16 strings"),
    ({"stop": [""]}, "stop", "stop[0] = '': must be a string of 1 to 256 characters"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options is only allowed when stream is true"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens", "min_tokens = 5: must be an integer from 0 to max_tokens (2)"),
    # Both names checked, whichever wins (QA: a bad max_tokens went unheard beside the other).
    ({"max_completion_tokens": 3, "max_tokens": "bad"}, "max_tokens",
     "max_tokens = 'bad': expected int, got str; must be an integer from 1 to 32768"),
    ({"max_completion_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens",
     "min_tokens = 5: must be an integer from 0 to max_completion_tokens (4)"),
    # Not an object, whatever it is: falsy values too.
    ({"stream_options": 0}, "stream_options", "stream_options must be an object, got a number"),
    ({"stream_options": False}, "stream_options", "stream_options must be an object, got a boolean"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "messages[0].content[0].text must be a string, got a number"),
    ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos", "ignore_eos = 'yes': must be true or false"),
    ({"messages": []}, "messages", "messages must be a non-empty array of messages"),
    ({"messages": USER * 5}, "messages",
     "messages (with the reply) holds 6 messages; the limit is 5 (server.max_conversation_messages)"),
    ({"messages": [{"role": "system", "content": "s" * 101}, *USER]}, "messages[0].content",
     "messages[0].content is 101 characters long; the limit is 100 (server.max_system_prompt_chars)"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
     "messages[0].role = 'tool': must be one of system, developer, user, assistant"),
    ({"messages": USER + [{"role": "assistant", "content": "Hello"}]}, "messages[1].role",
     "messages[1].role = 'assistant': the last message must be the user's"),
    ({"messages": USER + [{"role": "system", "content": "x"}, *USER]}, "messages[1].role",
     "messages[1].role = 'system': a system (or developer) message may only come first"),
    # Named as sent (QA: a misplaced developer message was refused as 'system').
    ({"messages": USER + [{"role": "developer", "content": "x"}, *USER]}, "messages[1].role",
     "messages[1].role = 'developer': a system (or developer) message may only come first"),
    ({"messages": [{"role": "user", "content": " \n"}]}, "messages[0].content",
     "messages[0].content is empty: the user message needs some text"),
    # Zero-width spaces, direction marks and a byte-order mark show nothing either.
    ({"messages": [{"role": "user", "content": "\u200b \u200f\u200e\ufeff\u2060"}]}, "messages[0].content",
     "messages[0].content is empty: the user message needs some text"),
    ({"messages": [{"role": "user", "content": "x" * 201}]}, "messages[0].content",
     "messages[0].content is 201 characters long; the limit is 200 (server.max_message_chars)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]",
     'messages[0].content[0].type = \'image_url\': only text parts ({"type": "text", "text": ...}) are supported'),
    ({"messages": [{"role": "user", "content": "x", "pin": 1}]}, "messages[0].pin",
     "messages[0].pin = 1: must be true or false"),
    ({"messages": [*USER, {"role": "assistant", "content": " \n", "pin": True}, *USER]}, "messages[1].pin",
     "messages[1].pin: nothing to pin: the text is empty"),
    ({"messages": [*USER, {"role": "assistant", "content": "\u200d\u200c", "pin": True}, *USER]}, "messages[1].pin",
     "messages[1].pin: nothing to pin: the text is empty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tools is not supported by this server (plain chat only)"),
    # Not false: a number where a boolean or an object goes asks for something.
    ({"logprobs": 0}, "logprobs", "logprobs is not supported by this server (plain chat only)"),
    # OpenAI's format is an object (QA: a bare "text" was taken).
    ({"response_format": "text"}, "response_format",
     'response_format must be an object such as {"type": "text"}, got a string'),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format.type = 'json_object': only 'text' is supported"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice is not supported by this server (plain chat only)"),
    # Ignored, a penalty would change the reply without a word.
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty = 0.5: only 0 is supported by this "
                                                    "server (no penalties)"),
    ({"frequency_penalty": "abc"}, "frequency_penalty", "frequency_penalty = 'abc': must be a number from -2 to 2"),
    ({"frequency_penalty": 3}, "frequency_penalty", "frequency_penalty = 3: must be a number from -2 to 2"),
    ({"presence_penalty": True}, "presence_penalty", "presence_penalty = true: must be a number from -2 to 2"),
    ({"extra_body": {"logit_bias": 0}}, "logit_bias", "logit_bias is not supported by this server (plain chat only)"),
])
def test_bad_fields_get_400_naming_the_field_and_the_allowed_range(url, request_fields, param, message):
    body = refusal(url, 400, **request_fields)
    assert body == {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}


def test_a_streamed_request_is_refused_before_its_stream_begins(url):
    """A refusal the request itself earns is a 400, not a 200 stream carrying an error."""
    for messages in ([*USER, {"role": "assistant", "content": "  ", "pin": True}, *USER],
                     [{"role": "user", "content": " "}]):
        response = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "stream": True},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_value"


def test_malformed_bodies_get_400_and_the_server_stays_up(url):
    headers = {"Authorization": f"Bearer {KEY}"}
    for content, expected in [(b"{", "the request body: invalid JSON"),
                              (b"[" * 3000 + b"]" * 3000, "the request body is nested deeper than"),
                              # at most what 5 messages need (server.max_conversation_messages)
                              (b"[" + b"0," * 4999 + b"0]", "the request body holds 5,000 JSON values "
                                                            "besides strings; the limit is 4,176"),
                              (b"[1, 2]", "the request body must be a JSON object, got an array"),
                              # Read as its first value by other readers (QA: taken as the last).
                              (b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, '
                               b'"max_tokens": 9000}',
                               "the request body: the key 'max_tokens' is given twice in one object: keep one"),
                              (b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                               "messages[0].content contains an unpaired surrogate (U+D800) at character 0"),
                              (b'{"messages": [{"role": "user", "content": "Hi"}], "stop": ["ok", "\\ud800"]}',
                               "stop[1] contains an unpaired surrogate (U+D800) at character 0")]:
        response = httpx.post(url + "/v1/chat/completions", content=content, headers=headers, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["message"].startswith(expected)
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_failed_reply_gets_500_and_the_server_logs_why(url, smollm, caplog):
    """The client is told the reply failed; the operator finds the traceback in the log."""
    fail_next_forward(smollm[0].model.layers[0])
    with caplog.at_level(logging.ERROR, logger="h2o_chat.api.turns"):
        body = refusal(url, 500)
    assert body == {"message": "the reply failed: RuntimeError: injected failure", "type": "server_error",
                    "param": None, "code": "generation_failed"}
    logged = [record for record in caplog.records if record.name == "h2o_chat.api.turns"]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert logged[0].exc_info[1].args == ("injected failure",)
    assert client(url, KEY).chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=2).choices


def test_a_bad_session_id_gets_400(url):
    body = refusal(url, 400, extra_headers={"X-Session-Id": "a b"})
    assert body["param"] == "X-Session-Id" and "1 to 128 characters" in body["message"]


def test_a_missing_or_wrong_key_gets_401(url):
    message = "missing or wrong API key: send the header 'Authorization: Bearer <key>' with a key of server.api_key"
    with pytest.raises(openai.AuthenticationError) as caught:
        client(url, "wrong").chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=2)
    assert caught.value.status_code == 401 and caught.value.body["message"] == message
    missing = httpx.post(url + "/v1/chat/completions", json={"messages": USER})
    assert missing.status_code == 401 and missing.json()["error"]["message"] == message
    assert missing.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # no key needed to ask if it is up
    assert [m.id for m in client(url, KEY).models.list().data] == [MODEL_ID]


def test_an_unknown_model_or_endpoint_gets_404(url):
    with pytest.raises(openai.NotFoundError) as caught:
        client(url, KEY).models.retrieve("gpt-4")
    assert caught.value.body["message"] == f"the model 'gpt-4' does not exist; this server has {MODEL_ID!r}"
    headers = {"Authorization": f"Bearer {KEY}"}
    # Methods no route names too (QA: TRACE and PROPFIND went past the key to the page's 404).
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1"), ("OPTIONS", "/v1/chat/completions"),
                         ("HEAD", "/v1/nothing"), ("TRACE", "/v1/models"), ("PROPFIND", "/v1")):
        response = httpx.request(method, url + path, headers=headers)
        assert response.status_code == 404, (method, path)
        if method != "HEAD":  # a HEAD reply has no body
            assert response.json()["error"] == {"message": f"no such endpoint: {method} {path}",
                                                "type": "not_found_error", "param": None, "code": "unknown_url"}
        # Without the key, nothing is told of what exists under /v1.
        assert httpx.request(method, url + path).status_code == 401, (method, path)



def test_health_and_metrics_refuse_other_methods_with_405_in_the_api_shape(url):
    """QA: Starlette's bare 405, a text body without the API's error shape."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, key in (("POST", "/health", {}), ("DELETE", "/metrics", headers), ("TRACE", "/health", {})):
        response = httpx.request(method, url + path, headers=key)
        assert (response.status_code, response.headers["allow"]) == (405, "GET, HEAD")
        assert response.json()["error"] == {"message": f"{method} {path}: this endpoint answers GET and HEAD",
                                            "type": "invalid_request_error", "param": None,
                                            "code": "method_not_allowed"}
    assert httpx.post(url + "/metrics").status_code == 401  # what /metrics takes is not told without the key


def test_health_metrics_and_models_answer_head(url):
    assert httpx.head(url + "/health").status_code == 200
    headers = {"Authorization": f"Bearer {KEY}"}
    for path in ("/metrics", "/v1/models", f"/v1/models/{MODEL_ID}"):
        assert httpx.head(url + path, headers=headers).status_code == 200
        assert httpx.head(url + path).status_code == 401


def test_a_body_over_the_limit_gets_413(url):
    headers = {"Authorization": f"Bearer {KEY}"}
    big = b'{"messages": "' + b"x" * 2**20 + b'"}'
    for content in (big, iter([big[: 2**19], big[2**19 :]])):  # declared length, then chunked
        response = httpx.post(url + "/v1/chat/completions", content=content, headers=headers, timeout=60)
        assert response.status_code == 413
        assert response.json()["error"] == {
            "message": "request body over the API's limit of 1 MB (server.api_max_request_mb)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def generating(response: httpx.Response) -> Iterator[str]:
    """Read the stream until the reply's first text, so its turn runs; the rest of the
    lines. Keep them: dropping the iterator closes the connection, i.e. leaves."""
    lines = response.iter_lines()
    for line in lines:
        assert '"error"' not in line, line
        if '"content": "' in line and '"role"' not in line:
            return lines
    raise AssertionError("the reply ended before any text")


LONG = {"messages": USER, "stream": True, "max_tokens": 300, "temperature": 0, "ignore_eos": True}


def test_a_full_queue_gets_429(url):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=LONG, headers=headers, timeout=300) as running:
        rest = generating(running)  # it holds the one generation slot
        body = refusal(url, 429)
        rest.close()
        assert body == {"message": "the server is busy: every generation slot is taken and the queue "
                                   "for one is full (server.api_max_queued = 0); retry later",
                        "type": "rate_limit_error", "param": None, "code": "queue_full"}
    # Leaving stopped it: the slot comes back after the token in flight.
    deadline = time.monotonic() + 30
    while "h2o_chat_active_generations 1.0" in httpx.get(url + "/metrics", headers=headers).text:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert client(url, KEY).chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=2).choices


def test_a_login_without_an_api_key_keeps_the_api_closed(smollm):
    with serving(smollm, api_config(username="ann", password="s3cret")) as url:
        with pytest.raises(openai.AuthenticationError) as caught:
            client(url).models.list()
        assert caught.value.body["message"] == ("the API is off: this server has a login (server.username) "
                                                "but no API key; set server.api_key or H2O_CHAT_API_KEY")


def test_a_session_generating_a_reply_gets_409(smollm):
    with serving(smollm, api_config()) as url:
        headers = {"X-Session-Id": "busy"}
        with httpx.stream("POST", url + "/v1/chat/completions", json=LONG, headers=headers, timeout=300) as running:
            rest = generating(running)
            response = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, headers=headers)
            rest.close()
        assert response.status_code == 409 and response.json()["error"] == {
            "message": "conversation 'busy' is generating a reply: wait for it to end, or use another "
                       "X-Session-Id", "type": "conflict_error", "param": "X-Session-Id", "code": "session_busy"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_conversation_past_the_models_context_gets_400_naming_rolling(smollm, monkeypatch, stream):
    """With absolute positions (the default) a request that would take its conversation
    past the model's context is refused before any event, naming the setting that lets
    it go on; the conversation is not kept."""
    monkeypatch.setattr(smollm[0].config, "max_position_embeddings", 200)
    with serving(smollm, api_config()) as url:
        long = [{"role": "user", "content": "The tide rose over the old harbour wall. " * 30}]
        with pytest.raises(openai.BadRequestError) as caught:
            client(url).chat.completions.create(model=MODEL_ID, messages=long, max_tokens=4, stream=stream)
        error = caught.value.body
        assert error["param"] == "messages" and error["code"] == "invalid_value"
        assert error["message"].startswith("the conversation would reach ")
        assert error["message"].endswith(", past the model's context of 200 (max_position_embeddings), where its "
                                         "replies fall apart: start a new conversation, or turn on rolling "
                                         "positions (cache.rolling), with which one goes on past it")
        assert read_metrics(url)["h2o_chat_api_conversations"] == 0


def test_a_model_without_a_chat_template_is_the_servers_fault(smollm):
    """Refused as the model's failing (503, before a stream starts), not as a 400 blaming
    the messages with a hint for Python callers."""
    model, tokenizer = smollm
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    with serving((model, plain), api_config()) as url:
        for stream in (False, True):
            response = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "stream": stream},
                                  timeout=60)
            assert response.status_code == 503
            assert response.json()["error"] == {
                "message": f"the model {MODEL_ID} has no chat template, which chat completions need: serve "
                           "a chat (instruct) model, or write stories on the page",
                "type": "unavailable_error", "param": None, "code": "model_unavailable"}
