"""Random-weight Llamas of real models' shapes, built directly on the device, for the GPU
check (``gpu.py``).

Nothing is downloaded: the weights are drawn by transformers' own initialisation, so speed,
memory and the equality of two code paths can be measured on them, never the quality of
the text they write. The embedded SmolLM2 is used with its real weights only where its
package is installed (its 98 MB GGUF exceeds what travels to the GPU machine).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from h2o_chat.config import ModelConfig
from h2o_chat.engine.attention import ATTENTION_NAME, register_h2o_attention
from h2o_chat.loading import EMBEDDED_PACKAGE, fuse_for_decoding, load_model


@dataclass(frozen=True)
class LlamaShape:
    """The shapes of a Llama-architecture model (its weights are random)."""

    label: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    tied: bool = False  # input and output embeddings share one matrix
    context: int = 131072  # max_position_embeddings
    # Standard deviation of the random weights. transformers' default, 0.02, leaves a
    # narrow model's attention almost uniform, which hides what a cache forgets: the tiny
    # shape draws wider weights so that attention picks tokens out.
    init_std: float = 0.02

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads, max_position_embeddings=self.context,
            tie_word_embeddings=self.tied, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            initializer_range=self.init_std, attn_implementation=ATTENTION_NAME,
        )


# The published configurations of Llama-3.2-1B and Llama-3.1-8B (GQA: 4 query heads per
# KV head), and a tiny one that keeps the check from rotting between GPU runs.
SHAPES = {
    "1b": LlamaShape("Llama-3.2-1B shapes, random weights", layers=16, hidden=2048, intermediate=8192,
                     heads=32, kv_heads=8, tied=True),
    "8b": LlamaShape("Llama-3.1-8B shapes, random weights", layers=32, hidden=4096, intermediate=14336,
                     heads=32, kv_heads=8),
    "tiny": LlamaShape("tiny Llama, random weights", layers=2, hidden=64, intermediate=128, heads=4,
                       kv_heads=2, vocab=128, context=4096, init_std=0.1),
}
SMOLLM2 = "smollm2"  # the embedded model, real weights
MODEL_NAMES = [*SHAPES, SMOLLM2]


def build(shape: LlamaShape, device: torch.device, dtype: torch.dtype = torch.bfloat16,
          seed: int = 0) -> PreTrainedModel:
    """A Llama of ``shape`` with random weights, created on ``device`` in ``dtype`` (an 8B
    model never passes through host memory), using the ``h2o`` attention and, as
    ``load_model`` does, fused norms and projections."""
    register_h2o_attention()
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(shape.config(), dtype=dtype)
    fuse_for_decoding(model)
    return model.eval()


def smollm2_missing() -> str | None:
    """Why the embedded SmolLM2 cannot run here, or None when it can."""
    if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
        return (f"{EMBEDDED_PACKAGE} (the model's 98 MB GGUF) is not installed; it is more than the "
                "64 MiB carried to the GPU machine, so the check runs random weights of real shapes there")
    return None


def load_smollm2(device: torch.device) -> PreTrainedModel:
    """The embedded SmolLM2-135M-Instruct, real weights, in bfloat16 on ``device``."""
    model, _ = load_model(ModelConfig(device=device.type, dtype="bfloat16",
                                      threads=torch.get_num_threads()))  # the run's --threads
    return model
