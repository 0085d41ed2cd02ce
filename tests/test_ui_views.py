"""The views' per-browser state, without a server: rebuilding chats, continuing stories."""

import gc

import pytest

from h2o_chat.config import CacheConfig
from h2o_chat.ui.chat_tab import ChatState
from h2o_chat.ui.compare_tab import BOUNDED, FULL, CompareState
from h2o_chat.runtime import ModelProvider
from h2o_chat.ui.story_tab import StoryState, bible_prefix
from h2o_chat.ui.view_state import server_load

SMALL = CacheConfig(policy="h2o", heavy=8, recent=8, sink=4)


@pytest.fixture(scope="module")
def loaded(smollm):
    return ModelProvider(lambda: smollm, "SmolLM2").start().get()


def test_chat_rebuild_goes_back_to_an_earlier_turn(loaded):
    state = ChatState(loaded, SMALL, "Be brief.")
    with state.running():
        "".join(state.session.send("Name a fruit.", temperature=0, max_new_tokens=8))
    shown = state.shown()
    assert [m["role"] for m in shown] == ["user", "assistant"] and shown[1]["content"]
    before = state.take()
    state.rebuild(shown[:1] + [{"role": "assistant", "content": "Apple."}])
    assert state.snapshot().stats.cache.seen == 0  # fresh cache, fed on the next send
    assert state.shown()[1]["content"] == "Apple." and before.stats.cache.seen > 0
    assert state.session.messages[0] == {"role": "system", "content": "Be brief."}


def test_a_turn_at_a_time(loaded):
    state = ChatState(loaded, SMALL, "")
    with state.running():
        with pytest.raises(Exception, match="still streaming"):
            with state.running():
                pass


def test_story_continues_only_while_the_start_is_unchanged(loaded):
    state = StoryState(loaded, SMALL, "Mira keeps the lighthouse.")
    assert state.session.bible_tokens == len(loaded.tokenizer(bible_prefix("Mira keeps the lighthouse."),
                                                                add_special_tokens=False).input_ids)
    "".join(state.session.send("The storm came.", temperature=0, max_new_tokens=6))
    text = state.session.text
    assert state.continues("Mira keeps the lighthouse.", text + " More.")
    assert not state.continues("Mira keeps the lighthouse.", "A different start.")
    assert not state.continues("Tomas fishes.", text)  # a new bible: read again
    assert bible_prefix("  ") == "" and bible_prefix("Facts ") == "Facts\n\n"


def test_compare_sides_share_nothing_but_the_model(loaded):
    state = CompareState(loaded, SMALL, "Be brief.")
    bounded, full = state.sides[BOUNDED], state.sides[FULL]
    assert bounded.cache is not full.cache and state.map_session() is bounded
    assert state.labels == {BOUNDED: "h2o cache (20 slots)", FULL: "full cache"}
    assert CompareState(loaded, CacheConfig(policy="full"), "").labels[BOUNDED] != "full cache"


def test_closing_a_view_stops_both_sides_and_leaves_the_server_count(loaded):
    state = CompareState(loaded, SMALL, "Be brief.")
    gc.collect()  # states of earlier tests, dropped unclosed, leave the count now
    views_open = server_load()[0]
    sides = [state.sides[BOUNDED], state.sides[FULL]]
    streams = [side.send("Count from one to fifty.", temperature=0, max_new_tokens=64) for side in sides]
    for stream in streams:
        next(stream)
    state.close()  # what Gradio does when the tab goes away
    for stream in streams:
        list(stream)
    assert [len(side.reply) < 8 for side in sides] == [True, True]
    assert server_load()[0] == views_open - 1


def test_the_compare_gauges_show_each_sides_own_decoding_speed(loaded):
    # The scheduler decodes both sides in one batched step: the side whose thread waited
    # for it held the whole step, the other's token was then ready at once, and a speed
    # from each thread's wait gave it thousands of tokens/s.
    import re

    import gradio as gr

    from h2o_chat.config import AppConfig
    from h2o_chat.ui.compare_tab import CompareTab
    from h2o_chat.ui.settings import Settings

    provider = ModelProvider(lambda: (loaded.model, loaded.tokenizer), "SmolLM2").start()
    config = AppConfig()
    with gr.Blocks():
        settings = Settings(config)
        tab = CompareTab(provider, settings, config)
    state = CompareState(loaded, SMALL, "Be brief.")
    sampling = {"temperature": 0, "top_p": 0.9, "max_new_tokens": 24, "seed": 1}
    values = {tab.map.live: False, tab.map.layer: -1, tab.map.head: -1, tab.fidelity.enabled: False}
    with state.running():
        streams = {side: session.send("Tell me about the sun.", **sampling)
                   for side, session in state.sides.items()}
        updates = list(tab._replies(values, state, streams, sampling, dict.fromkeys(streams, []),
                                    dict.fromkeys(streams, "")))
    for side, gauge in ((BOUNDED, tab.bounded_gauge), (FULL, tab.full_gauge)):
        stats = state.sides[side].stats()
        assert stats.generated > 1
        shown = re.search(r'data-tps="([\d.]+)"', updates[-1][gauge]).group(1)
        assert shown == f"{stats.decode_tokens_per_s:.2f}", side


def test_a_compare_side_taken_back_equals_one_that_never_had_the_turn(loaded):
    """When a Stop takes one side's turn back but the other side already had a token,
    the view takes that side back too (``rebuild``): it then holds what a side that
    never saw the turn holds, the fidelity gauge's shadow still on the bounded side."""
    state, never = CompareState(loaded, SMALL, "Be brief."), CompareState(loaded, SMALL, "Be brief.")
    state.use_probe(True)
    greedy = dict(temperature=0, max_new_tokens=6)
    for compare in (state, never):
        for session in compare.sides.values():
            "".join(session.send("Name a colour.", **greedy))
    for session in state.sides.values():
        "".join(session.send("Name a fruit.", **greedy))
    for side in (BOUNDED, FULL):
        state.rebuild(side, state.shown(side)[:-2])
    assert state.probe is not None and state.probe.session is state.sides[BOUNDED]
    for side in (BOUNDED, FULL):
        assert state.shown(side) == never.shown(side)
        replies = ["".join(c.sides[side].send("Name a tree.", **greedy)) for c in (state, never)]
        assert replies[0] == replies[1] and replies[0].strip()
