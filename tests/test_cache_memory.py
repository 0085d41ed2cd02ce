"""One limit on what every conversation's caches hold (``server.max_cache_mb``): a turn
is counted at the most its caches may reach, refused whole when it would pass the
limit, and the API frees idle conversations before refusing one."""

from __future__ import annotations

import gc

import httpx
import pytest
import torch

from h2o_chat.bench.client import read_metrics
from h2o_chat.cache_memory import MB, CacheMemory, CacheMemoryFull
from h2o_chat.config import CacheConfig, load_config
from h2o_chat.engine.build import make_cache
from h2o_chat.engine.step import DecodeStep
from h2o_chat.fidelity import FidelityProbe
from h2o_chat.scheduler import forward_one
from h2o_chat.sessions import chat_session

from .api_support import MODEL_ID, client, serving

LONG = "The river ran past the old mill, and the miller counted sacks of grain. " * 40
FULL = CacheConfig(policy="full")


def chat(smollm, settings: CacheConfig = FULL, memory: CacheMemory | None = None, **options):
    model, tokenizer = smollm
    return chat_session(model, tokenizer, settings, system_prompt="You are a careful assistant.",
                        memory=memory, **options)


@pytest.mark.parametrize("settings", [
    FULL,
    CacheConfig(policy="full", key_bits=8, value_bits=4, exact_window=16),
    CacheConfig(policy="h2o", heavy=64, recent=16),
    CacheConfig(policy="turns", heavy=64, recent=16, key_bits=8, value_bits=4, exact_window=16),
    CacheConfig(policy="recent", recent=48, prefill_chunk_size=64),
], ids=["full", "full K8/V4", "h2o", "turns K8/V4", "recent"])
def test_a_turn_is_counted_at_no_less_than_its_cache_reaches_and_after_it_at_what_it_holds(smollm, settings):
    memory = CacheMemory()
    session = chat(smollm, settings, memory)
    reached = [0]
    # After every pass that ends a piece of the prompt, and every decode step.
    session.observer = lambda *_: reached.__setitem__(0, max(reached[0], session.cache.allocated_bytes()))
    for text, pin in ((LONG, True), ("And the mill?", False), (LONG[:600], False)):
        before = len(session.tokens)
        reached[0] = 0
        stream = session.send(text, pin=pin, temperature=0, max_new_tokens=24, min_new_tokens=24)
        assert next(stream)
        counted = memory.held
        for _ in stream:
            pass
        assert len(session.tokens) > before
        assert max(reached[0], session.cache.allocated_bytes()) <= counted, "the cache passed its count"
        assert memory.held == session.cache.allocated_bytes() > 0


def test_a_turn_past_the_limit_alone_is_refused_and_changes_nothing(smollm):
    probe = chat(smollm)
    list(probe.send("Hello!", temperature=0, max_new_tokens=8))
    # Room for a short turn of a full cache, not for a long message's.
    memory = CacheMemory(probe.cache.peak_bytes(smollm[0], len(probe.tokens) + 64, 256))
    session = chat(smollm, memory=memory)
    with pytest.raises(CacheMemoryFull) as refused:
        session.send(LONG * 3, temperature=0, max_new_tokens=8)
    assert not refused.value.now and refused.value.field == "messages"
    assert str(refused.value).startswith("this turn's caches may take up to ")
    assert str(refused.value).endswith(
        f"past what all conversations' caches may hold (server.max_cache_mb = {memory.limit // MB:,}): start a "
        "new conversation, use a bounded cache (the h2o, turns, recent or sink policy) or a smaller budget, "
        "or raise the limit")
    assert session.messages == [{"role": "system", "content": "You are a careful assistant."}]
    assert session.stats().cache.seen == 0
    # A bounded cache of the same conversation stops at its budget, and fits.
    bounded = chat(smollm, CacheConfig(policy="h2o", heavy=32, recent=16, prefill_chunk_size=32), memory)
    assert list(bounded.send(LONG * 3, temperature=0, max_new_tokens=8))
    assert "".join(session.send("Hello!", temperature=0, max_new_tokens=8)) == probe.messages[-1]["content"]


def test_a_turn_is_refused_while_other_conversations_hold_the_room_and_fits_once_they_go(smollm):
    holder = chat(smollm)
    list(holder.send(LONG, temperature=0, max_new_tokens=8))
    held = holder.cache.allocated_bytes()
    # Room for one such turn, and for half of another conversation at rest beside it.
    memory = CacheMemory(holder.cache.peak_bytes(smollm[0], len(holder.tokens), 256) + held // 2)
    holder = chat(smollm, memory=memory)
    list(holder.send(LONG, temperature=0, max_new_tokens=8))
    assert memory.held == held
    other = chat(smollm, memory=memory)
    with pytest.raises(CacheMemoryFull) as refused:
        other.send(LONG, temperature=0, max_new_tokens=8)
    assert refused.value.now and refused.value.field == "server.max_cache_mb"
    assert str(refused.value).startswith(f"the server's caches hold {held / MB:,.1f} MB of the "
                                         f"{memory.limit // MB:,} MB all conversations' caches may hold "
                                         "(server.max_cache_mb), and this turn's may take up to ")
    assert other.stats().cache.seen == 0 and len(other.messages) == 1
    del holder
    gc.collect()
    assert memory.held == 0
    assert list(other.send(LONG, temperature=0, max_new_tokens=8))


def test_the_fidelity_probe_s_full_shadow_is_counted_with_its_session(smollm):
    bounded = CacheConfig(policy="h2o", heavy=32, recent=16, prefill_chunk_size=32)
    alone = chat(smollm, bounded)
    list(alone.send(LONG, temperature=0, max_new_tokens=8))
    memory = CacheMemory(4 * alone.cache.peak_bytes(smollm[0], len(alone.tokens), 32))
    session = chat(smollm, bounded, memory)
    probe = FidelityProbe(session).attach()
    with pytest.raises(CacheMemoryFull):  # the shadow keeps every token
        session.send(LONG, temperature=0, max_new_tokens=8)
    probe.detach()
    del probe
    gc.collect()
    assert list(session.send(LONG, temperature=0, max_new_tokens=8))
    assert memory.held == session.cache.allocated_bytes()


def _full_cache_server(smollm, max_cache_mb: int):
    return serving(smollm, load_config(None, {"cache": {"policy": "full"},
                                              "server": {"max_cache_mb": max_cache_mb}}))


def _ask(url, messages):
    return client(url).chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=8,
                                               extra_body={"min_tokens": 8})


def _bound_mb(smollm, text: str, reply: int) -> float:
    """What the API's turn on a fresh full-cache conversation is counted at, in MB."""
    model, tokenizer = smollm
    session = chat_session(model, tokenizer, FULL, system_prompt=load_config(None).generation.system_prompt)
    list(session.send(text, temperature=0, max_new_tokens=reply, min_new_tokens=reply))
    return session.cache.peak_bytes(model, len(session.tokens), 256) / MB


def test_the_api_frees_its_least_recently_used_idle_conversation_to_make_room(smollm):
    first = [{"role": "user", "content": LONG[:900]}]
    second = [{"role": "user", "content": LONG[:900].replace("river", "brook")}]
    # One conversation's turn fits, and the next of it, but not one beside another at
    # rest (a full cache holds about half what its turn is counted at).
    bound = _bound_mb(smollm, LONG[:900], 8)
    with _full_cache_server(smollm, int(1.25 * bound)) as url:
        reply = _ask(url, first)
        _ask(url, second)  # fits once the first conversation is let go
        again = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Again."}]
        assert _ask(url, again).usage.prompt_tokens_details.cached_tokens == 0  # built again
        assert 0 < read_metrics(url)["h2o_chat_cache_memory_bytes"] <= int(1.25 * bound) * MB
    with _full_cache_server(smollm, 4096) as url:  # the same, with room: the first is kept
        _ask(url, first)
        _ask(url, second)
        assert _ask(url, again).usage.prompt_tokens_details.cached_tokens > 0


def test_the_api_refuses_a_turn_past_the_limit_alone_with_400_and_one_others_hold_with_503(smollm):
    long_turn = _bound_mb(smollm, LONG, 64)
    with _full_cache_server(smollm, int(long_turn) + 1) as url:
        too_long = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL_ID, "messages": [{"role": "user", "content": LONG * 4}], "max_tokens": 8})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert error["param"] == "messages" and error["message"].startswith("this turn's caches may take up to ")
        # A streamed reply in progress holds its room: no idle conversation to free.
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": LONG}], "max_tokens": 64,
                "min_tokens": 64, "temperature": 0, "stream": True}) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": LONG}], "max_tokens": 64})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
        error = busy.json()["error"]
        assert error["code"] == "cache_memory_full" and error["param"] == "server.max_cache_mb"
        assert error["message"].startswith("the server's caches hold ")


def test_a_decode_step_s_spare_rows_are_counted_beside_its_rows_caches(smollm):
    """A pool has rows and slots no conversation counts (room for rows to join, each row
    as long as the longest): the ledger counts them too, so it holds what the pool holds."""
    model, tokenizer = smollm
    ids = tokenizer(LONG, add_special_tokens=False).input_ids
    caches = []
    with torch.inference_mode():
        for length in (300, 200, 120):  # unlike lengths: rows as long as the longest
            cache = make_cache(model, "h2o", heavy=128, recent=64, sink=4)
            forward_one(model, cache, torch.tensor([ids[:length]]))
            caches.append(cache)
    step, memory = DecodeStep(), CacheMemory()
    memory.add_overhead(lambda: step.spare_bytes)
    step.join(caches, rows=8)  # room for eight rows, three taken
    for cache in caches:
        memory.track(cache)
    (pool,) = step.pools
    pool_bytes = sum(t.numel() * t.element_size() for t in pool.buffers.values())
    assert step.spare_bytes == pool_bytes - sum(cache.allocated_bytes() for cache in caches) > pool_bytes // 2
    assert memory.held == pool_bytes
    # Room for the three caches as counted, not for the pool: a fourth turn is refused.
    tight = CacheMemory(sum(cache.allocated_bytes() for cache in caches) + caches[2].allocated_bytes())
    tight.add_overhead(lambda: step.spare_bytes)
    for cache in caches:
        tight.track(cache)
    with pytest.raises(CacheMemoryFull, match="the server's caches hold "):
        tight.check({make_cache(model, "h2o", heavy=128, recent=64, sink=4): caches[2].allocated_bytes()})
    for cache in caches:  # their turns end: the pool lets go of every buffer
        step.release(cache)
        memory.track(cache)
    assert step.spare_bytes == 0 and not pool.buffers
    assert memory.held == sum(cache.allocated_bytes() for cache in caches)
