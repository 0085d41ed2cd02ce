"""The decode step through its Triton kernels (fused attention reading floats and codes,
the eviction's choice) against the same step through torch's operations: batches of
unlike rows, run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, under which
``kernels.load`` serves the kernels there). On a GPU the GPU check compares the kernels'
step with each row alone (`python -m h2o_chat.bench gpu`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

# A float16 tiny Llama (the kernels take half precision), fused as the app loads it or
# not; rows unlike in every way the kernels see: float, K4/V4 with an exact window, pins
# in the middle, a turns policy's row, a mean ranking, a sink row (unscored: its
# attention is sdpa's, its eviction the kernel's), past their budgets. The same token is
# fed to both runs at every step, whatever they would draw.
PROGRAM = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from h2o_chat import make_cache
from h2o_chat.engine import kernels
from h2o_chat.engine.attention import ATTENTION_NAME
from h2o_chat.engine.step import DecodeStep
from h2o_chat.fused_norms import fuse_rms_norms
from h2o_chat.fused_projections import fuse_projections
from h2o_chat.scheduler import forward_one

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     attn_implementation=ATTENTION_NAME)
model = LlamaForCausalLM(config).eval().half()
if sys.argv[2] == "fused":  # as load_model gives it: queries cut from the stacked projection
    assert fuse_rms_norms(model) == 7 and fuse_projections(model) == (3, 3)
rows = [dict(policy="h2o", heavy=8, recent=6, sink=2, key_bits=4, value_bits=4, exact_window=4),
        dict(policy="turns", heavy=10, recent=4, sink=2),
        dict(policy="h2o", heavy=6, recent=8, sink=2, score_norm="mean", key_bits=4, value_bits=4),
        dict(policy="sink", sink=2, recent=12)]
generator = torch.Generator().manual_seed(1)
caches = []
with torch.inference_mode():
    for index, row in enumerate(rows):
        cache = make_cache(model, **row)
        cache.protect(10, 14)
        cache.mark_turn(20)
        ids = torch.randint(0, 128, (1, 30 + 7 * index), generator=generator)
        for piece in ids.split([20, ids.shape[1] - 20], dim=1):  # as the app feeds turns: none straddled
            forward_one(model, cache, piece)
        cache.fit_for_decoding()
        caches.append(cache)
    step, logits = DecodeStep(graphs=False), []
    for _ in range(24):
        logits.append(step(model, caches, torch.randint(0, 128, (len(rows),), generator=generator).tolist()).float())
assert caches[1].turns.opened == 20  # the turns row's first turn closed: its slots score no more
kept = [[layer.positions.tolist() for layer in cache.stats().layers] for cache in caches]


def scores_by_position(layer):
    held = layer.held_slots()
    order = held["positions"].argsort(dim=-1)
    return held["scores"].gather(-1, order).tolist()


scores = [[scores_by_position(layer) for layer in cache.layers] for cache in caches]
fused = [kernels.load(name, torch.device("cpu")) is not None for name in ("decode_kernel", "evict_kernel")]
json.dump({"logits": torch.stack(logits).tolist(), "kept": kept, "scores": scores, "fused": fused},
          open(sys.argv[1], "w"))
"""


def run(tmp_path: Path, interpret: bool, form: str) -> dict:
    out = tmp_path / f"{interpret}-{form}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | ({"TRITON_INTERPRET": "1"} if interpret else {})
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(out), form], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("form", ["fused", "plain"])
def test_the_step_through_its_kernels_equals_the_step_through_torch(tmp_path, form) -> None:
    import torch

    kernels, reference = run(tmp_path, True, form), run(tmp_path, False, form)
    assert kernels["fused"] == [True, True] and reference["fused"] == [False, False]
    # float16 throughout: the two paths round differently (0.0014 here), by less than a
    # wrong slot moves the logits (reading the window's newest tokens from their 4-bit
    # codes instead of exact: 0.0078; the new token from its slot: 0.096).
    gap = (torch.tensor(kernels["logits"]) - torch.tensor(reference["logits"])).abs().max().item()
    assert gap < 0.004, gap
    assert kernels["kept"] == reference["kept"]
    for row in range(4):  # the scores the rule ranked, slot by slot in position order
        for layer in range(3):
            torch.testing.assert_close(torch.tensor(kernels["scores"][row][layer]),
                                       torch.tensor(reference["scores"][row][layer]), atol=2e-3, rtol=1e-3)
