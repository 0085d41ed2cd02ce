"""A layer's projections stacked into one product each and queries and keys rotated at
once (h2o_chat/fused_projections.py): only where the fused forms compute what the
modules compute, and then the model's output and the engine's choices are unchanged."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from h2o_chat import make_cache
from h2o_chat.engine.attention import ATTENTION_NAME, register_h2o_attention
from h2o_chat.engine.step import DecodeStep
from h2o_chat.fused_projections import FusedAttention, FusedMLP, fuse_projections
from h2o_chat.loading import own_weights_for_decoding

from .helpers import feed

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation=ATTENTION_NAME)


def tiny(model_class=LlamaForCausalLM, config_class=LlamaConfig, dtype=torch.float32, **extra):
    register_h2o_attention()
    torch.manual_seed(0)
    model = model_class(config_class(**SHAPE | extra)).to(dtype).eval()
    for name, parameter in model.named_parameters():  # biases and norms of trained weights, not zeros and ones
        if not name.endswith("proj.weight") and "embed" not in name:
            parameter.data.uniform_(-0.5, 1.5)
    return model


def logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


IDS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bias", [False, True])
def test_a_llama_with_fused_projections_gives_the_same_logits(bias):
    plain, fused = tiny(attention_bias=bias, mlp_bias=bias), tiny(attention_bias=bias, mlp_bias=bias)
    keys, count = plain.state_dict().keys(), sum(p.numel() for p in plain.parameters())
    assert fuse_projections(fused) == (2, 2)
    assert [type(layer.self_attn) for layer in fused.model.layers] == [FusedAttention] * 2
    assert [type(layer.mlp) for layer in fused.model.layers] == [FusedMLP] * 2
    # The same keys and parameters: the state dict saves what it saved, the weights held once.
    assert fused.state_dict().keys() == keys and sum(p.numel() for p in fused.parameters()) == count
    assert torch.equal(logits(fused, IDS), logits(plain, IDS))  # the same sums in float32 on the CPU


def test_in_bfloat16_the_logits_stay_within_rounding():
    plain, fused = tiny(dtype=torch.bfloat16), tiny(dtype=torch.bfloat16)
    fuse_projections(fused)
    want, got = logits(plain, IDS).float(), logits(fused, IDS).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_each_projection_weight_is_a_view_of_the_stacked_one():
    model = tiny()
    own_weights_for_decoding(model)  # column-major on the CPU: the stacked weight stays so
    attention = model.model.layers[0].self_attn
    q, k, v = (attention.q_proj.weight.clone(), attention.k_proj.weight.clone(), attention.v_proj.weight.clone())
    fuse_projections(model)
    fused = model.model.layers[0].self_attn
    stacked = fused.qkv_weight
    assert stacked.stride() == (1, stacked.shape[0])
    for linear, was in zip((fused.q_proj, fused.k_proj, fused.v_proj), (q, k, v)):
        assert linear.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        assert torch.equal(linear.weight, was)
    mlp = model.model.layers[0].mlp
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()


def test_the_engine_keeps_and_generates_the_same_with_fused_projections():
    plain, fused = tiny(num_hidden_layers=3), tiny(num_hidden_layers=3)
    fuse_projections(fused)
    prompt = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    runs = {}
    for name, model in (("plain", plain), ("fused", fused)):
        cache = make_cache(model, "h2o", heavy=8, recent=6, sink=2)
        out = [feed(model, cache, prompt, 16)]
        for _ in range(30):
            out.append(feed(model, cache, out[-1][:, -1:].argmax(-1), 1))
        runs[name] = (torch.cat(out, 1), [layer.positions.tolist() for layer in cache.stats().layers])
    assert torch.equal(runs["fused"][0], runs["plain"][0])
    assert runs["fused"][1] == runs["plain"][1]


@pytest.mark.parametrize("family, window", [((MistralForCausalLM, MistralConfig), 4096),
                                            ((Qwen2ForCausalLM, Qwen2Config), None)])
def test_llamas_copies_that_pass_a_sliding_window_are_fused_and_pass_it_on(family, window):
    # Llama's attention code plus the window argument, read from the config (Mistral) or
    # the module (Qwen2, whose projections carry biases).
    plain, fused = tiny(*family), tiny(*family)
    assert fuse_projections(fused) == (2, 2)
    assert [layer.self_attn.extras for layer in fused.model.layers] == [{"sliding_window": window}] * 2
    assert torch.equal(logits(fused, IDS), logits(plain, IDS))


def test_an_attention_of_other_code_keeps_its_own():
    # Qwen3 norms its queries and keys before rotating them; its MLP is Llama's.
    plain, fused = tiny(Qwen3ForCausalLM, Qwen3Config), tiny(Qwen3ForCausalLM, Qwen3Config)
    assert fuse_projections(fused) == (0, 2)
    assert torch.equal(logits(fused, IDS), logits(plain, IDS))


def test_an_mlp_of_another_activation_is_fused_with_it():
    # Gemma: Llama's attention and MLP code with a GELU; its norms are its own.
    plain, fused = tiny(GemmaForCausalLM, GemmaConfig), tiny(GemmaForCausalLM, GemmaConfig)
    assert fuse_projections(fused) == (2, 2)
    assert torch.equal(logits(fused, IDS), logits(plain, IDS))


def test_a_module_whose_probe_differs_keeps_its_own():
    # Llama's forward and shapes, but the rotation of the other layout (interleaved pairs):
    # only the probe can tell.
    class InterleavedAttention(LlamaAttention):
        pass

    InterleavedAttention.forward = LlamaAttention.forward
    model = tiny(num_hidden_layers=1)
    attention = model.model.layers[0].self_attn
    odd = InterleavedAttention(model.config, 0)
    odd.load_state_dict(attention.state_dict())
    weight = odd.q_proj.weight
    holder = torch.nn.ModuleDict({"attention": odd, "mlp": LlamaMLP(model.config)})

    def rotate_pairs(q, k, cos, sin, unsqueeze_dim=1):  # the interleaved layout's rotation
        def rotate(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    import transformers.models.llama.modeling_llama as modeling_llama
    original = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = rotate_pairs
    try:
        assert fuse_projections(holder) == (0, 1)
    finally:
        modeling_llama.apply_rotary_pos_emb = original
    assert holder["attention"] is odd and odd.q_proj.weight is weight


def test_quantized_or_mixed_projections_are_left_alone():
    model = tiny(num_hidden_layers=1)
    attention = model.model.layers[0].self_attn
    attention.v_proj.weight.data = attention.v_proj.weight.data.double()
    assert fuse_projections(model) == (0, 1)
    assert model.model.layers[0].self_attn is attention


def test_the_app_loads_the_embedded_model_with_fused_projections(smollm):
    model, _ = smollm
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, FusedAttention) for m in model.modules()) == layers
    assert sum(isinstance(m, FusedMLP) for m in model.modules()) == layers
    # A decode step runs four products a layer (q/k/v, output, gate/up, down) and the head's.
    caches = [make_cache(model, "h2o", heavy=8, recent=8, sink=4) for _ in range(2)]
    step = DecodeStep()
    with torch.inference_mode():
        for index, cache in enumerate(caches):
            feed(model, cache, torch.tensor([[1, 2, 3 + index] * 10]), 30)
            cache.fit_for_decoding()
        step(model, caches, [5, 6])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, caches, [7, 8])
    products = [e for e in prof.events() if e.name == "aten::linear" and e.cpu_parent is None]
    assert len(products) == 4 * layers + 1
