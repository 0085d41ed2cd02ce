"""Model families other than Llama, as a user's model.source brings them: tiny random
models saved with the embedded model's tokenizer and loaded by ``load_model``. Each
family either chats exactly as plain transformers would (greedy tokens equal to
``generate`` with eager attention and its own cache, the bounded cache at its budget),
or is refused when it loads, by name and with the reason."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from h2o_chat import ChatSession, load_model, make_cache
from h2o_chat.config import ModelConfig
from h2o_chat.loading import converted_copy_path, embedded_gguf_path

from .helpers import feed

CONTEXT = 4096
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT, bos_token_id=1,
             eos_token_id=2, pad_token_id=2, initializer_range=0.2)
TURNS = ["Hello there, how are you doing today?", "Tell me about the weather in Paris, please."]
REPLY = 12
# Families that chat as plain transformers does, each with what sets it apart.
WORKING = {
    "qwen2": {}, "qwen3": {},  # biased projections; normed queries and keys
    "mistral": dict(sliding_window=None),  # later Mistrals: no window
    "phi3": {}, "olmo2": {}, "cohere": {}, "stablelm": {},
    "gemma": {},  # its own norms (1 + weight)
    "gemma3_text": dict(sliding_window=CONTEXT),  # a window as long as the context never takes effect
    "gpt2": dict(n_inner=128),  # absolute positions
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "gpt_neox": dict(rotary_pct=0.25), "phi": dict(partial_rotary_factor=0.5),  # partial rotary
}


@pytest.fixture(scope="module")
def tokenizer(request):
    """The embedded SmolLM2's tokenizer (a real vocabulary and chat template), from its
    converted copy; the copy is made by loading the model once where it is missing."""
    copy = converted_copy_path(embedded_gguf_path())
    if not copy.is_dir():
        request.getfixturevalue("smollm")
    return AutoTokenizer.from_pretrained(copy)


def saved(tmp_path, tokenizer, model_type: str, weights: bool = True, **extra) -> str:
    """A folder holding a tiny random ``model_type`` and the tokenizer; with ``weights``
    False only its config, enough for a refusal made before weights load."""
    torch.manual_seed(0)
    # head_dim=None: a family that computes it (Falcon) and refuses to be given one.
    shape = {name: value for name, value in (SHAPE | extra).items() if name != "head_dim" or value is not None}
    config = AutoConfig.for_model(model_type, **shape)
    folder = tmp_path / model_type
    if weights:
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def load(folder: str):
    return load_model(ModelConfig(source=folder, dtype="float32"))


def refusal(folder: str, config: str, model_type: str, reason: str) -> str:
    return (f"model.source {folder!r} is a {config} ({model_type}), which h2o-chat cannot run: {reason}. Choose "
            "a model whose layers all attend to the whole context, such as HuggingFaceTB/SmolLM2-135M-Instruct.")


def chat(session: ChatSession) -> list[tuple[list[int], list[int]]]:
    """Each turn's prompt (the tokens before its reply) and greedy reply."""
    turns = []
    for text in TURNS:
        "".join(session.send(text, temperature=0, max_new_tokens=REPLY))
        reply = list(session.reply)
        turns.append((session.tokens[: len(session.tokens) - len(reply)], reply))
    return turns


@pytest.mark.parametrize("model_type", WORKING)
def test_a_family_chats_as_plain_transformers_does(tmp_path, tokenizer, model_type):
    folder = saved(tmp_path, tokenizer, model_type, **WORKING[model_type])
    model, tokenizer = load(folder)  # fused norms and projections where they apply
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    session = ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=1024, recent=1024, sink=4))
    for prompt, reply in chat(session):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(reply))
        assert expected[0, len(prompt):].tolist() == reply
    ids = torch.tensor([session.tokens])
    with torch.no_grad():
        # float32 rounding, not the cache: the fused norms and stacked projections sum in
        # another order than eager transformers, and how much that moves a logit depends
        # on the CPU's matrix kernels (1.2e-5 on an AMD EPYC, within 1e-5 on an Intel Xeon).
        torch.testing.assert_close(feed(model, make_cache(model, "full"), ids, 16), reference(ids).logits,
                                   atol=1e-4, rtol=1e-4)
    bounded = ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=8, recent=8, sink=4))
    chat(bounded)
    stats = bounded.stats().cache
    assert stats.seen > 2 * stats.budget and all(layer.held == stats.budget for layer in stats.layers)


@pytest.mark.parametrize("model_type, extra, config, reason", [
    ("mistral", dict(sliding_window=16), "MistralConfig",
     "2 of its 2 layers attend only to the last 16 tokens (a sliding window) of a 4,096-token context"),
    ("gemma2", dict(sliding_window=16), "Gemma2Config",
     "1 of its 2 layers attend only to the last 16 tokens (a sliding window) of a 4,096-token context"),
    ("gemma3_text", dict(sliding_window=512, layer_types=["sliding_attention", "full_attention"]),
     "Gemma3TextConfig",
     "1 of its 2 layers attend only to the last 512 tokens (a sliding window) of a 4,096-token context"),
])
def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path, tokenizer, model_type, extra, config,
                                                              reason):
    # The window's mask hid old slots, which the cache took for padding: the first long
    # enough turn failed with "padded batches are not supported".
    folder = saved(tmp_path, tokenizer, model_type, weights=False, **extra)
    with pytest.raises(ValueError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, config, model_type, reason + (
        "; the H2O cache keeps tokens from the whole conversation for every layer and cannot give a layer its window"))


OWN_CODE = "computes attention in its own code, not through transformers' attention functions, so the cache would never see the attention scores H2O evicts by"


@pytest.mark.parametrize("model_type, extra, config, reason", [
    # Their attention never calls the h2o function: CodeGen replied wrong tokens, Bloom and
    # MPT failed in their first forward, GPT-J and GPT-Neo at load with KeyError: 'h2o'.
    ("codegen", dict(rotary_dim=8, n_positions=CONTEXT), "CodeGenConfig", f"CodeGenForCausalLM {OWN_CODE}"),
    ("bloom", {}, "BloomConfig", f"BloomForCausalLM {OWN_CODE}"),
    ("falcon", dict(head_dim=None), "FalconConfig", f"FalconForCausalLM {OWN_CODE}"),
    ("gptj", dict(rotary_dim=8, n_positions=CONTEXT), "GPTJConfig", f"GPTJForCausalLM {OWN_CODE}"),
    ("mpt", dict(d_model=64, n_heads=4, n_layers=2), "MptConfig", f"MptForCausalLM {OWN_CODE}"),
    # Recurrent or state-space layers: RecurrentGemma replied wrong tokens, Jamba failed.
    ("recurrent_gemma", {}, "RecurrentGemmaConfig",
     "it has linear_attention layers, which keep a state other than one key and value per token, the slots H2O evicts"),
    ("jamba", {}, "JambaConfig",
     "it has linear_attention layers, which keep a state other than one key and value per token, the slots H2O evicts"),
    # A hub id of an encoder-decoder whose decoder alone is a causal LM (facebook/bart-base).
    ("bart", dict(is_encoder_decoder=True), "BartConfig",
     "it is an encoder-decoder model, and h2o-chat runs decoder-only ones"),
])
def test_a_family_the_cache_cannot_serve_is_refused_before_its_weights_load(tmp_path, tokenizer, model_type, extra,
                                                                             config, reason):
    folder = saved(tmp_path, tokenizer, model_type, weights=False, **extra)
    with pytest.raises(ValueError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, config, model_type, reason)


@pytest.mark.parametrize("model_type, extra, config, reason", [
    # Gemma 2's soft-capped logits: its window as long as the context, it replied other
    # tokens than transformers from the third turn on (logits 0.4 apart).
    ("gemma2", dict(sliding_window=CONTEXT, attn_logit_softcapping=50.0), "Gemma2Config",
     "its attention soft-caps the logits (softcap=50.0), which the H2O attention does not compute"),
    ("gpt_oss", dict(sliding_window=CONTEXT, num_local_experts=4, num_experts_per_tok=2), "GptOssConfig",
     "its attention adds learned attention sinks (s_aux), which the H2O attention does not compute"),
    # Multi-head latent attention caches one compressed latent a token: scoring it failed.
    ("deepseek_v3", dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                         moe_intermediate_size=32, n_group=1, topk_group=1), "DeepseekV3Config",
     "layer 0 caches keys and values of (heads, dim) (1, 16) and (1, 8) but its attention reads (4, 16) and (4, 16) "
     "(compressed latents, as in multi-head latent attention); H2O must evict the keys and values attention scores"),
    # The decoder of an encoder-decoder: 12 decoder layers beside num_hidden_layers 2 (the
    # encoder's); the cache had a layer for each of 2 and failed with IndexError.
    ("bart", {}, "BartConfig",
     "12 attention calls reached transformers' attention functions in a forward over its 2 layers, one a layer "
     "is what the H2O cache scores and evicts by"),
])
def test_an_attention_h2o_does_not_compute_is_refused_at_load(tmp_path, tokenizer, model_type, extra, config,
                                                               reason):
    folder = saved(tmp_path, tokenizer, model_type, **extra)
    with pytest.raises(ValueError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, config, model_type, reason)


@pytest.mark.parametrize("model_type, extra, model_class, reason", [
    # Partial rotary: the shift failed mid-turn on a tensor size mismatch.
    ("gpt_neox", dict(rotary_pct=0.25), "GPTNeoXForCausalLM",
     "cannot serve GPTNeoXForCausalLM: its rotary position embedding rotates 4 of each head's 16 dimensions "
     "(partial rotary), and the cache moves keys by rotating halves of the whole head"),
    # Interleaved pairs: the shift ran, misplacing every moved key.
    ("cohere", {}, "CohereForCausalLM",
     "cannot serve CohereForCausalLM: its rotary position embedding pairs the dimensions of a head otherwise than "
     "in two halves (e.g. interleaved), and the cache moves keys by rotating halves of the whole head"),
    ("gemma3_text", dict(sliding_window=CONTEXT), "Gemma3ForCausalLM",
     "cannot serve Gemma3ForCausalLM: its rotary position embeddings use other frequencies in each kind of layer, "
     "and the cache moves every layer's keys by one set"),
    ("gpt2", dict(n_inner=128), "GPT2LMHeadModel",
     "needs a model with rotary position embeddings (RoPE); GPT2LMHeadModel has none"),
])
def test_rolling_positions_are_refused_by_name_where_keys_cannot_be_moved(tmp_path, tokenizer, model_type, extra,
                                                                          model_class, reason):
    model, _ = load(saved(tmp_path, tokenizer, model_type, **extra))
    with pytest.raises(ValueError) as refused:
        make_cache(model, "h2o", heavy=8, recent=8, sink=4, rolling=True)
    assert str(refused.value) == f"position rolling (cache.rolling) {reason}"


def test_rolling_positions_chat_within_budget_where_the_rotary_is_rotate_half(tmp_path, tokenizer):
    model, tokenizer = load(saved(tmp_path, tokenizer, "phi3"))
    session = ChatSession(model, tokenizer, cache=make_cache(model, "h2o", heavy=8, recent=8, sink=4, rolling=True))
    chat(session)
    stats = session.stats().cache
    assert stats.seen > 2 * stats.budget and all(layer.held == stats.budget for layer in stats.layers)
