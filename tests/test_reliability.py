"""Bad input, stops at any point and failures mid-reply: a clear message, and the session
stays usable with its cache and history in step."""

import gc
import random
import threading

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from h2o_chat import ChatSession, StorySession, make_cache
from h2o_chat.config import ConfigError, load_config
from h2o_chat.inputs import InputLimits
from h2o_chat.ui.app import launch_options, server_line
from h2o_chat.api.page_guards import RequestSizeLimit
from h2o_chat.ui.streaming import stream_turn
from h2o_chat.ui.view_state import ViewState, server_load

from .helpers import GREEDY, assert_consistent, h2o


def assert_tokens_are_the_history(session: ChatSession) -> None:
    """The tokens (hence the cache, which saw ``tokens[:fed]``) spell exactly the
    conversation the history holds: the template of its messages, up to the end-of-turn
    text of a reply that was cut short."""
    assert_consistent(session)
    text = session.tokenizer.decode(session.tokens)
    rendered = session.tokenizer.apply_chat_template(session.messages, tokenize=False)
    assert rendered.startswith(text)
    assert rendered[len(text):] in ("", "\n", "<|im_end|>\n")


def test_refused_inputs_change_nothing_and_the_next_reply_is_the_same(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model), limits=InputLimits(message_chars=1000))
    control = ChatSession(model, tokenizer, cache=h2o(model), limits=InputLimits(message_chars=1000))
    for chat in (session, control):
        "".join(chat.send("Hi! What is your name?", **GREEDY))
    before = (list(session.tokens), [dict(m) for m in session.messages], session.fed)
    refusals = [
        ("x" * 200_000, {}, r"200,000 characters long; the limit is 1,000 \(server.max_message_chars\)"),
        ("caf\udce9", {}, r"unpaired surrogate \(U\+DCE9\) at character 3"),
        (42, {}, "must be a string"),
        ("", {}, "empty"),
        (" \t\n", {}, "empty"),
        ("hello", dict(temperature=-1), "generation.temperature"),
        ("hello", dict(top_p=0), "generation.top_p"),
        ("hello", dict(top_p=1.01), "generation.top_p"),
        ("hello", dict(max_new_tokens=0), "generation.max_new_tokens"),
        ("hello", dict(max_new_tokens=10**9), "generation.max_new_tokens"),
    ]
    for text, sampling, message in refusals:
        with pytest.raises(ValueError, match=message):
            session.send(text, **sampling)
        assert (session.tokens, session.messages, session.fed) == before
    replies = ["".join(chat.send("What can you do?", **GREEDY)) for chat in (session, control)]
    assert replies[0].strip() and replies[0] == replies[1]
    assert_tokens_are_the_history(session)


def test_a_message_at_the_limit_is_prefilled_in_chunks_within_budget(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model, 32, 32), prefill_chunk_size=128,
                          limits=InputLimits(message_chars=6000))
    text = ("The quick brown fox jumps over the lazy dog. " * 200)[:6000]
    "".join(session.send(text, temperature=0, max_new_tokens=4))
    stats = session.stats().cache
    assert stats.seen > 1000 and all(layer.held <= stats.budget for layer in stats.layers)
    assert_tokens_are_the_history(session)


def test_control_characters_and_mixed_scripts_are_plain_text(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model))
    text = "Bell\x07 null\x00 escape\x1b[31m Привет 你好 مرحبا 🙂 e\u0301 \u202eevil\u202c done"
    assert "".join(session.send(text, **GREEDY)).strip()
    assert session.messages[1]["content"] == text
    assert_tokens_are_the_history(session)
    assert "".join(session.send("Thanks.", **GREEDY)).strip()
    assert_tokens_are_the_history(session)


def test_story_texts_are_checked_the_same_way(smollm):
    model, tokenizer = smollm
    with pytest.raises(ValueError, match="story bible is 20 characters long; the limit is 10"):
        StorySession(model, tokenizer, bible="b" * 20, limits=InputLimits(system_prompt_chars=10))
    story = StorySession(model, tokenizer, cache=h2o(model), limits=InputLimits(message_chars=10))
    with pytest.raises(ValueError, match="new story text is 11 characters"):
        story.send("s" * 11)
    with pytest.raises(ValueError, match="surrogate"):
        story.send("a\ud800")
    assert story.tokens == [] and story.fed == 0


def test_a_budget_beyond_the_models_context_is_refused(tiny_model):
    with pytest.raises(ConfigError, match=r"^cache.heavy \+ cache.recent \+ cache.sink = 4000 \+ 100 \+ 4 = "
                                          r"4104 slots: must be at most the model's context of 4,096 tokens "
                                          r"\(max_position_embeddings\)$") as err:
        make_cache(tiny_model, "h2o", heavy=4000, recent=100, sink=4)
    assert err.value.field == "cache.heavy"
    make_cache(tiny_model, "h2o", heavy=4000, recent=92, sink=4)  # exactly the context is fine


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_stop_at_a_random_point_keeps_history_and_cache_in_step(smollm, seed):
    """Stops land anywhere: before the first token, mid-reply, or (seed 3) from a timer
    in another thread at a random moment."""
    model, tokenizer = smollm
    rng = random.Random(seed)
    session = ChatSession(model, tokenizer, cache=h2o(model, 24, 24))
    "".join(session.send("Tell me about the sea.", temperature=0, max_new_tokens=rng.randrange(5, 40)))
    stream = session.send("Now count from one to one hundred in words.", temperature=0, max_new_tokens=300)
    received = []
    if seed == 3:
        timer = threading.Timer(rng.uniform(0.05, 2.0), session.stop)
        timer.start()
        received = list(stream)
        # The reply may end by itself first (a slow machine): then the stop must not
        # land in the next turn.
        timer.cancel()
        timer.join()
    else:
        stop_after = [0, rng.randrange(1, 10), rng.randrange(10, 60)][seed]
        if stop_after == 0:
            session.stop()  # pressed before the reply started: the stop flag is reset per turn
        for chunk in stream:
            received.append(chunk)
            if len(received) == stop_after:
                session.stop()
    assert len(session.reply) < 300
    assert session.messages[-1] == {"role": "assistant", "content": "".join(received)}
    assert_tokens_are_the_history(session)
    assert "".join(session.send("Thanks!", **GREEDY)).strip()
    assert_tokens_are_the_history(session)


# ---- the page's side ---------------------------------------------------------------------


def test_a_failure_mid_reply_is_shown_and_the_chat_goes_on(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=h2o(model))
    # A decoder layer of the model, whatever path its pass takes (a prompt's or the decode
    # step's, whose rows take their tokens without their cache layers' update).
    layer, calls = model.model.layers[5], []
    forward = layer.forward

    def fails_feeding_the_fourth_token(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # the prefill, then tokens 1-3 fed, then token 4's pass fails
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    layer.forward = fails_feeding_the_fourth_token
    updates = stream_turn(session.send("Describe a forest.", temperature=0, max_new_tokens=30),
                          show=lambda text: {"shown": text}, views=lambda final: {"final": final},
                          final=lambda: {"history": [dict(m) for m in session.messages]},
                          closed=lambda: False)
    seen = []
    while True:
        try:
            seen.append(next(updates))
        except StopIteration as end:
            failure = end.value  # for the view to name it
            break
    del layer.forward  # back to the class's
    assert isinstance(failure, RuntimeError) and str(failure) == "injected failure"
    # The last update shows the history as the session now holds it.
    assert seen[-1]["final"] is True and seen[-1]["history"] == session.messages
    assert len(session.reply) == 4 and session.messages[-1]["content"]
    assert all(layer.seen == session.fed for layer in session.cache.layers)
    assert_tokens_are_the_history(session)
    assert "".join(session.send("And a desert?", **GREEDY)).strip()
    assert_tokens_are_the_history(session)


class _View(ViewState):
    def sessions(self):
        return []


def test_server_line_counts_open_views_until_closed_or_dropped(smollm):
    gc.collect()
    open_before, _ = server_load()
    views = [_View(loaded=None) for _ in range(3)]
    assert server_load() == (open_before + 3, 0)
    views[0].close()
    assert server_load()[0] == open_before + 2
    del views[1]
    gc.collect()  # Gradio dropped it without the callback: not counted, not kept alive
    assert server_load()[0] == open_before + 1
    with views[-1].running():
        assert server_load() == (open_before + 1, 1)
    line = server_line(load_config().server)
    assert f"{open_before + 1} conversation" in line and "at most 4 at once" in line


def _echo_app(upload_limit: int, json_limit: int, catch: bool = False) -> TestClient:
    async def echo(request):
        try:
            return PlainTextResponse(str(len(await request.body())))
        except Exception:
            if not catch:
                raise
            # What Gradio's routes do with a body they could not read.
            return PlainTextResponse("bad request", status_code=400)

    app = Starlette(routes=[Route("/", echo, methods=["POST"])],
                    middleware=[Middleware(RequestSizeLimit, max_upload_bytes=upload_limit,
                                           max_json_bytes=json_limit)])
    return TestClient(app)


@pytest.mark.parametrize("catch", [False, True])
def test_request_bodies_over_the_limit_are_refused_with_413(catch):
    client = _echo_app(2000, 1000, catch)
    assert client.post("/", content=b"x" * 1000).text == "1000"
    declared = client.post("/", content=b"x" * 1001)
    assert declared.status_code == 413
    assert declared.json() == {"detail": "request body over the server's limit of 0 MB (server.api_max_request_mb)"}
    streamed = client.post("/", content=iter([b"x" * 600, b"x" * 600]))  # chunked: no length
    assert streamed.status_code == 413 and "server.api_max_request_mb" in streamed.text
    upload = {"content-type": "multipart/form-data; boundary=b"}
    assert client.post("/", content=b"x" * 1500, headers=upload).text == "1500"
    big_upload = client.post("/", content=iter([b"x" * 1500, b"x" * 600]), headers=upload)
    assert big_upload.status_code == 413 and "server.max_request_mb" in big_upload.text


def test_login_comes_from_the_environment_and_needs_both_fields(monkeypatch):
    assert launch_options(load_config().server)["auth"] is None
    monkeypatch.setenv("H2O_CHAT_USERNAME", "ann")
    with pytest.raises(ConfigError, match="server.username is set but server.password is not") as err:
        load_config()
    assert err.value.field == "server.password"
    monkeypatch.setenv("H2O_CHAT_PASSWORD", "s3cret")
    options = launch_options(load_config().server)
    assert options["auth"] == ("ann", "s3cret") and options["server_name"] == "127.0.0.1"
    assert options["max_file_size"] == 256 * 2**20
