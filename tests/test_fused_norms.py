"""The model's RMS norms replaced by torch's fused operation (h2o_chat/fused_norms.py):
only where it computes what they compute, and then the model's output is unchanged."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from h2o_chat.engine.attention import ATTENTION_NAME, register_h2o_attention
from h2o_chat.fused_norms import FusedRMSNorm, fuse_rms_norms


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    register_h2o_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=ATTENTION_NAME)
    model = LlamaForCausalLM(config).to(dtype).eval()
    for module in model.modules():  # norms of trained weights rather than all ones
        if isinstance(module, LlamaRMSNorm):
            module.weight.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_with_fused_norms_gives_the_same_logits(dtype):
    plain, fused = tiny_llama(dtype), tiny_llama(dtype)
    assert fuse_rms_norms(fused) == 2 * 2 + 1  # two a layer and the final one
    assert not any(isinstance(m, LlamaRMSNorm) for m in fused.modules())
    assert fused.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(ids).logits, fused(ids).logits
    if dtype == torch.float32:
        assert torch.equal(got, want)  # the same operations in the same order on the CPU
    else:  # one rounding of the norm's output where there were two
        assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_fused_norm_shares_the_models_weight():
    model = tiny_llama(torch.float32)
    weight = model.model.norm.weight
    fuse_rms_norms(model)
    assert isinstance(model.model.norm, FusedRMSNorm) and model.model.norm.weight is weight


def test_an_input_of_another_dtype_than_the_weight_is_normed_as_the_model_would():
    # Some models keep their norms in float32 under bfloat16 activations: the module's own
    # products promote to float32, where the fused operation would give bfloat16.
    norm = LlamaRMSNorm(64)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    holder = torch.nn.ModuleDict({"norm": norm})
    fuse_rms_norms(holder)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = holder["norm"](x)
    assert isinstance(holder["norm"], FusedRMSNorm) and got.dtype == torch.float32
    assert torch.equal(got, norm(x))


def test_a_norm_of_another_formula_keeps_its_own():
    # Gemma scales by 1 + weight: the fused operation would compute something else.
    gemma = GemmaRMSNorm(64)
    torch.nn.init.normal_(gemma.weight)
    holder = torch.nn.ModuleDict({"gemma": gemma, "llama": LlamaRMSNorm(64)})
    assert fuse_rms_norms(holder) == 1
    assert holder["gemma"] is gemma and isinstance(holder["llama"], FusedRMSNorm)


def test_the_app_loads_the_embedded_model_with_fused_norms(smollm):
    model, _ = smollm
    norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    assert not any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, FusedRMSNorm)
                   for m in model.modules())
