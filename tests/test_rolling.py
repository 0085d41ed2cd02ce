"""Position rolling: cached keys live at their rank in the cache, queries right after."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from h2o_chat import make_cache
from h2o_chat.engine.attention import ATTENTION_NAME
from h2o_chat.engine.rope import RopeShifter

from .helpers import BOOK_EXCERPT, feed


@pytest.fixture(scope="module")
def one_layer_mqa():
    """One layer and one KV head: a layer-0 key depends only on its token and position, so
    a rolled cache must equal a fresh run over just the kept tokens at positions 0..n."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
        attn_implementation=ATTENTION_NAME,
    )
    return LlamaForCausalLM(config).eval()


def test_shift_equals_rotating_at_the_new_position(tiny_model):
    rotary = tiny_model.model.rotary_emb
    x = torch.randn(1, 2, 5, 16)
    positions = torch.tensor([[3, 10, 200, 1000, 5000]])
    target = torch.tensor([[0, 1, 2, 3, 4]])

    def rotated(at):
        cos, sin = rotary(x, at)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    moved = RopeShifter.from_model(tiny_model).shift(rotated(positions), (target - positions)[:, None, :])
    torch.testing.assert_close(moved, rotated(target), rtol=1e-4, atol=1e-4)


def test_rolling_changes_nothing_before_the_first_eviction(tiny_model):
    ids = torch.randint(0, 128, (1, 60))
    absolute = feed(tiny_model, make_cache(tiny_model, "h2o", heavy=64, recent=64), ids, 16)
    rolled = feed(tiny_model, make_cache(tiny_model, "h2o", rolling=True, heavy=64, recent=64), ids, 16)
    torch.testing.assert_close(rolled, absolute, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy, budgets", [("h2o", dict(heavy=6, recent=4, sink=1)), ("sink", dict(sink=2, recent=6))])
def test_rolled_cache_equals_a_fresh_run_over_the_kept_tokens(one_layer_mqa, policy, budgets):
    model = one_layer_mqa
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (1, 60))
    for rolling in (True, False):
        cache = make_cache(model, policy, rolling=rolling, **budgets)
        feed(model, cache, ids[:, :20], 20)
        mismatches = 0
        for t in range(20, 60):
            kept = cache.stats().layers[0].positions[0, 0].tolist()
            logits = feed(model, cache, ids[:, t : t + 1], 1)[0, -1]
            with torch.no_grad():
                fresh = model(ids[:, kept + [t]]).logits[0, -1]
            if rolling:
                torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
            else:
                mismatches += not torch.allclose(logits, fresh, rtol=1e-4, atol=1e-4)
        if not rolling:
            assert mismatches > 30  # absolute positions: the kept tokens keep their gaps


def test_rolling_is_refused_without_rope():
    class NoRope(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="rotary"):
        RopeShifter.from_model(NoRope())


def rotary_positions(model, cache, raw_keys: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Read, from the cached vectors themselves, the RoPE position each key of ``layer``
    was rotated to: the p in [0, seen) for which the token's unrotated key ``raw_keys[t]``
    (kv_heads, head_dim) rotated by the model's own rotary embedding at p is closest to
    the cached key. Returns (token positions, rotary positions), each (kv_heads, held),
    and asserts that every match is exact, so the answer cannot be a near miss."""
    cached = cache.layers[layer]
    tokens = cached.positions[0]  # (kv_heads, held)
    unrotated = raw_keys[tokens, torch.arange(tokens.shape[0])[:, None]]  # (kv_heads, held, head_dim)
    candidates = torch.arange(cached.seen)[None]
    cos, sin = model.model.rotary_emb(unrotated, candidates)  # (1, seen, head_dim)
    rotated = unrotated[:, :, None] * cos[0] + rotate_half(unrotated)[:, :, None] * sin[0]
    distance = (rotated - cached.keys[0][:, :, None].float()).norm(dim=-1)  # (kv_heads, held, seen)
    best = distance.min(dim=-1)
    assert bool((best.values <= 1e-3 * cached.keys[0].float().norm(dim=-1)).all())
    return tokens, best.indices


def test_rolling_keeps_real_model_rotary_positions_inside_the_cache(smollm):
    """Real model, real text, 4x longer than a 64-slot cache. A quality test past the
    model's 8192-token trained context needs 8k+ tokens of streaming, minutes on a CPU:
    that is the benchmark (python -m h2o_chat.bench rolling). What a test can check
    cheaply is the mechanism the quality rests on, read off the cached key vectors rather
    than the engine's bookkeeping: with rolling no key is rotated past budget + chunk
    whatever the text length; without it, keys keep their token positions."""
    model, tokenizer = smollm
    text = BOOK_EXCERPT.read_text(encoding="utf-8")[:4000]
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids[:256]])
    budget, chunk = 64, 16
    layer = model.model.layers[0]
    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    for rolling in (True, False):
        # The attention's input, projected to keys here: the model's own projection runs
        # stacked with the queries' and values' (fused_projections.py).
        inputs = []
        hook = layer.input_layernorm.register_forward_hook(lambda mod, args, out: inputs.append(out[0].detach()))
        try:
            cache = make_cache(model, "h2o", rolling=rolling, heavy=30, recent=30, sink=4)
            feed(model, cache, ids, chunk)
        finally:
            hook.remove()
        with torch.no_grad():
            raw_keys = layer.self_attn.k_proj(torch.cat(inputs)).float().view(-1, kv_heads, head_dim)
        tokens, rotary = rotary_positions(model, cache, raw_keys)
        assert cache.seen == 256 and tokens.shape[-1] == budget
        if rolling:
            # Each key at its rank among the kept tokens (older first): 0 .. held - 1.
            rank = tokens.argsort(dim=-1).argsort(dim=-1)
            assert torch.equal(rotary, rank) and int(rotary.max()) < budget + chunk
        else:
            assert torch.equal(rotary, tokens) and int(rotary.max()) == 255
