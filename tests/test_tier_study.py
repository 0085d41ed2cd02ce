"""The tier study (comparison 8d) simulates the engine where it has no tier: without
eviction it reads what the engine's K4/V4 cache with its exact window reads, and with
eviction it keeps what the engine's H2O keeps; a tier changes what is read and keeps the
bytes it was given."""

import torch

from h2o_chat import make_cache
from h2o_chat.bench.equal_bytes import PRECISIONS, share_slots
from h2o_chat.bench.streaming import reference_logprobs, stream_pass
from h2o_chat.bench.tier_study import GONE, HELD, LO, SINK, WINDOW, Tier, TierLayer, tier_cache
from h2o_chat.engine.attention import awaiting_attention
from h2o_chat.engine.budget import split_slots

ENGINE = dict(key_bits=4, value_bits=4, exact_window=WINDOW)


def test_without_eviction_it_reads_what_the_engines_windowed_cache_reads(tiny_model):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 70))
    ref = reference_logprobs(tiny_model, ids)
    engine = stream_pass(tiny_model, make_cache(tiny_model, "full", **ENGINE), ids, ref, 4)[0]
    study = stream_pass(tiny_model, tier_cache(tiny_model, Tier("t", hi=200), 1.0, 70), ids, ref, 4)[0]
    full = stream_pass(tiny_model, make_cache(tiny_model, "full"), ids, ref, 4)[0]
    # The engine's full cache attends with sdpa and the study with its own products, whose
    # float32 sums differ with the CPU's vector width (2e-4 on an Intel Xeon, under 1e-5 on
    # an AMD EPYC): the study must read what the engine reads, far closer to it than to
    # keys and values kept unrounded (7e-3 apart).
    rounding = float((study - full).abs().max())
    assert rounding > 1e-3  # the rounding shows
    assert float((study - engine).abs().max()) < rounding / 10


def test_with_eviction_and_no_tier_it_keeps_what_the_engines_h2o_keeps(tiny_model):
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (1, 90))
    slots = 30
    engine = make_cache(tiny_model, "h2o", **split_slots("h2o", slots, SINK), **ENGINE)
    study = tier_cache(tiny_model, Tier("t", hi=slots), 1.0, 90)
    ref = reference_logprobs(tiny_model, ids)
    engine_nll = stream_pass(tiny_model, engine, ids, ref, 4)[0]
    study_nll = stream_pass(tiny_model, study, ids, ref, 4)[0]
    torch.testing.assert_close(study_nll, engine_nll, rtol=1e-4, atol=1e-4)
    for layer, simulated in zip(engine.layers, study.layers):
        kept = layer.held_slots()["positions"][0].sort(dim=-1).values
        held = [(simulated.tier[0, head] == HELD).nonzero().flatten() for head in range(kept.shape[0])]
        assert torch.equal(kept, torch.stack(held))


def test_a_tier_keeps_its_evicted_tokens_within_its_capacity_and_reads_them_otherwise(tiny_model):
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (1, 90))
    ref = reference_logprobs(tiny_model, ids)
    plain = tier_cache(tiny_model, Tier("t", hi=30), 1.0, 90)
    tiered = tier_cache(tiny_model, Tier("t", hi=30, lo=(2, 2)), 0.25, 90, tokens=90)
    layer = tiered.layers[0]
    assert isinstance(layer, TierLayer) and layer.lo_capacity > 0
    without = stream_pass(tiny_model, plain, ids, ref, 4)[0]
    with_tier = stream_pass(tiny_model, tiered, ids, ref, 4)[0]
    assert float((with_tier - without).abs().max()) > 1e-4
    for simulated in tiered.layers:
        counts = [(simulated.tier[0, :, :90] == tier).sum(-1) for tier in (HELD, LO, GONE)]
        assert bool((counts[0] == 30).all()) and bool((counts[1] == simulated.lo_capacity).all())
        assert bool((counts[2] == 90 - 30 - simulated.lo_capacity).all())


def test_the_bytes_buy_fewer_hi_slots_with_a_tier_and_lo_slots_cost_less(tiny_model):
    # Without a tier, the bytes buy the slots a byte budget buys the engine's cache.
    assert Tier("t").capacities(tiny_model, 0.3, 400) == (share_slots(tiny_model, 0.3, 400, PRECISIONS["K4/V4 +16 exact"]), 0)
    tier = Tier("t", hi=100, lo=(3, 3))
    # Per token and KV head (64 channels): codes, float16 scale and minimum per 32, 14 of bookkeeping.
    assert tier.slot_bytes((4, 4), 64) == 2 * (32 + 8) + 14
    assert tier.slot_bytes((3, 3), 64) == 2 * (24 + 8) + 14
    assert tier.slot_bytes((2, 2), 64, group=64) == 2 * (16 + 4) + 14


def test_a_forward_after_the_study_attends_plainly(tiny_model):
    """Each layer takes itself off the attention's hands once served: a forward without a
    cache afterwards (another test in the same worker) must not reach a study's layer."""
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (1, 40))
    with torch.inference_mode():
        before = tiny_model(input_ids=ids).logits
        stream_pass(tiny_model, tier_cache(tiny_model, Tier("t", hi=20), 1.0, 40), ids,
                    reference_logprobs(tiny_model, ids), 4)
        assert awaiting_attention() is None
        assert torch.equal(tiny_model(input_ids=ids).logits, before)
