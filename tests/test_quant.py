"""Keys and values stored at fewer bits, and a cache budget in bytes."""

import pytest
import torch

from h2o_chat import ChatSession, make_cache
from h2o_chat.config import CacheConfig, ConfigError
from h2o_chat.engine.build import cache_from_config
from h2o_chat.engine.budget import token_bytes
from h2o_chat.engine import quant
from h2o_chat.engine.quant import GroupQuantCodec, KVStorage, make_codec
from h2o_chat.inputs import InputError
from h2o_chat.engine.step import DecodeStep
from h2o_chat.scheduler import forward_one
from h2o_chat.sessions.files import TENSORS, SettingsMismatch, load_session, save_session

from .helpers import GREEDY, assert_consistent, feed
from .test_engine import assert_same_positions, run_engine_and_reference
from .test_hostile import edited

K8V4 = dict(key_bits=8, value_bits=4)


def stored_and_read(codec, x):
    buffers = codec.empty("x", x.shape[:3], x.shape[-1], x.device, x.dtype)
    codec.write(buffers, "x", 0, x.shape[2], x)
    return buffers, codec.read(buffers, "x", x.dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_value_reads_back_within_half_its_groups_scale(bits):
    generator = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 40, 64, generator=generator) * 4 + 1
    x[0, 0, 0] = 7.25  # a constant group: scale 0, read back exactly
    x[0, 0, 1, :32] = torch.linspace(-3000, 3000, 32)  # a wide one
    codec = make_codec(bits)
    buffers, read = stored_and_read(codec, x)
    scale = buffers["x_scale"].float().repeat_interleave(32, dim=-1)
    assert (read - x).abs().le(scale / 2 * (1 + 1e-6) + 1e-6).all()
    assert torch.equal(read[0, 0, 0], x[0, 0, 0])
    assert buffers["x"].shape[-1] == 64 * bits // 8 and buffers["x_scale"].dtype == torch.float16


@pytest.mark.parametrize("bits", [32, 16])
def test_float_storage_keeps_its_dtype(bits):
    x = torch.randn(1, 2, 5, 16)
    buffers, read = stored_and_read(make_codec(bits), x)
    assert buffers["x"].dtype == (torch.float32 if bits == 32 else torch.float16)
    assert torch.equal(read, x) if bits == 32 else torch.equal(read, x.half().float())


def test_at_32_bits_the_cache_is_bit_for_bit_the_default(tiny_model):
    torch.manual_seed(3)
    prompt = torch.randint(0, 128, (1, 70))
    runs = []
    for bits in (None, 32):
        cache = make_cache(tiny_model, "h2o", heavy=10, recent=6, sink=2, key_bits=bits, value_bits=bits)
        logits = [feed(tiny_model, cache, prompt, 16)]
        for _ in range(20):
            logits.append(feed(tiny_model, cache, logits[-1][:, -1:].argmax(-1), 1))
        runs.append((torch.cat(logits, 1), [layer.positions.tolist() for layer in cache.stats().layers]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


@pytest.mark.parametrize("bits", [(8, 4), (4, 4), (16, 8)])
@pytest.mark.parametrize("chunk", [1, 16])
def test_quantized_h2o_keeps_what_the_rule_keeps_on_the_scores_attention_produced(tiny_model, bits, chunk):
    """The reference keeps every key and value as the storage reads it back and applies the
    plain rule: the engine attends to the same dequantized slots, so it must score them
    alike and keep the same positions."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 128, (1, 90))
    engine, reference, cache, rule = run_engine_and_reference(
        tiny_model, prompt, steps=40, chunk=chunk, heavy=10, recent=6, sink=2, protected=(5, 9),
        key_bits=bits[0], value_bits=bits[1])
    # Summation order differs from the reference's; float16 keys bring a few ulps more.
    torch.testing.assert_close(engine, reference, rtol=1e-4, atol=3e-4)
    assert_same_positions(cache, rule)
    assert cache.stats().key_bits == bits[0] and cache.stats().value_bits == bits[1]


def test_quantized_slots_hold_a_quarter_of_the_bytes_or_less(smollm):
    model, _ = smollm
    ids = torch.randint(100, 10_000, (1, 200), generator=torch.Generator().manual_seed(0))
    held = {}
    for bits in ((None, None), (8, 4), (4, 4)):
        cache = make_cache(model, "h2o", heavy=64, recent=64, sink=4, key_bits=bits[0], value_bits=bits[1])
        feed(model, cache, ids, 64)
        stats = cache.stats()
        held[bits] = stats.held_bytes
        # Everything the slots hold, bookkeeping included, is what a token is said to cost.
        assert stats.held_bytes == stats.held * token_bytes(model, cache.storage, rolling=False)
    # float32 K/V take 512 bytes a slot, K8/V4 112, K4/V4 80; bookkeeping adds 14 to each.
    assert held[(8, 4)] * 526 == held[(None, None)] * 126
    assert held[(4, 4)] * 526 == held[(None, None)] * 94


def test_a_k8v4_cache_picks_the_float_caches_tokens_over_a_long_prompt(smollm):
    """Both caches read the same text and are fed the float cache's greedy tokens (teacher
    forcing, so one near-tie cannot send the texts apart): storage error may flip a near-tie,
    but never a token the float cache prefers by a clear logit, and rarely any token."""
    model, tokenizer = smollm
    text = open(__file__.replace("test_quant.py", "data/pride_and_prejudice_ch1-6.txt"), encoding="utf-8").read()
    prompt = torch.tensor([tokenizer.encode(text[:4000])])
    caches = [make_cache(model, "h2o", heavy=96, recent=96, sink=4, key_bits=bits[0], value_bits=bits[1])
              for bits in ((None, None), (8, 4))]
    steps, clear_lead = 48, 1.0
    flips = []
    with torch.inference_mode():
        logits = [forward_one(model, cache, prompt) for cache in caches]
        for _ in range(steps):
            top = logits[0].topk(2)
            token, lead = int(top.indices[0]), float(top.values[0] - top.values[1])
            if int(logits[1].argmax()) != token:
                flips.append(lead)
            logits = [forward_one(model, cache, torch.tensor([[token]])) for cache in caches]
    assert all(lead < clear_lead for lead in flips), flips
    assert len(flips) <= steps // 16, flips


def greedy_tokens(model, cache, prompt, steps):
    with torch.inference_mode():
        logits = forward_one(model, cache, prompt)
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = forward_one(model, cache, torch.tensor([[tokens[-1]]]))
    return tokens


def decode_as_one_batch_and_alone(model, rows: list[dict], lengths: tuple[int, ...]) -> DecodeStep:
    """Caches of ``rows``' settings read prompts of ``lengths`` tokens and decode 25 greedy
    tokens as one batch; each must decode the same tokens and keep the same positions as
    alone. The step, for its pools."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (1, n), generator=generator) for n in lengths]

    def new(row):
        return make_cache(model, "h2o", heavy=6, recent=6, sink=2, **row)

    caches, step = [new(row) for row in rows], DecodeStep()
    with torch.inference_mode():
        logits = [forward_one(model, cache, prompt) for cache, prompt in zip(caches, prompts)]
        tokens = [[] for _ in rows]
        for _ in range(25):
            for row, row_logits in enumerate(logits):
                tokens[row].append(int(row_logits.argmax()))
            logits = step(model, caches, [t[-1] for t in tokens])
    for row, prompt in enumerate(prompts):
        alone = new(rows[row])
        assert greedy_tokens(model, alone, prompt, 25) == tokens[row], f"row {row}"
        assert [layer.positions.tolist() for layer in alone.stats().layers] == \
               [layer.positions.tolist() for layer in caches[row].stats().layers], f"row {row}"
    return step


def test_rows_of_different_precisions_decode_in_one_batch_as_each_alone(tiny_model):
    rows = [dict(key_bits=8, value_bits=4), dict(key_bits=None, value_bits=None), dict(key_bits=4, value_bits=8),
            dict(key_bits=8, value_bits=8, rolling=True)]
    step = decode_as_one_batch_and_alone(tiny_model, rows, (30, 17, 41, 25))
    assert len(step.pools) == len(rows)  # one pool per layout, stepped as one batch


@pytest.mark.parametrize("rolling", [False, True])
def test_a_quantized_cache_resumes_with_bit_identical_logits(tiny_model, rolling):
    torch.manual_seed(7)
    prompt = torch.randint(0, 128, (1, 60))
    options = dict(heavy=8, recent=6, sink=2, rolling=rolling, **K8V4)
    cache = make_cache(tiny_model, "h2o", **options)
    feed(tiny_model, cache, prompt, 16)
    tensors, info = cache.state()
    resumed = make_cache(tiny_model, "h2o", **options)
    resumed.load_state(tensors, info)
    token = torch.tensor([[5]])
    assert torch.equal(feed(tiny_model, cache, token, 1), feed(tiny_model, resumed, token, 1))
    other = make_cache(tiny_model, "h2o", heavy=8, recent=6, sink=2, rolling=rolling, key_bits=8, value_bits=8)
    with pytest.raises(ValueError, match="cache.value_bits = 4 in the saved state, 8 in this cache"):
        other.load_state(tensors, info)


def quantized_chat(model, tokenizer):
    return ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=16, recent=16, sink=4, **K8V4))


def test_a_quantized_chat_saves_resumes_and_goes_on_as_the_original(smollm, tmp_path):
    model, tokenizer = smollm
    session = quantized_chat(model, tokenizer)
    "".join(session.send("Name three rivers in Europe.", temperature=0, max_new_tokens=20))
    assert session.finish_reason == "length"
    path = save_session(session, tmp_path / "chat.h2o")
    resumed = load_session(path, model, tokenizer, make_cache(model, "h2o", heavy=16, recent=16, sink=4, **K8V4))
    assert_consistent(resumed)
    assert "".join(resumed.send("And one in Asia?", **GREEDY)) == "".join(session.send("And one in Asia?", **GREEDY))


def test_a_session_file_with_wrong_scales_is_refused_by_the_gate(smollm, tmp_path):
    model, tokenizer = smollm
    session = quantized_chat(model, tokenizer)
    "".join(session.send("Hello!", **GREEDY))
    path = save_session(session, tmp_path / "chat.h2o")
    held = session.cache.layers[0].held

    def one_scale_a_slot(tensors):
        tensors["layers.0.keys_scale"] = tensors["layers.0.keys_scale"][..., :1].contiguous()

    fresh = make_cache(model, "h2o", heavy=16, recent=16, sink=4, **K8V4)
    with pytest.raises(InputError) as refused:
        load_session(edited(path, tmp_path, "scales", tensors=one_scale_a_slot), model, tokenizer, fresh)
    assert refused.value.field == f"{TENSORS}: layers.0.keys_scale"
    assert str(refused.value).endswith(f"layers.0.keys_scale is torch.float16 (1, 3, {held}, 1); this cache's "
                                       f"precision stores torch.float16 (1, 3, {held}, 2)")
    assert fresh.seen == 0  # a refused file leaves the cache fresh
    # A file of 8-bit values resumed into a cache of 4-bit values: refused by its settings.
    with pytest.raises(SettingsMismatch, match="cache.value_bits = 4 in the file, 8"):
        load_session(path, model, tokenizer, make_cache(model, "h2o", heavy=16, recent=16, sink=4, key_bits=8,
                                                        value_bits=8))


def test_a_budget_in_bytes_holds_what_it_buys_pins_counted(smollm):
    model, tokenizer = smollm
    per_token = token_bytes(model, KVStorage(8, 4), rolling=False)
    assert per_token == 30 * 3 * (112 + 14)
    budget = 150 * per_token + per_token // 2
    cache = make_cache(model, "h2o", sink=4, budget_bytes=budget, **K8V4)
    assert (cache.policy.heavy, cache.policy.recent) == (73, 73)
    session = ChatSession(model, tokenizer, cache=cache)
    pinned = cache.spans.covered()
    assert pinned > 10  # the system prompt
    assert cache.policy.heavy == 73 - pinned
    "".join(session.send("Tell me about the sea. " * 30, **GREEDY))
    stats = cache.stats()
    assert stats.held == 150 and stats.budget == 150 and stats.held_bytes <= budget
    assert stats.budget_bytes == budget and cache.settings()["budget_bytes"] == budget
    assert cache.settings()["heavy"] == 73  # the settings do not move with the pins


# What a token costs the embedded model's cache at K8/V4, and the budgets from the sink
# plus one token (5) to the model's context (8,192 tokens).
K8V4_TOKEN_BYTES = 11_340
K8V4_ALLOWED = ("must hold from 5 (the sink plus one) to 8,192 (the model's context, max_position_embeddings), "
                "i.e. from {} to {}")


@pytest.mark.parametrize("given, held", [(10_000, 0), (10**9, 88_183), (10**12, 88_183_421)])
def test_a_byte_budget_the_model_cannot_hold_is_refused_naming_the_field_and_the_range(smollm, given, held):
    model, _ = smollm
    with pytest.raises(ConfigError) as refused:
        make_cache(model, "h2o", sink=4, budget_bytes=given, **K8V4)
    assert str(refused.value) == (f"cache.budget_bytes = {given}: holds {held:,} tokens at 11,340 bytes a token; "
                                  + K8V4_ALLOWED.format("56,700 bytes", "92,908,619 bytes"))
    assert refused.value.field == "cache.budget_bytes"
    # The same budget in megabytes, as the config file, the command line and the page give it.
    with pytest.raises(ConfigError) as refused:
        cache_from_config(model, CacheConfig(sink=4, budget_mb=given / 1e6, **K8V4))
    assert str(refused.value) == (f"cache.budget_mb = {given / 1e6!r}: holds {held:,} tokens at 11,340 bytes a "
                                  "token; " + K8V4_ALLOWED.format("0.0567 MB", "92.9086 MB"))
    assert refused.value.field == "cache.budget_mb"


def test_a_byte_budget_of_the_whole_context_is_taken(smollm):
    model, _ = smollm
    for budget in (5 * K8V4_TOKEN_BYTES, 8193 * K8V4_TOKEN_BYTES - 1):
        assert make_cache(model, "h2o", sink=4, budget_bytes=budget, **K8V4).settings()["budget_bytes"] == budget


@pytest.mark.parametrize("value, shown", [
    (float("nan"), "nan"), (float("inf"), "inf"), ("100", "'100'"), (2.5e6, "2500000.0"), (True, "true"),
    (0, "0"), (-1, "-1"), (10**30, "1000000000000000000000000000000"), ([100], "[100]")])
def test_a_byte_budget_that_is_no_whole_number_of_bytes_is_refused_naming_it(tiny_model, value, shown):
    with pytest.raises(ConfigError) as refused:
        make_cache(tiny_model, "h2o", sink=4, budget_bytes=value)
    assert str(refused.value) == (f"cache.budget_bytes = {shown}: must be an integer number of bytes from 1 to "
                                  "1,000,000,000,000 (1,000,000 MB), or null")
    assert refused.value.field == "cache.budget_bytes"


def test_the_sink_beside_a_byte_budget_is_checked_by_name(tiny_model):
    with pytest.raises(ConfigError, match=r"^cache.sink = nan: expected int, got float; must be an integer >= 0$"):
        make_cache(tiny_model, "h2o", sink=float("nan"), budget_bytes=10**6)


def test_other_bits_are_refused_naming_the_field(smollm):
    model, _ = smollm
    with pytest.raises(ConfigError, match="cache.key_bits = 6: must be one of 32, 16, 8, 4"):
        make_cache(model, "h2o", heavy=4, recent=4, key_bits=6)


def test_compiled_dequantize_equals_eager_for_every_layout_without_giving_up(monkeypatch):
    """On CUDA, reads dequantize through ``compiled_dequantize``; whatever the layout of the
    views it is given (a pool of many rows or of one, a cache's own buffers), it must
    decode exactly as the eager arithmetic and never fall back for having compiled too
    many layouts (the compiler's default limit was reached on a GPU). Traced here with
    the eager backend: the same guards and limit, no C++ compiler (which fails in a
    checkout whose path has spaces)."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    codec = GroupQuantCodec(4)
    run = quant.compiled_dequantize("eager")
    for base, index in [((2, 16, 4, 100, 64), (1, slice(0, 12))), ((2, 1, 4, 37, 64), (0, slice(0, 1))),
                        ((1, 2, 4, 57, 64), (0, 1)), ((2, 24, 4, 333, 64), (0, slice(0, 24)))]:
        codes, scale, minimum = (t[index] for t in codec.encode(torch.randn(*base)))
        got = run(codes, scale, minimum, 4, torch.bfloat16)
        assert torch.equal(got, quant.dequantize(codes, scale, minimum, 4, torch.bfloat16)), base
