"""The OpenAI-compatible API through real clients: the ``openai`` package and raw
server-sent events read with ``httpx``, against the API served on a free port."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from h2o_chat import ChatSession
from h2o_chat.bench.client import read_metrics
from h2o_chat.api.stops import StopMatcher
from h2o_chat.config import load_config
from h2o_chat.engine.budget import token_bytes
from h2o_chat.engine.build import cache_from_config
from h2o_chat.engine.quant import KVStorage
from h2o_chat.scheduler import scheduler_for

from .api_support import MODEL_ID, api_config, client, reference_session, serving

GREEDY = dict(temperature=0, max_tokens=16)
SAME_AS_GREEDY = dict(temperature=0, max_new_tokens=16)  # GREEDY in the Python API's words
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def config():
    return api_config()


@pytest.fixture(scope="module")
def url(smollm, config):
    with serving(smollm, config) as url:
        yield url


def ask(url, messages, **options):
    raw = client(url).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=messages, **{**GREEDY, **options})
    return raw.parse(), raw.headers


def test_greedy_reply_equals_the_same_turn_through_chat_session(smollm, config, url):
    completion, headers = ask(url, [{"role": "user", "content": QUESTION}])
    expected = "".join(reference_session(smollm, config).send(QUESTION, temperature=0, max_new_tokens=16))
    choice = completion.choices[0]
    assert choice.message.content == expected and choice.message.role == "assistant"
    assert completion.model == MODEL_ID and completion.object == "chat.completion"
    usage = completion.usage
    assert usage.completion_tokens <= 16 and usage.prompt_tokens > 20  # the system prompt comes first
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # a new conversation
    assert choice.finish_reason == ("length" if usage.completion_tokens == 16 else "stop")
    h2o = completion.model_extra["h2o"]
    assert h2o["session_id"] == headers["x-session-id"]
    assert h2o["budget"] == 4 + 24 + 24 + h2o["pinned"] and h2o["pinned"] > 0  # the system prompt
    assert h2o["tokens_seen"] == usage.total_tokens - 1  # the last token waits for the next turn


def test_fields_that_ask_for_nothing_are_taken(url):
    """What clients send by default: no tools, no penalties. Refused, they broke clients."""
    plain, _ = ask(url, [{"role": "user", "content": QUESTION}])
    asked, _ = ask(url, [{"role": "user", "content": QUESTION}], tools=[], tool_choice="none",
                   presence_penalty=0, frequency_penalty=0.0, logprobs=False,
                   extra_body={"function_call": "none"})
    assert asked.choices[0].message.content == plain.choices[0].message.content


def test_streamed_reply_equals_the_whole_one_and_ends_with_usage(url):
    whole, _ = ask(url, [{"role": "user", "content": "Name three colours."}])
    chunks = list(client(url).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name three colours."}], stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].model_extra["h2o"]["tokens_seen"] == whole.model_extra["h2o"]["tokens_seen"]


def test_a_second_turn_feeds_only_its_new_tokens_and_matches_chat_session(smollm, config, url):
    messages = [{"role": "user", "content": "Tell me about cats."}]
    first, headers = ask(url, messages, max_tokens=40)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And dogs?"}]
    second, second_headers = ask(url, messages, max_tokens=40)
    # Everything the first turn's cache saw is reused; only the new message is fed.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.total_tokens - 1 == first.model_extra["h2o"]["tokens_seen"]
    assert second.usage.prompt_tokens > cached
    assert second_headers["x-session-id"] == headers["x-session-id"]
    session = reference_session(smollm, config)
    expected = ["".join(session.send(text, temperature=0, max_new_tokens=40))
                for text in ("Tell me about cats.", "And dogs?")]
    assert [first.choices[0].message.content, second.choices[0].message.content] == expected
    h2o = second.model_extra["h2o"]
    assert h2o["evicted"] == h2o["tokens_seen"] - h2o["slots_held"] > 0  # past the small budget
    assert h2o["slots_held"] == h2o["budget"]


def test_an_edited_history_starts_a_fresh_conversation(url):
    first, _ = ask(url, [{"role": "user", "content": "Say hello."}])
    edited = [{"role": "user", "content": "Say hello."},
              {"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
              {"role": "user", "content": "Again."}]
    second, _ = ask(url, edited)
    assert second.usage.prompt_tokens_details.cached_tokens == 0


def test_x_session_id_binds_a_client_to_its_conversation(url):
    headers = {"X-Session-Id": "client-a"}
    first, returned = ask(url, [{"role": "user", "content": "Hi!"}], extra_headers=headers)
    assert returned["x-session-id"] == "client-a"
    messages = [{"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "How are you?"}]
    # Another client sending the same history without the header does not get it...
    other, other_headers = ask(url, messages)
    assert other.usage.prompt_tokens_details.cached_tokens == 0 and other_headers["x-session-id"] != "client-a"
    # ...the named client does.
    second, _ = ask(url, messages, extra_headers=headers)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1


def test_each_key_is_a_user_whose_conversations_no_other_key_reaches(smollm):
    """With two keys, one key's conversations, matched by history or named, are neither
    continued nor replaced by the other key's requests, however exactly they repeat them."""
    def turn(key, messages, session_id=None):
        headers = {} if session_id is None else {"X-Session-Id": session_id}
        return client(url, key).chat.completions.create(model=MODEL_ID, messages=messages,
                                                        extra_headers=headers, **GREEDY)

    def cached(completion) -> int:
        return completion.usage.prompt_tokens_details.cached_tokens

    with serving(smollm, api_config(api_key="k-alice, k-bob")) as url:
        for session_id in (None, "shared-name"):
            first = turn("k-alice", [{"role": "user", "content": "Hi!"}], session_id)
            messages = [{"role": "user", "content": "Hi!"},
                        {"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "How are you?"}]
            assert cached(turn("k-bob", messages, session_id)) == 0
            assert cached(turn("k-alice", messages, session_id)) == first.usage.total_tokens - 1


def test_two_concurrent_clients_get_their_own_conversations(smollm, config, url):
    questions = ["Why is the sky blue?", "Write a haiku about the sea."]
    replies = {}
    batched = metric(url, "h2o_chat_batched_decode_rows_total")

    def run(question):
        replies[question] = ask(url, [{"role": "user", "content": question}], max_tokens=24)[0]

    threads = [threading.Thread(target=run, args=(q,)) for q in questions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for question in questions:
        expected = "".join(reference_session(smollm, config).send(question, temperature=0, max_new_tokens=24))
        assert replies[question].choices[0].message.content == expected
    assert replies[questions[0]].model_extra["h2o"]["session_id"] != replies[questions[1]].model_extra["h2o"]["session_id"]
    assert metric(url, "h2o_chat_batched_decode_rows_total") > batched  # they decoded as one batch


@pytest.fixture(params=["as the app wakes", "woken at the first token and the end"])
def reader_wakes(request, smollm):
    """How often the scheduler wakes a turn's reader: a reply then streams to the API
    token by token here, or as one first token and the rest at once (as many rows on a
    GPU stream)."""
    scheduler = scheduler_for(smollm[0])
    kept = scheduler.wake_per_row_s, scheduler.wake_max_s
    if request.param != "as the app wakes":
        scheduler.wake_per_row_s = scheduler.wake_max_s = 3600.0
    try:
        yield request.param
    finally:
        scheduler.wake_per_row_s, scheduler.wake_max_s = kept


def test_stop_strings_cut_the_reply_before_them(smollm, config, url, reader_wakes):
    whole, _ = ask(url, [{"role": "user", "content": QUESTION}])
    text = whole.choices[0].message.content
    word = text.split()[2]
    # The reply's tokens up to the one that completes the stop string: what the usage counts,
    # however far the server sampled past it before the stream closed.
    reference = reference_session(smollm, config)
    "".join(reference.send(QUESTION, **SAME_AS_GREEDY))
    tokens = next(count for count in range(1, len(reference.reply) + 1)
                  if word in reference.decode(reference.reply[:count]))
    messages, stop = [{"role": "user", "content": QUESTION}], [word, "never-there"]
    for _ in range(2):  # how far the server samples ahead varies from run to run
        cut, _ = ask(url, messages, stop=stop)
        assert cut.choices[0].message.content == text[: text.index(word)]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == tokens
        chunks = list(client(url).chat.completions.create(
            model=MODEL_ID, messages=messages, stop=stop, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[: text.index(word)]
        assert chunks[-1].usage.completion_tokens == tokens


def test_ignore_eos_and_min_tokens_make_replies_of_an_exact_length(url):
    short = [{"role": "user", "content": "Answer with one word: yes or no?"}]
    natural, _ = ask(url, short, max_tokens=30)
    assert natural.usage.completion_tokens < 30 and natural.choices[0].finish_reason == "stop"
    forced, _ = ask(url, short, max_tokens=30, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 30 and forced.choices[0].finish_reason == "length"
    at_least, _ = ask(url, short, max_tokens=30, extra_body={"min_tokens": natural.usage.completion_tokens + 3})
    assert at_least.usage.completion_tokens >= natural.usage.completion_tokens + 3


def test_a_pinned_message_stays_out_of_eviction(url):
    plain, _ = ask(url, [{"role": "user", "content": "My name is Ada Lovelace."}], max_tokens=4)
    pinned, _ = ask(url, [{"role": "user", "content": "My name is Ada Lovelace.", "pin": True}], max_tokens=4)
    extra = pinned.model_extra["h2o"]["pinned"] - plain.model_extra["h2o"]["pinned"]
    assert extra > 4  # the message's tokens, besides the system prompt
    history = [{"role": "user", "content": "My name is Ada Lovelace.", "pin": True},
               {"role": "assistant", "content": pinned.choices[0].message.content},
               {"role": "user", "content": "Who am I?"}]
    # Sent again with its pin, the pinned conversation continues; without it, the unpinned
    # one (the same greedy reply) does: pins are part of what a conversation holds.
    continued, _ = ask(url, history, max_tokens=4)
    assert continued.usage.prompt_tokens_details.cached_tokens > 0
    assert continued.model_extra["h2o"]["pinned"] == pinned.model_extra["h2o"]["pinned"]
    assert plain.choices[0].message.content == pinned.choices[0].message.content
    unpinned, _ = ask(url, [dict(history[0], pin=False), *history[1:]], max_tokens=4)
    assert unpinned.usage.prompt_tokens_details.cached_tokens > 0
    assert unpinned.model_extra["h2o"]["pinned"] == plain.model_extra["h2o"]["pinned"]
    # A pinned message of a history read into a fresh conversation is pinned too.
    fresh, _ = ask(url, [dict(history[0], content="My name is Grace Hopper."), *history[1:]], max_tokens=4)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.model_extra["h2o"]["pinned"] > plain.model_extra["h2o"]["pinned"] + 4


def test_each_pinned_message_pins_its_own_tokens_whatever_else_says_the_same(url):
    """Two messages saying the same, both pinned, are two pins (not one refused as pinned
    twice), of the same size: each message's own tokens, not the text's last copy."""
    said = "Remember the code word lantern."
    messages = [{"role": "user", "content": said}, {"role": "assistant", "content": said},
                {"role": "user", "content": "What is it?"}]
    counts = []
    for pins in ((), (0,), (0, 1)):
        reply, _ = ask(url, [dict(m, pin=i in pins) for i, m in enumerate(messages)], max_tokens=2)
        counts.append(reply.model_extra["h2o"]["pinned"])
    none, one, both = counts
    assert one > none + 4 and both - none == 2 * (one - none)


def test_an_empty_system_message_is_an_empty_system_turn_pinned(url, smollm):
    """Sent empty, the system turn is what the client sent: no text of the server's or the
    template's own (SmolLM2's template writes a default system prompt where none is
    given), and its few template tokens are pinned as every system turn is."""
    user = {"role": "user", "content": QUESTION}
    empty, _ = ask(url, [{"role": "system", "content": ""}, user], max_tokens=2)
    one, _ = ask(url, [{"role": "system", "content": "x"}, user], max_tokens=2)
    _, tokenizer = smollm
    x_tokens = len(tokenizer("x", add_special_tokens=False).input_ids)
    assert empty.usage.prompt_tokens == one.usage.prompt_tokens - x_tokens
    assert empty.model_extra["h2o"]["pinned"] == one.model_extra["h2o"]["pinned"] - x_tokens > 0


def test_raw_server_sent_events(url):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": QUESTION}], "stream": True,
            "max_tokens": 8, "temperature": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in events[-1]  # only with stream_options.include_usage


def metric(url, name):
    return read_metrics(url)[name]


def test_a_client_that_leaves_stops_its_reply(url):
    before = metric(url, "h2o_chat_generated_tokens_total")
    body = {"messages": [{"role": "user", "content": "Count to five hundred."}], "stream": True,
            "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if '"content": "' in line and '"role"' not in line:
                break  # the first text arrived: leave
    deadline = time.monotonic() + 30
    while metric(url, "h2o_chat_active_generations"):
        assert time.monotonic() < deadline, "the abandoned reply kept generating"
        time.sleep(0.2)
    assert metric(url, "h2o_chat_generated_tokens_total") - before < 50


def test_models_health_and_metrics(url):
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert client(url).models.retrieve(MODEL_ID).id == MODEL_ID
    assert httpx.get(url + "/health").json() == {"status": "ok", "model": MODEL_ID}
    ask(url, [{"role": "user", "content": "Hi"}], max_tokens=2)
    text = httpx.get(url + "/metrics").text
    for name in ("h2o_chat_generated_tokens_total", "h2o_chat_prefill_tokens_total",
                 "h2o_chat_cached_prompt_tokens_total", "h2o_chat_evicted_tokens_total",
                 "h2o_chat_active_generations", "h2o_chat_queued_requests", "h2o_chat_kv_bytes_allocated",
                 "h2o_chat_kv_bytes_held", "h2o_chat_api_conversations", "h2o_chat_request_seconds_count",
                 "h2o_chat_time_to_first_token_seconds_count", "h2o_chat_forward_steps_total",
                 "h2o_chat_batched_decode_rows_total", "h2o_chat_scheduler_turns"):
        assert f"\n{name} " in text or f"\n{name}{{" in text, name
    assert metric(url, "h2o_chat_kv_bytes_held") > 0


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    stops = StopMatcher(("END", "xyz"))
    assert [stops.feed(chunk) for chunk in ["ab", "cE", "N", "D and more"]] == ["ab", "c", "", ""]
    assert stops.stopped and stops.through == 6
    # The stop string that ends first wins, whatever the chunks: "cd" ends before "abcdef".
    for chunks in (["xabcdefg"], list("xabcdefg"), ["xab", "cdefg"]):
        stops = StopMatcher(("abcdef", "cd"))
        assert "".join(stops.feed(chunk) for chunk in chunks) == "xab" and stops.through == 5
    stops = StopMatcher(("END",))
    assert (stops.feed("aE"), stops.feed("x"), stops.feed("E"), stops.flush()) == ("a", "Ex", "", "E")
    assert not stops.stopped


def test_kept_conversations_are_bounded_and_freed_when_idle(smollm):
    def continued(url, question, first):
        """cached_tokens of the turn after ``first``."""
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "More."}]
        return ask(url, messages, max_tokens=2)[0].usage.prompt_tokens_details.cached_tokens

    with serving(smollm, api_config(api_max_conversations=2)) as url:
        questions = ["One.", "Two.", "Three."]
        firsts = [ask(url, [{"role": "user", "content": q}], max_tokens=3)[0] for q in questions]
        assert continued(url, questions[2], firsts[2]) > 0  # kept
        assert continued(url, questions[0], firsts[0]) == 0  # the least recently used went first
        assert metric(url, "h2o_chat_api_conversations") == 2
    with serving(smollm, api_config(idle_release_minutes=0.001)) as url:
        first = ask(url, [{"role": "user", "content": "One."}], max_tokens=3)[0]
        time.sleep(0.2)
        assert continued(url, "One.", first) == 0  # freed after 0.06 s without a turn


def test_a_byte_budget_at_8_and_4_bits_shows_in_the_ledger_and_replies_as_the_python_api(smollm):
    config = load_config(None, {"cache": {"policy": "h2o", "sink": 4, "key_bits": 8, "value_bits": 4,
                                          "budget_mb": 1.0}})
    question = "Tell me about the lighthouse keeper and the storm. " * 12  # past the budget: evicts
    with serving(smollm, config) as url:
        completion, _ = ask(url, [{"role": "user", "content": question}])
    model, tokenizer = smollm
    reference = ChatSession(model, tokenizer, cache=cache_from_config(model, config.cache),
                            system_prompt=config.generation.system_prompt)
    assert completion.choices[0].message.content == "".join(reference.send(question, **SAME_AS_GREEDY))
    h2o = completion.model_extra["h2o"]
    assert (h2o["key_bits"], h2o["value_bits"], h2o["budget_bytes"]) == (8, 4, 1_000_000)
    slots = 1_000_000 // token_bytes(model, KVStorage(8, 4), rolling=False)
    assert h2o["evicted"] > 0 and h2o["slots_held"] == h2o["budget"] == slots
    assert h2o["held_bytes"] == reference.stats().cache.held_bytes <= 1_000_000


@pytest.mark.parametrize("seed", [10**18, 2**63 - 1])
def test_nineteen_digit_seeds_are_taken_and_reproduce_the_reply(url, seed):
    sampled = dict(temperature=1.0, max_tokens=12, seed=seed)
    first, _ = ask(url, [{"role": "user", "content": "Invent a name for a boat."}], **sampled)
    again, _ = ask(url, [{"role": "user", "content": "Invent a name for a boat."}], **sampled)
    assert first.choices[0].message.content == again.choices[0].message.content != ""


def test_a_turns_server_replies_as_the_python_api_and_marks_turns_from_a_history_as_sent(smollm):
    """The turns policy through the API: a continued conversation replies as ChatSession,
    and one rebuilt on the same history (another client, its history read in prompt
    chunks) marks the same turn starts."""
    config = load_config(None, {"cache": {"policy": "turns", "sink": 4, "budget_mb": 1.0}})
    model, tokenizer = smollm
    reference = ChatSession(model, tokenizer, cache=cache_from_config(model, config.cache),
                            system_prompt=config.generation.system_prompt)
    texts = ["Tell me about the lighthouse keeper and the storm. " * 6, "What did the keeper do next?"]
    expected = ["".join(reference.send(text, **SAME_AS_GREEDY)) for text in texts]
    with serving(smollm, config) as url:
        messages, replies = [], []
        for text in texts:
            messages.append({"role": "user", "content": text})
            completion, _ = ask(url, messages)
            replies.append(completion)
            messages.append({"role": "assistant", "content": completion.choices[0].message.content})
        rebuilt, _ = ask(url, messages[:-1], extra_headers={"X-Session-Id": "another-client"})
    assert [r.choices[0].message.content for r in replies] == expected
    h2o = replies[-1].model_extra["h2o"]
    assert h2o["policy"]["policy"] == "turns" and h2o["evicted"] > 0
    assert h2o["turn_starts"] == reference.cache.turns.starts and len(h2o["turn_starts"]) == 2
    assert rebuilt.model_extra["h2o"]["turn_starts"] == h2o["turn_starts"]
