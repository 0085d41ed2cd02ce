"""The budget-shape study (comparison 8e) spends the same slots as the engine, shaped
otherwise: uniform it is the tier study's simulation of the engine, layers sized by
attention get what their attention asks for, and heads that share a layer's slots hold
exactly its budget between them."""

import math

import pytest
import torch

from h2o_chat.bench.budget_shapes import (MASS_FLOOR, SHAPES, Shape, SharedHeadsLayer, attention_mass, layer_slots,
                                          markdown, shape_cache)
from h2o_chat.bench.data import Passage
from h2o_chat.bench.streaming import passage_records, reference_logprobs, stream_pass
from h2o_chat.bench.tier_study import HELD, SINK, Tier, tier_cache
from h2o_chat.engine.attention import ATTENTION_NAME


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_every_shape_spends_the_uniform_shapes_slots(shape):
    mass = torch.rand(30, 1536).sort(-1, descending=True).values
    each = layer_slots(shape, 374, 30, mass)
    assert len(each) == 30 and sum(each) == 374 * 30 and min(each) > 0


def test_linear_shapes_slope_the_way_they_say():
    assert layer_slots(Shape("u"), 10, 4) == [10, 10, 10, 10]
    deeper = layer_slots(Shape("d", 0.5, 1.5), 100, 5)
    assert deeper == sorted(deeper) and deeper[0] < 60 and deeper[-1] > 140
    assert layer_slots(Shape("p", 1.5, 0.5), 100, 5) == sorted(layer_slots(Shape("p", 1.5, 0.5), 100, 5), reverse=True)


def test_sized_by_attention_the_flattest_layer_gets_most_and_each_keeps_the_floor():
    decay = torch.arange(200, dtype=torch.float32)
    mass = torch.stack([torch.exp(-decay / 2), torch.exp(-decay / 50), torch.exp(-decay / 10)])
    each = layer_slots(Shape("m", by_attention=True), 100, 3, mass)
    assert sum(each) == 300 and min(each) >= MASS_FLOOR
    assert each[1] > each[2] > each[0]
    # Greedy on the marginal masses: no slot moved between layers would keep more mass.
    kept = [float(mass[layer, : each[layer]].sum()) for layer in range(3)]
    for give in range(3):
        for take in range(3):
            if give != take and each[give] > MASS_FLOOR and each[take] < mass.shape[1]:
                moved = float(mass[take, each[take]] - mass[give, each[give] - 1])
                assert moved <= 1e-7, (give, take, kept)


def test_attention_mass_is_each_kv_heads_sorted_attention_and_leaves_the_engines_attention(tiny_model):
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (2, 40))
    curves = attention_mass(tiny_model, ids, since=8)
    assert curves.shape == (3, 40)
    assert bool((curves[:, :-1] >= curves[:, 1:] - 1e-6).all())
    # Each query's attention sums to one per query head; two query heads per KV head.
    torch.testing.assert_close(curves.sum(-1), torch.full((3,), 2.0), rtol=1e-4, atol=1e-4)
    assert tiny_model.config._attn_implementation == ATTENTION_NAME


def test_the_uniform_shape_is_the_tier_studys_engine(tiny_model):
    torch.manual_seed(5)
    ids = torch.randint(0, 128, (2, 90))
    ref = reference_logprobs(tiny_model, ids)
    uniform = stream_pass(tiny_model, shape_cache(SHAPES[0], [30, 30, 30]), ids, ref, 4)[0]
    engine = stream_pass(tiny_model, tier_cache(tiny_model, Tier("t", hi=30), 1.0, 90), ids, ref, 4)[0]
    assert torch.equal(uniform, engine)
    quarter = next(shape for shape in SHAPES if shape.recent_share == 0.25)
    assert [layer.recent for layer in shape_cache(quarter, [30, 31, 36]).layers] == [6, 6, 8]


def test_heads_sharing_a_layers_slots_hold_its_budget_between_them_and_keep_their_windows(tiny_model):
    torch.manual_seed(6)
    ids = torch.randint(0, 128, (2, 90))
    ref = reference_logprobs(tiny_model, ids)
    cache = shape_cache(Shape("s", shared_heads=True), [30, 30, 30])
    stream_pass(tiny_model, cache, ids, ref, 4)
    for layer in cache.layers:
        held = layer.tier[:, :, :90] == HELD
        assert held.sum((1, 2)).tolist() == [60, 60]  # 30 slots x 2 KV heads, every row
        assert bool(held[:, :, :SINK].all()) and bool(held[:, :, layer.seen - layer.recent : layer.seen].all())


def test_the_lowest_scored_middle_token_of_any_head_goes():
    layer = SharedHeadsLayer(Tier("t"), 8, 0, 12)
    layer.lazy_initialization(torch.zeros(1, 2, 12, 8), torch.zeros(1, 2, 12, 8))
    layer.seen, layer.tier[:] = 12, HELD
    positions = torch.arange(12, dtype=torch.float32)
    layer.scores[0] = torch.stack([positions + 10, positions])  # head 1 received less everywhere
    layer.apply_rule()
    # 24 held over a budget of 16: head 1's six middle tokens (4..9) go first, then head
    # 0's two lowest; sink (0..3) and recent window (10, 11) stay in both.
    assert layer.recent == 2
    assert (layer.tier[0, 0] == HELD).nonzero().flatten().tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    assert (layer.tier[0, 1] == HELD).nonzero().flatten().tolist() == [0, 1, 2, 3, 10, 11]


def test_the_table_gives_each_shape_its_perplexity_over_the_full_caches_per_source():
    passages = [Passage("wikitext2", "w", 0, []), Passage("book", "b", 0, [])]
    ones = torch.ones(2, 3, dtype=torch.bool)

    def records(label, nll):
        return passage_records(label, "shape", "5%", 9, passages, torch.tensor(nll), ones, torch.zeros(2, 3),
                               "streaming")

    full = records("full", [[1.0] * 3, [2.0] * 3])
    shaped = [r | {"layer_slots": [12, 6, 9]} for r in records("a shape", [[1.5] * 3, [2.0] * 3])]
    table = markdown({"records": full + shaped, "config": {"share": 0.05}})
    row = next(line for line in table.splitlines() if line.startswith("| a shape"))
    wiki, book, both = (f"{x:.3f}×" for x in (math.exp(0.5), 1.0, math.exp(0.25)))
    assert row.split(" | ")[1:5] == ["12 / 6..12 / 9", wiki, book, both]
