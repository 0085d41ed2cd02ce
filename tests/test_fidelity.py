"""The fidelity probe (a full-cache shadow teacher-forced on a session's tokens) and the
compare view's gauge, on the real embedded model."""

import html

import gradio as gr
import pytest
import torch

from h2o_chat import ChatSession, make_cache
from h2o_chat.fidelity import FidelityProbe, held_positions, kl_divergence
from h2o_chat.runtime import ModelProvider
from tools.measure_fidelity_cost import CompareView

from .helpers import feed

PROMPT = ("Mira keeps the lighthouse on the northern cliff. Every night she lights the lamp, "
          "writes the weather in her logbook and feeds her grey cat, Pepper. Tell me what she "
          "does when the storm comes.")


def session_with_probe(smollm, heavy, recent, sink=2):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, system_prompt=None, prefill_chunk_size=16,
                          cache=make_cache(model, "h2o", heavy=heavy, recent=recent, sink=sink))
    return session, FidelityProbe(session).attach()


def reply(session, tokens=10, text=PROMPT):
    return "".join(session.send(text, temperature=0, max_new_tokens=tokens))


def test_no_eviction_means_full_agreement(smollm):
    session, probe = session_with_probe(smollm, heavy=512, recent=512)
    reply(session)
    assert session.cache.stats().seen == len(probe.shadow_tokens)  # nothing evicted
    generated = [p for p in probe.points if p.position >= len(session.tokens) - len(session.reply)]
    assert len(generated) == len(session.reply)  # one point per generated token
    assert all(p.agree for p in probe.points)
    assert max(p.kl for p in probe.points) < 1e-6
    assert all(p.lost_mass == 0 and not p.forgotten for p in probe.points)


def test_evictions_show_as_disagreement_and_forgotten_tokens(smollm):
    session, probe = session_with_probe(smollm, heavy=4, recent=4)
    spy_held = {}

    def spy(tokens, start, end, logits):  # what the bounded cache holds after each pass
        probe.observe(tokens, start, end, logits)
        spy_held[end] = held_positions(session.cache)

    session.observer = spy
    reply(session, tokens=12)
    points = probe.points
    assert max(p.kl for p in points) > 0.01 and sum(p.kl for p in points) > 0
    assert any(p.forgotten for p in points)
    pairs = len(session.cache.layers) * session.cache.layers[0].keys.shape[1]
    for before, point in zip(points, points[1:]):
        # The bounded cache's newest query saw what it held after the previous pass.
        held = spy_held[before.position]
        masses = [f.mass for f in point.forgotten]
        assert masses == sorted(masses, reverse=True) and all(m > 0 for m in masses)
        assert sum(masses) <= point.lost_mass + 1e-6 <= 1 + 1e-6
        for f in point.forgotten:
            lacking = sum(f.position not in set(row.tolist()) for layer in held for row in layer)
            assert f.position < before.position and 1 <= f.pairs == lacking <= pairs


def test_shadow_equals_a_plain_full_cache_run(smollm):
    model, _ = smollm
    session, probe = session_with_probe(smollm, heavy=4, recent=4)
    reply(session, tokens=8)
    assert probe.shadow_tokens == session.tokens[: session.fed]
    ids = torch.tensor([session.tokens[: session.fed]])
    plain = feed(model, make_cache(model, "full"), ids, 16)[0]  # sdpa, no scores
    assert torch.allclose(probe.full_logits.float(), plain[-1].float(), atol=1e-3)
    for point in probe.points:  # each step's full-cache favourite, within rounding
        logits = plain[point.position - 1]
        assert logits[point.full_top] >= logits.max() - 1e-3
    assert kl_divergence(plain[-1], plain[-1]) == 0


def test_attached_mid_conversation_the_shadow_catches_up(smollm):
    model, tokenizer = smollm
    session = ChatSession(model, tokenizer, system_prompt=None,
                          cache=make_cache(model, "h2o", heavy=8, recent=8, sink=2))
    reply(session, tokens=4)
    probe = FidelityProbe(session).attach()
    before = len(session.tokens)
    reply(session, tokens=4, text="And then?")
    assert probe.shadow_tokens == session.tokens[: session.fed]
    assert probe.points and min(p.position for p in probe.points) > before
    probe.detach()
    assert session.observer is None


def test_compare_view_gauge(smollm):
    view = CompareView(ModelProvider(lambda: smollm, "SmolLM2").start())
    panel = view.tab.fidelity
    assert panel.enabled.value is False  # off by default: it costs a forward pass per token
    view.set(temperature=0, max_new_tokens=10, heavy=4, recent=4, sink=2, fidelity=True, live=False)
    last = view.send(PROMPT)[-1]
    probe = view.state.probe
    assert probe is not None and view.state.sides["bounded"].observer == probe.observe
    assert f'data-points="{len(probe.points)}"' in last[panel.summary].value
    frame = last[panel.plot].value
    assert len(frame["data"]) == len(probe.points)
    worst = max(probe.points, key=lambda p: p.kl)
    detail = last[panel.detail].value
    assert last[panel.step].value == worst.position and f'data-step="{worst.position}"' in detail
    tokens = view.state.sides["bounded"].tokens
    assert worst.forgotten
    for f in worst.forgotten:  # highlighted in the text and listed, with their own text
        piece = html.escape(loaded_piece(smollm, tokens[f.position]))
        assert f'data-pos="{f.position}"' in detail
        assert f"<li>#{f.position} <code>{piece}</code>" in detail

    # Selecting a range on the plot shows its largest-KL step.
    first, second = probe.points[-2:]
    picked = panel.on_select(view.state, gr.SelectData(None, {"index": [first.position, second.position],
                                                                 "value": None}))
    expected = max(first, second, key=lambda p: p.kl)
    assert picked[panel.step] == expected.position
    assert f'data-step="{expected.position}"' in picked[panel.detail]
    typed = panel.on_step(view.state, first.position)
    assert typed[panel.step] == first.position and f'data-step="{first.position}"' in typed[panel.detail]
    assert "no prediction recorded at token 1" in panel.on_step(view.state, 1)[panel.detail]
    # QA: -1 got Gradio's message naming no box, 2.5 showed token 2.
    last_token = len(probe.session.tokens) - 1
    for typed in (-1.0, 2.5, float("nan")):
        refused = panel.on_step(view.state, typed)
        assert refused[panel.step] is typed and (f"token shown = {typed:g}: must be a token's number, a whole "
                                                 f"number from 0 to {last_token}") in refused[panel.detail]

    # Turned off, the next message runs without the shadow.
    view.set(fidelity=False)
    last = view.send("Shorter, please.")[-1]
    assert view.state.probe is None and view.state.sides["bounded"].observer is None
    assert "gauge off" in last[panel.summary].value
    assert not any(last[part].visible for part in (panel.step, panel.detail))
    assert last[panel.plot].visible == "hidden"  # kept on the page: see HIDDEN_PLOT



def loaded_piece(smollm, token):
    return smollm[1].decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_a_failed_pass_keeps_the_record_and_the_shadow_in_step(smollm):
    session, probe = session_with_probe(smollm, heavy=512, recent=512)
    reply(session, tokens=6)
    first_turn = [p.position for p in probe.points]
    layer = session.cache.layers[12]
    update, calls = layer.update, []

    def failing_update(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the message's second chunk: its first one was recorded
            layer.update = update
            raise RuntimeError("injected failure")
        return update(*args, **kwargs)

    # The session refills its cache, then takes the turn back: refilled again without it.
    layer.update = failing_update
    with pytest.raises(RuntimeError, match="injected"):
        reply(session, tokens=6, text="What is 2 + 2? " * 8)
    # The message's point is gone with it, and the replays were not recorded again.
    assert [p.position for p in probe.points] == first_turn
    reply(session, tokens=6, text="What is 3 + 3?")
    positions = [p.position for p in probe.points]
    assert positions[: len(first_turn)] == first_turn and positions == sorted(set(positions))
    assert probe.shadow_tokens == session.tokens[: session.fed]
    assert all(p.agree and p.kl < 1e-6 for p in probe.points)  # no eviction: still exact
