"""The engine against a plain reference of the eviction rule, and against stock transformers."""

import pytest
import torch
from transformers import DynamicCache

from h2o_chat import make_cache
from h2o_chat.engine.attention import ATTENTION_NAME, hiding_bias, scored_attention, slot_mask

from .helpers import fail_next_update, feed, record_slots_attended
from .reference import REFERENCE_NAME, ReferenceRule, StoredAsCache, use_rule


def run_engine_and_reference(model, prompt, steps, chunk, heavy, recent, sink, protected=None,
                             score_norm="sum", key_bits=None, value_bits=None, exact_window=0):
    """Prefill ``prompt`` in chunks, then decode greedily for ``steps`` tokens with the
    engine, feeding the reference the same tokens. Returns both logits and the caches.
    With storage bits, the reference keeps what the engine's storage reads back (the
    newest ``exact_window`` tokens as given)."""
    cache = make_cache(model, "h2o", heavy=heavy, recent=recent, sink=sink, score_norm=score_norm,
                       key_bits=key_bits, value_bits=value_bits, exact_window=exact_window)
    if protected:
        cache.protect(*protected)
    rule = ReferenceRule(heavy, recent, sink, protected, norm=score_norm)
    reference_cache = StoredAsCache(model.config, cache.storage)
    engine_logits = [feed(model, cache, prompt, chunk)]
    model.set_attn_implementation(REFERENCE_NAME)
    try:
        with use_rule(rule):
            reference_logits = [feed(model, reference_cache, prompt, chunk)]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    for _ in range(steps):
        token = engine_logits[-1][:, -1:].argmax(-1)
        engine_logits.append(feed(model, cache, token, 1))
        model.set_attn_implementation(REFERENCE_NAME)
        try:
            with use_rule(rule):
                reference_logits.append(feed(model, reference_cache, token, 1))
        finally:
            model.set_attn_implementation(ATTENTION_NAME)
    return torch.cat(engine_logits, 1), torch.cat(reference_logits, 1), cache, rule


def assert_same_positions(cache, rule):
    for index, layer in enumerate(cache.stats().layers):
        assert layer.positions.tolist() == rule.kept_positions(index), f"layer {index}"


@pytest.mark.parametrize("chunk", [1, 16, 200])
def test_tiny_model_matches_reference_rule(tiny_model, chunk):
    torch.manual_seed(1)
    prompt = torch.randint(0, 128, (1, 90))
    engine, reference, cache, rule = run_engine_and_reference(
        tiny_model, prompt, steps=60, chunk=chunk, heavy=10, recent=6, sink=2
    )
    torch.testing.assert_close(engine, reference, rtol=1e-4, atol=1e-4)
    assert_same_positions(cache, rule)
    assert cache.stats().held == 18 and cache.stats().seen == 150


@pytest.mark.parametrize("chunk", [1, 16])
def test_mean_score_norm_matches_the_reference_and_changes_the_choice(tiny_model, chunk):
    torch.manual_seed(1)
    prompt = torch.randint(0, 128, (1, 90))
    runs = {norm: run_engine_and_reference(tiny_model, prompt, steps=40, chunk=chunk, heavy=10,
                                           recent=6, sink=2, score_norm=norm)
            for norm in ("sum", "mean")}
    engine, reference, cache, rule = runs["mean"]
    torch.testing.assert_close(engine, reference, rtol=1e-4, atol=1e-4)
    assert_same_positions(cache, rule)
    kept = {norm: [layer.positions.tolist() for layer in run[2].stats().layers] for norm, run in runs.items()}
    assert kept["mean"] != kept["sum"]


def test_batch_rows_and_heads_evict_independently(tiny_model):
    torch.manual_seed(2)
    prompt = torch.randint(0, 128, (2, 50))
    engine, reference, cache, rule = run_engine_and_reference(
        tiny_model, prompt, steps=30, chunk=8, heavy=8, recent=4, sink=1
    )
    torch.testing.assert_close(engine, reference, rtol=1e-4, atol=1e-4)
    assert_same_positions(cache, rule)


def test_protected_span_is_never_evicted_and_not_counted(tiny_model):
    torch.manual_seed(3)
    prompt = torch.randint(0, 128, (1, 70))
    engine, reference, cache, rule = run_engine_and_reference(
        tiny_model, prompt, steps=40, chunk=16, heavy=6, recent=6, sink=0, protected=(20, 30)
    )
    torch.testing.assert_close(engine, reference, rtol=1e-4, atol=1e-4)
    assert_same_positions(cache, rule)
    stats = cache.stats()
    assert stats.pinned == 10 and stats.held == 22 and stats.budget == 22
    for layer in stats.layers:
        for row in layer.positions.tolist():
            for head in row:
                assert set(range(20, 30)) <= set(head)


def test_real_model_matches_reference_rule(smollm):
    model, tokenizer = smollm
    text = "The quick brown fox jumps over the lazy dog. " * 12
    prompt = tokenizer(text, return_tensors="pt").input_ids[:, :120]
    engine, reference, cache, rule = run_engine_and_reference(
        model, prompt, steps=50, chunk=32, heavy=24, recent=24, sink=4
    )
    torch.testing.assert_close(engine, reference, rtol=1e-3, atol=1e-3)
    assert_same_positions(cache, rule)
    # Per-head choice is the point of H2O: trained heads do not all keep the same tokens.
    layers = cache.stats().layers
    assert any(not torch.equal(l.positions[0, 0], l.positions[0, h]) for l in layers for h in range(3))


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_full_policy_equals_stock_dynamic_cache(tiny_model, chunk):
    torch.manual_seed(4)
    ids = torch.randint(0, 128, (1, 64))
    tiny_model.set_attn_implementation("sdpa")
    try:
        stock = feed(tiny_model, DynamicCache(config=tiny_model.config), ids, 64)
    finally:
        tiny_model.set_attn_implementation(ATTENTION_NAME)
    ours = feed(tiny_model, make_cache(tiny_model, "full"), ids, chunk)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "recent", "sink"])
def test_chunked_prefill_under_budget_equals_one_shot(tiny_model, policy):
    # A budget larger than the prompt evicts nothing, so chunking must not change logits:
    # this fails if the mask lets a chunk see its own future tokens.
    torch.manual_seed(5)
    ids = torch.randint(0, 128, (1, 80))
    budgets = dict(heavy=100, recent=100, sink=4)
    one_shot = feed(tiny_model, make_cache(tiny_model, policy, **budgets), ids, 80)
    chunked = feed(tiny_model, make_cache(tiny_model, policy, **budgets), ids, 13)
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "policy, budgets, kept",
    [
        ("recent", dict(recent=5), list(range(35, 40))),
        ("sink", dict(sink=2, recent=5), [0, 1] + list(range(35, 40))),
    ],
)
def test_window_policies_keep_the_window(tiny_model, policy, budgets, kept):
    cache = make_cache(tiny_model, policy, **budgets)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 40)), 9)
    for layer in cache.stats().layers:
        assert layer.positions[0, 0].tolist() == kept


def test_stock_generate_greedy_and_sampled_stay_bounded(tiny_model):
    ids = torch.randint(1, 128, (1, 300))  # no pad token (0): generate would infer padding
    for sample in (False, True):
        cache = make_cache(tiny_model, "h2o", heavy=16, recent=16, sink=2)
        out = tiny_model.generate(
            ids, past_key_values=cache, prefill_chunk_size=64, max_new_tokens=40,
            do_sample=sample, pad_token_id=0,
        )
        stats = cache.stats()
        assert out.shape[1] == 340
        # The last sampled token is returned, not fed: seen = prompt + 39.
        assert stats.seen == 339 and stats.held == 34 == stats.budget
        assert all(layer.held == 34 for layer in stats.layers)


def test_generate_matches_manual_greedy_loop(tiny_model):
    # generate must slice inputs and positions from get_seq_length (tokens seen).
    ids = torch.randint(0, 128, (1, 100))
    cache = make_cache(tiny_model, "h2o", heavy=8, recent=8, sink=2)
    out = tiny_model.generate(ids, past_key_values=cache, prefill_chunk_size=32, max_new_tokens=20, do_sample=False)
    manual = make_cache(tiny_model, "h2o", heavy=8, recent=8, sink=2)
    logits = feed(tiny_model, manual, ids, 32)
    tokens = []
    for _ in range(20):
        tokens.append(logits[:, -1:].argmax(-1))
        logits = feed(tiny_model, manual, tokens[-1], 1)
    assert out[:, 100:].tolist() == torch.cat(tokens, 1).tolist()


def test_peak_cache_size_is_budget_plus_chunk(tiny_model):
    cache = make_cache(tiny_model, "h2o", heavy=32, recent=32, sink=4)
    seen_sizes = record_slots_attended(cache)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 3000)), 256)  # 10x the budget
    assert max(seen_sizes) <= 68 + 256
    assert cache.stats().held == 68 and cache.stats().seen == 3000


def test_equal_length_batch_equals_rows_alone(tiny_model):
    torch.manual_seed(6)
    ids = torch.randint(0, 128, (2, 60))
    budgets = dict(heavy=8, recent=8, sink=2)
    batch = feed(tiny_model, make_cache(tiny_model, "h2o", **budgets), ids, 16)
    for row in range(2):
        alone = feed(tiny_model, make_cache(tiny_model, "h2o", **budgets), ids[row : row + 1], 16)
        torch.testing.assert_close(batch[row : row + 1], alone, rtol=1e-4, atol=1e-4)


def test_layers_evict_as_one_stacked_group_and_row_selection_splits_it(tiny_model):
    """From the second forward pass every layer's buffers are rows of one stacked group
    (evicted at once); picking batch rows (as beam search and generate do) gives each
    layer its own copy, and the next pass stacks them again, rows unchanged."""
    torch.manual_seed(7)
    ids = torch.randint(0, 128, (2, 60))
    budgets = dict(heavy=8, recent=8, sink=2)
    batch = make_cache(tiny_model, "h2o", **budgets)
    feed(tiny_model, batch, ids, 16)
    group = batch.layers[0].group
    assert len(batch.layers) > 1 and all(layer.group is group for layer in batch.layers)
    alone = make_cache(tiny_model, "h2o", **budgets)
    feed(tiny_model, alone, ids[1:], 16)
    batch.batch_select_indices(torch.tensor([1]))
    assert len({id(layer.group) for layer in batch.layers}) == len(batch.layers)
    for layer, single in zip(batch.stats().layers, alone.stats().layers):
        assert torch.equal(layer.positions, single.positions)
    steps = torch.randint(0, 128, (1, 12))
    torch.testing.assert_close(feed(tiny_model, batch, steps, 1), feed(tiny_model, alone, steps, 1),
                               rtol=1e-4, atol=1e-4)
    assert all(layer.group is batch.layers[0].group for layer in batch.layers)
    for layer, single in zip(batch.stats().layers, alone.stats().layers):
        assert torch.equal(layer.positions, single.positions)


def test_a_dropped_cache_is_freed_at_once_and_a_deep_copy_is_independent(tiny_model):
    """No reference cycle holds a cache's buffers until the garbage collector runs (a
    closed chat frees its memory at once), and a copy (probes, benchmarks) evicts alone."""
    import copy
    import gc
    import weakref

    for policy in ("h2o", "full"):
        cache = make_cache(tiny_model, policy, heavy=8, recent=8)
        feed(tiny_model, cache, torch.randint(0, 128, (1, 40)), 8)
        kept = [layer.positions.clone() for layer in cache.layers]
        twin = copy.deepcopy(cache)
        feed(tiny_model, twin, torch.randint(0, 128, (1, 5)), 1)
        assert [layer.seen for layer in twin.layers] == [45] * 3
        assert all(torch.equal(k, layer.positions) for k, layer in zip(kept, cache.layers))
        gc.disable()
        try:
            refs = [weakref.ref(c.layers[0]) for c in (cache, twin)]
            del cache, twin
            assert all(ref() is None for ref in refs), policy
        finally:
            gc.enable()


def test_a_forward_failing_midway_leaves_every_layer_back_at_budget_after_the_next(tiny_model):
    """A failed pass leaves the first layers one token ahead; the stacked group then
    evicts its runs of equal size separately, and every layer is back at budget."""
    cache = make_cache(tiny_model, "h2o", heavy=8, recent=8, sink=2)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 40)), 8)
    fail_next_update(cache.layers[1])
    with pytest.raises(RuntimeError, match="injected"):
        feed(tiny_model, cache, torch.randint(0, 128, (1, 1)), 1)
    assert [l.held for l in cache.layers] == [19, 18, 18]
    feed(tiny_model, cache, torch.randint(0, 128, (1, 1)), 1)
    assert [l.held for l in cache.layers] == [18, 18, 18]
    assert [l.seen for l in cache.layers] == [42, 41, 41]


def test_padded_batch_is_refused_with_eviction_but_fine_with_full(tiny_model):
    ids = torch.randint(1, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # row 1 is left-padded
    with torch.no_grad(), pytest.raises(ValueError, match="padded batches are not supported"):
        tiny_model(ids, attention_mask=mask, past_key_values=make_cache(tiny_model, "h2o", heavy=4, recent=4))
    with torch.no_grad():
        padded = tiny_model(ids, attention_mask=mask, past_key_values=make_cache(tiny_model, "full")).logits
        alone = tiny_model(ids[1:, 5:], past_key_values=make_cache(tiny_model, "full")).logits
    torch.testing.assert_close(padded[1:, 5:], alone, rtol=1e-4, atol=1e-4)


def test_stats_count_real_bytes(tiny_model):
    cache = make_cache(tiny_model, "h2o", heavy=8, recent=8)
    feed(tiny_model, cache, torch.randint(0, 128, (1, 50)), 50)
    stats = cache.stats()
    # Per layer, slot and KV head: keys + values 16 dims x 4 B each, score 4 B,
    # position 8 B, valid and pinned flags 1 B each; 3 layers, 2 KV heads.
    slot_bytes = 2 * 16 * 4 + 4 + 8 + 1 + 1
    assert stats.held_bytes == 3 * 2 * 16 * slot_bytes
    # The 50-token prefill reserved room for all 50 before evicting down to 16.
    assert stats.kv_bytes == 3 * 2 * 50 * slot_bytes
    assert not make_cache(tiny_model, "h2o", heavy=8, recent=8).stats().budget_reached
    assert stats.budget_reached


def test_make_cache_rejects_bad_arguments(tiny_model):
    with pytest.raises(ValueError, match="cache.policy = 'lru': must be one of full, h2o, recent, sink"):
        make_cache(tiny_model, "lru")
    with pytest.raises(ValueError, match="cache.heavy"):
        make_cache(tiny_model, "h2o", heavy=-1, recent=4)
    with pytest.raises(TypeError, match="unknown budget"):
        make_cache(tiny_model, "h2o", heavvy=4)


def test_one_slot_over_budget_drops_what_the_full_sort_drops():
    """The general rule on scores full of ties: the lowest-scored middle slot goes, the
    newest of equals; the decode path without a sort names the same slot."""
    from h2o_chat.engine.selection import kept_slots, lowest_slot, middle_slots
    from h2o_chat.engine.spans import ProtectedSpans

    torch.manual_seed(4)
    start, end = ProtectedSpans().windows(11, sink=2, recent=3)
    assert (start, end) == (2, 8)
    positions = torch.arange(11).expand(2, 3, -1)
    pinned = torch.zeros(2, 3, 11, dtype=torch.bool)
    middle = middle_slots(positions, pinned, start, end)
    for _ in range(50):
        scores = torch.randint(0, 3, (2, 3, 11)).float()  # capacity 10, many ties
        kept = kept_slots(scores, positions, pinned, middle, capacity=10)
        dropped = lowest_slot(scores, positions, middle)
        for b in range(2):
            for h in range(3):
                ranked = sorted(range(2, 8), key=lambda p: (-float(scores[b, h, p]), p))
                assert kept[b, h].nonzero().flatten().tolist() == sorted(set(range(11)) - {ranked[-1]})
                assert dropped[b, h].tolist() == [ranked[-1]]


@pytest.mark.parametrize("name", ["h2o", "h2o mean", "recent", "sink"])
@pytest.mark.parametrize("pins", [[], [(3, 6)], [(0, 2), (30, 33)]])
def test_drop_one_names_the_slot_that_keep_drops(name, pins):
    """The decode path without a sort (``lowest_slot``): slots in any memory order, scores
    full of ties, pinned spans anywhere; the slot it names holds the token that the
    general rule (``kept_slots``, which sorts) drops, for every policy's ranking."""
    from h2o_chat.engine.policies import make_policy
    from h2o_chat.engine.selection import kept_slots, lowest_slot, middle_slots, ranking_key
    from h2o_chat.engine.spans import ProtectedSpans

    policy = make_policy(name.split()[0], heavy=5, recent=3, sink=2,
                         score_norm="mean" if "mean" in name else "sum")
    spans = ProtectedSpans()
    spans.ranges += pins
    generator = torch.Generator().manual_seed(5)
    seen = 40
    free = [p for p in range(seen) if not spans.covers(p)]
    pinned_positions = [p for p in range(seen) if spans.covers(p)]
    start, end = spans.windows(seen, policy.sink, policy.recent)
    window = [p for p in free if p < start or p >= end]
    n = policy.capacity + 1 + len(pinned_positions)
    for _ in range(30):
        positions = torch.empty(2, 3, n, dtype=torch.long)
        for b in range(2):
            for h in range(3):
                # What a cache holds: pins, windows and some of the middle, shuffled.
                middle_pool = torch.tensor([p for p in free if start <= p < end])
                older = middle_pool[torch.randperm(len(middle_pool), generator=generator)]
                held = torch.cat([torch.tensor(pinned_positions + window, dtype=torch.long),
                                  older[: n - len(pinned_positions) - len(window)]])
                positions[b, h] = held[torch.randperm(n, generator=generator)]
        pinned = spans.contains(positions)
        scores = torch.randint(0, 3, (2, 3, n), generator=generator).float()
        key = ranking_key(policy.ranking, scores, positions, seen)
        middle = middle_slots(positions, pinned, start, end)
        kept = kept_slots(key, positions, pinned, middle, policy.capacity)
        assert (~kept).sum(-1).eq(1).all()
        assert torch.equal(lowest_slot(key, positions, middle), (~kept).int().argmax(-1, keepdim=True))


def test_reserve_gives_a_full_cache_room_and_a_bounded_one_none(tiny_model):
    from h2o_chat.engine.cache import DECODE_ROOM

    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    full, bounded = make_cache(tiny_model, "full"), make_cache(tiny_model, "h2o", heavy=8, recent=8)
    for cache in (full, bounded):
        feed(tiny_model, cache, ids, 40)
        cache.fit_for_decoding()
    # Fitted for decoding: a full cache what it holds and room for a reply; a bounded one
    # its budget plus one token.
    assert [layer.size for layer in full.layers] == [40 + DECODE_ROOM] * 3
    assert [layer.size for layer in bounded.layers] == [17] * 3
    full.reserve(100)
    bounded.reserve(100)
    assert [layer.size for layer in full.layers] == [140] * 3 and [layer.size for layer in bounded.layers] == [17] * 3
    before = [layer.keys.clone() for layer in full.layers]
    logits = feed(tiny_model, full, ids[:, :25], 1)  # 25 tokens: no layer moves to new buffers
    assert all(layer.size == 140 and torch.equal(layer.keys[:, :, :40], kept) for layer, kept in zip(full.layers, before))
    assert torch.isfinite(logits).all()


def _feed_turns(model, cache, tokens, turns, chunk, mark):
    """Feed ``tokens`` (1, n) from position ``cache``'s seen on, in chunks that end where a
    turn begins; ``mark`` tells the cache where each turn begins first (the engine)."""
    logits, start, seen = [], 0, cache.get_seq_length()
    for begin in turns:
        if mark and begin >= seen:
            cache.mark_turn(begin)
    while start < tokens.shape[1]:
        end = min(start + chunk, tokens.shape[1])
        end = min([end] + [t - seen for t in turns if start < t - seen < end])
        logits.append(feed(model, cache, tokens[:, start:end], end - start))
        start = end
    return torch.cat(logits, 1)


@pytest.mark.parametrize("norm", ["sum", "mean"])
def test_turns_keep_scores_to_their_turn_as_the_reference_rule(tiny_model, norm):
    """The turns policy: a slot scores only with its own turn's queries (with the mean
    norm, its mass per query once the turn closes), in prompt chunks and in decoding,
    turns beginning both inside the prompt and while decoding."""
    torch.manual_seed(4)
    prompt = torch.randint(0, 128, (1, 90))
    turns = (25, 60, 100, 115)
    cache = make_cache(tiny_model, "turns", heavy=10, recent=6, sink=2, score_norm=norm)
    rule = ReferenceRule(10, 6, 2, norm=norm, turns=turns)
    reference_cache = StoredAsCache(tiny_model.config, cache.storage)

    def both(tokens, chunk):
        engine = _feed_turns(tiny_model, cache, tokens, turns, chunk, mark=True)
        tiny_model.set_attn_implementation(REFERENCE_NAME)
        try:
            with use_rule(rule):
                reference = _feed_turns(tiny_model, reference_cache, tokens, turns, chunk, mark=False)
        finally:
            tiny_model.set_attn_implementation(ATTENTION_NAME)
        return engine, reference

    engine, reference = both(prompt, 16)
    logits = [(engine, reference)]
    for _ in range(40):
        logits.append(both(logits[-1][0][:, -1:].argmax(-1), 1))
    torch.testing.assert_close(torch.cat([e for e, _ in logits], 1), torch.cat([r for _, r in logits], 1),
                               rtol=1e-4, atol=1e-4)
    assert_same_positions(cache, rule)
    assert cache.turns.opened == 115 and cache.stats().turn_starts == list(turns)
    plain = run_engine_and_reference(tiny_model, prompt, steps=40, chunk=16, heavy=10, recent=6, sink=2,
                                     score_norm=norm)[2]
    assert [layer.positions.tolist() for layer in plain.stats().layers] != \
        [layer.positions.tolist() for layer in cache.stats().layers]  # turns change the choice


def test_a_turns_cache_without_turns_is_h2o(tiny_model):
    """Nothing marks turns in a story: a turns cache then keeps and scores what h2o does."""
    torch.manual_seed(5)
    prompt = torch.randint(0, 128, (1, 60))
    caches = {policy: make_cache(tiny_model, policy, heavy=8, recent=6, sink=2) for policy in ("h2o", "turns")}
    logits = {policy: [feed(tiny_model, cache, prompt, 16)] for policy, cache in caches.items()}
    for _ in range(30):
        token = logits["h2o"][-1][:, -1:].argmax(-1)
        for policy, cache in caches.items():
            logits[policy].append(feed(tiny_model, cache, token, 1))
    assert torch.equal(torch.cat(logits["h2o"], 1), torch.cat(logits["turns"], 1))
    kept = {policy: [layer.positions.tolist() for layer in cache.stats().layers] for policy, cache in caches.items()}
    assert kept["turns"] == kept["h2o"]


def test_a_decode_steps_bias_scores_as_its_boolean_mask_to_the_bit():
    """The decode step's mask made once as a bias to add (``hiding_bias``) gives exactly
    the outputs and probabilities of the boolean mask it comes from, large logits
    included: a hidden slot gets no mass either way."""
    torch.manual_seed(0)
    query, key, value = torch.randn(4, 6, 1, 8) * 30, torch.randn(4, 3, 12, 8) * 30, torch.randn(4, 3, 12, 8)
    visible = (torch.arange(12) < torch.tensor([1, 5, 12, 9])[:, None])[:, None, None, :]
    want = scored_attention(query, key, value, visible, 0.3)
    got = scored_attention(query, key, value, hiding_bias(visible), 0.3, hides_rows=False)
    for got_part, want_part in zip(got, want, strict=True):
        assert torch.equal(got_part, want_part)
    assert got[1][0, ..., 1:].abs().sum() == 0


def test_a_chunks_narrow_causal_mask_scores_as_the_whole_one():
    """A prefill chunk without padding masks only its own block of slots: outputs and
    probabilities equal those of the mask over every slot; a query that the mask hides
    from every slot (padding) hands out no mass."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    narrow = slot_mask(None, None, 5, key, narrow=True)
    whole = slot_mask(None, None, 5, key)
    assert narrow.shape[-1] == 5 and whole.shape[-1] == 12
    for got, want in zip(scored_attention(query, key, value, narrow, 0.3, hides_rows=False),
                         scored_attention(query, key, value, whole, 0.3), strict=True):
        assert torch.equal(got, want)
    padded = whole.expand(2, 3, 5, 12).clone()
    padded[1, :, 0] = False  # the second row's first query is padding
    probabilities = scored_attention(query, key, value, padded, 0.3)[1]
    assert probabilities[1, :, :, 0].abs().sum() == 0
    assert torch.allclose(probabilities[0].sum(-1), torch.ones(3, 2, 5))
