"""Gauge data, per-turn series, divergence and stream pacing: plain functions of stats."""

import re
from dataclasses import replace

from h2o_chat import ChatSession, make_cache
from h2o_chat.config import CacheConfig
from h2o_chat.engine.build import cache_from_config
from h2o_chat.fidelity import first_divergence
from h2o_chat.ui.gauges import Gauge, TurnSeries, empty_gauge, gauge_html
from h2o_chat.ui.settings import budget
from h2o_chat.ui.streaming import Interleaved, Throttle, stream_turn


def attributes(page: str) -> dict[str, str]:
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', page))


def test_gauge_follows_the_session_from_empty_to_at_budget(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=8, recent=8, sink=4))
    empty = Gauge.of("chat", session.stats())
    assert empty.state == "empty" and empty.kv_bytes == 0
    assert "nothing fed yet" in gauge_html(empty)  # the system prompt waits for the first send
    "".join(session.send("Hello there, how are you today?", temperature=0, max_new_tokens=12))
    stats = session.stats()
    gauge = Gauge.of("chat", stats)
    assert (gauge.seen, gauge.held, gauge.budget, gauge.kv_bytes, gauge.held_bytes) == (
        stats.cache.seen, stats.cache.held, stats.cache.budget, stats.cache.kv_bytes,
        stats.cache.held_bytes)
    assert gauge.state == "at-budget" and gauge.evicted == stats.cache.seen - stats.cache.held > 0
    page = gauge_html(gauge)
    assert attributes(page) == {
        "state": "at-budget", "tokens": str(stats.tokens), "seen": str(stats.cache.seen),
        "held": str(stats.cache.held), "budget": str(stats.cache.budget),
        "kv-bytes": str(stats.cache.kv_bytes), "held-bytes": str(stats.cache.held_bytes),
        "budget-bytes": "", "key-bits": "32", "value-bits": "32",  # float32 SmolLM2, slots counted
        "exact-window": "0",
        "tps": f"{stats.decode_tokens_per_s:.2f}",
    }
    assert f"{gauge.evicted} tokens evicted" in page


def test_gauge_of_a_byte_budget_at_8_and_4_bits_shows_bytes_bits_and_slots(smollm):
    model, tokenizer = smollm
    cache = CacheConfig(policy="h2o", sink=4, key_bits=8, value_bits=4, budget_mb=0.6)
    # Before the model is known the budget can only be named in bytes.
    planned = empty_gauge("chat", None, cache)
    assert attributes(planned)["budget-bytes"] == "600000" and "budget <b>0.6 MB</b>" in planned
    session = ChatSession(model, tokenizer, cache=cache_from_config(model, cache), system_prompt="Be brief.")
    "".join(session.send("Tell me about the sea and the ships on it, all of them. " * 6,
                         temperature=0, max_new_tokens=8))
    stats = session.stats().cache
    page = gauge_html(Gauge.of("chat", session.stats()))
    shown = attributes(page)
    assert (shown["key-bits"], shown["value-bits"], shown["budget-bytes"]) == ("8", "4", "600000")
    assert shown["state"] == "at-budget" and int(shown["held-bytes"]) == stats.held_bytes <= 600_000
    # The pins take their slots from the bytes: the count is the one shown before the
    # chat began (QA: 88 slots, then 67 + 21 pinned).
    assert stats.pinned > 0
    assert f"budget <b>{stats.budget} (0.6 MB)</b>, <b>{stats.pinned}</b> of them pinned" in page
    assert f"budget <b>{stats.budget} (0.6 MB)</b></div>" in empty_gauge("chat", budget(cache, model), cache)
    assert "keys 8-bit, values 4-bit" in page


def test_gauge_states_in_words():
    def gauge(**kw):
        base = dict(label="x", tokens=50, seen=49, held=49, pinned=0, budget=100,
                    kv_bytes=10**6, held_bytes=5 * 10**5, tokens_per_s=3.0, prefill_seconds=0.1)
        return Gauge(**base | kw)

    assert gauge().state == "filling" and "budget not reached yet" in gauge_html(gauge())
    assert "51 slots free" in gauge_html(gauge())
    assert gauge(budget=None).state == "full" and "budget <b>∞</b>" in gauge_html(gauge(budget=None))
    assert gauge(seen=0, held=0, tokens=0).state == "empty"
    assert "budget not reached yet" in gauge_html(gauge(seen=0, held=0, tokens=0))
    assert gauge(held=100, seen=300).state == "at-budget"
    # A pin right after evictions: 21 more slots allowed, not yet filled; still evicting,
    # and "budget" is the settings' 260 with the pins on top, as in the pin panel.
    pinned = gauge(seen=416, held=260, pinned=21, budget=281)
    assert pinned.state == "at-budget" and "156 tokens evicted" in gauge_html(pinned)
    assert "budget <b>260</b> + <b>21</b> pinned" in gauge_html(pinned)
    assert "pinned" not in gauge_html(gauge(budget=None, pinned=21))  # ∞ has nothing on top
    assert "1.00 MB</b> (0.50 MB in use)" in gauge_html(gauge())


def test_an_empty_gauge_draws_an_empty_bar():
    for budget in (None, 260):  # the full cache's and a bounded one's
        page = empty_gauge("cache", budget)
        assert attributes(page)["state"] == "empty"
        assert '<div class="gbar"><div style="width:0.0%"></div></div>' in page


def test_turn_series_replaces_the_live_turn_and_plots_the_bytes_in_use():
    series = TurnSeries()
    a = Gauge("h2o", 10, 10, 10, 0, 40, 2_000_000, 1_000_000, 1.0, 0.0)
    b = Gauge("full", 10, 10, 10, 0, None, 2_000_000, 1_000_000, 1.0, 0.0)
    for turn in (1, 2, 10):
        series.record(turn, [a, b])
    series.record(2, [a, replace(b, held=20, kv_bytes=8_000_000, held_bytes=3_000_000)])
    frame = series.frame()
    assert list(frame.columns) == ["turn", "cache", "KV MB in use", "slots held"]
    assert len(frame) == 6 and series.order() == ["1", "2", "10"]
    last = frame[(frame.turn == "2") & (frame.cache == "full")].iloc[0]
    # What the gauge shows as in use, not the allocation (room for incoming tokens too).
    assert (last["KV MB in use"], last["slots held"]) == (3.0, 20)
    assert "(3.00 MB in use)" in gauge_html(replace(b, held=20, kv_bytes=8_000_000, held_bytes=3_000_000))


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


class Clock:
    """Time that moves only when a test says so, so pacing is checked exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throttle_lets_one_update_through_per_interval():
    clock = Clock()
    throttle = Throttle(0.5, clock)
    assert throttle.due() and not throttle.due()
    clock.now += 0.25
    assert not throttle.due()
    clock.now += 0.25
    assert throttle.due() and not throttle.due()


def test_stream_turn_paces_text_throttles_views_and_sends_a_final_update():
    clock = Clock()

    def timed(chunks):
        for chunk in chunks:
            clock.now += 0.25
            yield chunk

    updates = list(stream_turn(
        timed(["a", "b", "c", "d", "e"]),
        show=lambda text: {"text": text},
        views=lambda final: {"views": "final" if final else "live"},
        final=lambda: {"text": "done"},
        closed=lambda: False,
        throttle=Throttle(0.5, clock),
        paced=Throttle(0.6, clock),
    ))
    # Views (and the text with them) go out with the first chunk, then each time 0.5 s
    # have passed since; the text alone when 0.6 s have passed since it last went alone:
    # "abcd" came 0.5 s after "ab" and waits for the next push.
    assert [u["text"] for u in updates] == ["a", "ab", "abc", "abcde", "done"]
    assert [u.get("views") for u in updates] == ["live", None, "live", "live", "final"]
    assert list(stream_turn(iter(["a"]), lambda t: {}, lambda f: {}, lambda: {}, lambda: True)) == []


def test_interleaved_streams_alternate():
    def stream(name, n):
        for i in range(n):
            yield f"{name}{i}"

    steps = Interleaved({"a": stream("a", 3), "b": stream("b", 2)})
    assert [chunk for _, chunk in steps] == ["a0", "b0", "a1", "b1", "a2"]


def test_interleaved_closes_the_streams_it_abandons():
    closed = []

    def stream():
        try:
            yield "x"
            yield "y"
        finally:
            closed.append(True)

    steps = iter(Interleaved({"a": stream()}))
    next(steps)
    steps.close()
    assert closed == [True]
