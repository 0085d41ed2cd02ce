"""The exact window: the newest tokens read as the model gave them beside quantized slots
(``engine/window.py``), on every path a cache takes: alone, in the decode step's pools,
saved and resumed, through the input gate, under a byte budget."""

import pytest
import torch

from h2o_chat import ChatSession, make_cache
from h2o_chat.config import ConfigError
from h2o_chat.engine.budget import token_bytes, window_bytes
from h2o_chat.engine.window import entry_rows, entry_slots
from h2o_chat.inputs import InputError
from h2o_chat.sessions.files import TENSORS, SettingsMismatch, load_session, save_session
from h2o_chat.ui.gauges import Gauge, gauge_html

from .helpers import GREEDY, feed
from .test_engine import assert_same_positions, run_engine_and_reference
from .test_hostile import edited
from .test_quant import decode_as_one_batch_and_alone

K4V4 = dict(key_bits=4, value_bits=4)


@pytest.mark.parametrize("window, chunk", [(8, 1), (8, 16), (24, 16), (3, 1)])
def test_the_newest_tokens_are_read_as_given_and_the_rule_keeps_the_same_positions(tiny_model, window, chunk):
    """The reference reads every token older than the newest ``window`` through the codecs
    and the newest as the model gave them: the engine must attend to the same keys and
    values, so score them alike and keep the same positions. 4-bit slots read without
    their window are off by far more than the tolerance, so the window must be there."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 128, (1, 90))
    engine, reference, cache, rule = run_engine_and_reference(
        tiny_model, prompt, steps=40, chunk=chunk, heavy=10, recent=6, sink=2, protected=(5, 9),
        exact_window=window, **K4V4)
    torch.testing.assert_close(engine, reference, rtol=1e-4, atol=3e-4)
    assert_same_positions(cache, rule)
    # The ring holds the newest tokens' keys: position p at entry p % window.
    layer = cache.layers[0]
    assert layer.held_slots()["window_keys"].shape == (1, 2, window, 16)


def test_without_its_window_a_4_bit_cache_reads_otherwise(tiny_model):
    """The check above can fail: the same run with no window differs from the reference
    that keeps one."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 128, (1, 90))
    engine, _, _, _ = run_engine_and_reference(tiny_model, prompt, steps=10, chunk=1, heavy=10, recent=6, sink=2,
                                               **K4V4)
    windowed, _, _, _ = run_engine_and_reference(tiny_model, prompt, steps=10, chunk=1, heavy=10, recent=6,
                                                 sink=2, exact_window=8, **K4V4)
    assert (engine - windowed).abs().max() > 1e-2


def test_only_quantized_slots_keep_a_ring(tiny_model):
    for bits, rings in (((8, None), {"window_keys"}), ((16, 4), {"window_values"}), ((16, 32), set())):
        cache = make_cache(tiny_model, "h2o", heavy=6, recent=6, sink=2, exact_window=8, key_bits=bits[0],
                           value_bits=bits[1])
        feed(tiny_model, cache, torch.randint(0, 128, (1, 20)), 20)
        held = cache.layers[0].held_slots()
        assert {name for name in held if name.startswith("window_")} == rings
        assert all(held[name].dtype == torch.float16 for name in rings)


def test_each_ring_entry_names_the_live_slot_holding_its_token():
    """``entry_slots`` against a plain search: per row and head, entry ``p % R`` names the
    live slot (at most ``newest``) whose position is ``p``, for the newest ``R`` positions;
    an entry whose token was evicted names ``newest``; a stale slot past ``newest`` holding
    a position of the window (a pool row's former conversation) is never named."""
    torch.manual_seed(3)
    size, slots, rows, heads = 5, 12, 3, 2
    seen = torch.tensor([40, 9, 23]).view(rows, 1, 1)
    newest = torch.tensor([9, 8, 11]).view(rows, 1, 1)
    positions = torch.full((rows, heads, slots), -1)
    for row in range(rows):
        for head in range(heads):
            count = int(newest[row]) + 1
            older = torch.randperm(int(seen[row]) - 1)[: count - 1]
            held = torch.cat((older, seen[row].view(1) - 1))[torch.randperm(count)]
            positions[row, head, :count] = held
            positions[row, head, count:] = int(seen[row]) - 1 - torch.arange(slots - count) % size  # stale
    buffers = {"positions": positions, "window_keys": torch.zeros(rows, heads, size, 4)}
    named = entry_slots(buffers, seen, newest)
    for row in range(rows):
        for head in range(heads):
            live = positions[row, head, : int(newest[row]) + 1].tolist()
            for position in range(int(seen[row]) - size, int(seen[row])):
                expected = live.index(position) if position in live else int(newest[row])
                assert int(named[row, head, position % size]) == expected
    assert entry_slots({"positions": positions}, seen, newest) is None


def test_entry_rows_name_each_entrys_slot_as_a_row_of_the_flattened_read():
    """The decode step makes ``entry_rows`` once for every layer: row ``entry_rows[l][i]``
    of layer ``l``'s read viewed as ``(-1, dim)`` is the slot entry ``i`` names."""
    torch.manual_seed(4)
    layers, rows, heads, size, ring, dim = 3, 2, 3, 7, 4, 5
    slots = torch.randint(0, size, (layers, rows, heads, ring))
    reads = torch.randn(layers, rows, heads, size, dim)
    flat = entry_rows(slots, size)
    assert flat.shape == (layers, rows * heads * ring)
    for layer in range(layers):
        expected = reads[layer].gather(2, slots[layer, ..., None].expand(-1, -1, -1, dim))
        assert torch.equal(reads[layer].view(-1, dim)[flat[layer]], expected.view(-1, dim))


def test_rows_with_and_without_windows_decode_in_one_batch_as_each_alone(tiny_model):
    rows = [dict(exact_window=8, **K4V4), K4V4, dict(exact_window=4, key_bits=8, value_bits=4, rolling=True),
            dict(exact_window=8, key_bits=4, value_bits=4), dict(exact_window=8)]
    step = decode_as_one_batch_and_alone(tiny_model, rows, (30, 17, 41, 25, 12))
    # Rows 0 and 3 share a layout, one pool; a window over float slots keeps no ring.
    assert len(step.pools) == 4


@pytest.mark.parametrize("rolling", [False, True])
def test_a_windowed_cache_resumes_with_bit_identical_logits(tiny_model, rolling):
    torch.manual_seed(7)
    prompt = torch.randint(0, 128, (1, 60))
    options = dict(heavy=8, recent=6, sink=2, rolling=rolling, exact_window=8, **K4V4)
    cache = make_cache(tiny_model, "h2o", **options)
    feed(tiny_model, cache, prompt, 16)
    tensors, info = cache.state()
    assert tensors["layers.2.window_values"].shape == (1, 2, 8, 16)
    resumed = make_cache(tiny_model, "h2o", **options)
    resumed.load_state(tensors, info)
    for token in (5, 9, 3):  # past the ring's length, through entries written after resuming
        step = torch.tensor([[token]])
        assert torch.equal(feed(tiny_model, cache, step, 1), feed(tiny_model, resumed, step, 1))
    other = make_cache(tiny_model, "h2o", **(options | dict(exact_window=4)))
    with pytest.raises(ValueError, match="cache.exact_window = 8 in the saved state, 4 in this cache"):
        other.load_state(tensors, info)
    shorter = dict(tensors) | {"layers.0.window_keys": tensors["layers.0.window_keys"][:, :, :4]}
    with pytest.raises(ValueError, match=r"layer 0: window_keys is torch.float16 \(1, 2, 4, 16\), expected "
                                         r"16-bit floats \(1, 2, 8\) \+ the keys' channels"):
        make_cache(tiny_model, "h2o", **options).load_state(shorter, info)


def windowed_chat(model, tokenizer):
    return ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=16, recent=16, sink=4, exact_window=16,
                                                          **K4V4))


def test_a_windowed_chat_saves_resumes_and_the_gate_checks_its_rings(smollm, tmp_path):
    model, tokenizer = smollm
    session = windowed_chat(model, tokenizer)
    "".join(session.send("Name three rivers in Europe.", **GREEDY))
    path = save_session(session, tmp_path / "chat.h2o")
    resumed = load_session(path, model, tokenizer, windowed_chat(model, tokenizer).cache)
    assert "".join(resumed.send("And one in Asia?", **GREEDY)) == "".join(session.send("And one in Asia?", **GREEDY))
    page = gauge_html(Gauge.of("chat", resumed.stats()))
    assert "keys 4-bit, values 4-bit, newest 16 exact" in page and 'data-exact-window="16"' in page

    def longer_ring(tensors):
        tensors["layers.1.window_keys"] = torch.zeros(1, 3, 17, 64)

    def not_finite(tensors):
        tensors["layers.0.window_values"][0, 0, 3, 5] = float("nan")

    for name, edit, field, message in (
            ("ring", longer_ring, "layers.1.window_keys",
             "layers.1.window_keys is torch.float32 (1, 3, 17, 64); this cache's precision stores torch.float16 "
             "(1, 3, 16, 64)"),
            ("nan", not_finite, "layers.0.window_values", "layers.0.window_values holds NaN or infinite values")):
        fresh = windowed_chat(model, tokenizer).cache
        with pytest.raises(InputError) as refused:
            load_session(edited(path, tmp_path, name, tensors=edit), model, tokenizer, fresh)
        assert refused.value.field == f"{TENSORS}: {field}"
        assert str(refused.value).endswith(message)
        assert fresh.seen == 0  # a refused file leaves the cache fresh
    with pytest.raises(SettingsMismatch, match="cache.exact_window = 16 in the file, not used"):
        load_session(path, model, tokenizer, make_cache(model, "h2o", heavy=16, recent=16, sink=4, **K4V4))


def test_a_byte_budget_pays_for_the_window_first(smollm):
    model, _ = smollm
    storage = dict(exact_window=16, **K4V4)
    cache = make_cache(model, "h2o", budget_bytes=4_000_000, sink=4, **storage)
    ring = window_bytes(model, cache.storage)
    # 30 layers x 3 KV heads x 16 tokens x 64 channels x (keys + values) x 2 bytes (float16)
    assert ring == 30 * 3 * 16 * 64 * 2 * 2
    per_token = token_bytes(model, cache.storage, rolling=False)
    assert cache.policy.capacity == (4_000_000 - ring) // per_token
    feed(model, cache, torch.randint(100, 10_000, (1, 300), generator=torch.Generator().manual_seed(0)), 64)
    stats = cache.stats()
    assert stats.held_bytes == stats.held * per_token + ring <= 4_000_000
    with pytest.raises(ConfigError, match=r"holds 0 tokens at 8,460 bytes a token after the exact window's "
                                          r"368,640; must hold from 5"):
        make_cache(model, "h2o", budget_bytes=ring, sink=4, **storage)


@pytest.mark.parametrize("given, allowed", [(-1, "must be an integer from 0 to 1024"),
                                            (1025, "must be an integer from 0 to 1024"),
                                            (2.5, "expected int, got float; must be an integer from 0 to 1024"),
                                            ("8", "expected int, got str; must be an integer from 0 to 1024")])
def test_a_window_out_of_range_is_refused_naming_the_field(tiny_model, given, allowed):
    with pytest.raises(ConfigError, match=f"^cache.exact_window = {given!r}: {allowed}$"):
        make_cache(tiny_model, "h2o", heavy=4, recent=4, exact_window=given, **K4V4)
