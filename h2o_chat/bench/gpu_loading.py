"""The model-loading branches of the GPU check: a small random Llama saved as a model folder
(safetensors and a word-level tokenizer, both made here) is loaded back through the app's
own ``load_model`` with each placement this device allows: ``cpu`` anywhere; on CUDA
``cuda``, ``auto`` (accelerate's ``device_map``) and, where bitsandbytes is installed,
8-bit and 4-bit weights. Each loaded model decodes through an evicting h2o cache; unquantized
ones must give the logits of the model they were saved from.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from h2o_chat.config import ModelConfig
from h2o_chat.engine.build import make_cache
from h2o_chat.loading import load_model

from . import gpu_models
from .gpu_checks import FLOOR, Check, attempt, h2o_budgets, logits_gap, random_ids

PROMPT, STEPS, SLOTS = 48, 8, 24  # the loaded models read past their budget


def placements(device: torch.device) -> list[tuple[str, str | None, str | None]]:
    """(model.device, model.quantization, why it cannot run here or None) for each branch."""
    if device.type != "cuda":
        return [("cpu", None, None)]
    bnb = None if importlib.util.find_spec("bitsandbytes") else "bitsandbytes is not installed"
    accelerate = None if importlib.util.find_spec("accelerate") else "accelerate is not installed"
    return [("cuda", None, None), ("auto", None, accelerate), ("cuda", "8bit", bnb), ("cuda", "4bit", bnb)]


def save_folder(model, folder: Path) -> None:
    """``model`` and a tokenizer of one word per token id, as a Hugging Face model folder."""
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1").save_pretrained(folder)
    model.save_pretrained(folder)


def _decode(model, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Logits of the last of ``STEPS`` teacher-forced tokens after the prompt, through an
    h2o cache of ``SLOTS`` slots, and the slots it holds then."""
    cache = make_cache(model, "h2o", **h2o_budgets(SLOTS))
    with torch.inference_mode():
        model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True)
        for token in ids[:, PROMPT:].split(1, dim=1):
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
    return logits, cache.stats().held


def run(device: torch.device) -> tuple[list[Check], list[dict]]:
    """A check per placement that ran, and every placement with why it did or did not."""
    source = gpu_models.build(gpu_models.SHAPES["tiny"], device)
    ids = random_ids(source, PROMPT + STEPS, device, seed=13)
    want, _ = _decode(source, ids)
    checks, branches = [], []
    with tempfile.TemporaryDirectory(prefix="h2o-gpu-check-") as folder:
        save_folder(source, Path(folder))
        for place, quantization, why_not in placements(device):
            name = f"model.device {place}" + (f", model.quantization {quantization}" if quantization else "")
            branches.append({"branch": name, "ran": why_not is None, "why_not": why_not})
            if why_not:
                continue
            title = f"loads and decodes: {name}"
            check, failure = attempt(title, lambda: _loads_and_decodes(folder, place, quantization, ids, want, title))
            checks.append(check or failure)
    return checks, branches


def _loads_and_decodes(folder: str, place: str, quantization: str | None, ids: torch.Tensor, want: torch.Tensor,
                       title: str) -> Check:
    model, _ = load_model(ModelConfig(source=folder, device=place, dtype="bfloat16", quantization=quantization,
                                      threads=torch.get_num_threads()))  # the run's --threads
    got, held = _decode(model, ids.to(model.device))
    gap = logits_gap(got.to(want.device), want)
    finite = bool(torch.isfinite(got).all())
    # Quantized weights change the logits; they must still be numbers, with the cache bounded.
    passed = finite and held == SLOTS and (quantization is not None or gap <= FLOOR)
    return Check(title, passed,
                 f"logit gap {gap:.4f} from the saved model" + ("" if quantization else f" (at most {FLOOR:g})")
                 + f", {held} of {SLOTS} slots held after {PROMPT + STEPS} tokens",
                 {"gap": gap, "held": held, "finite": finite})
