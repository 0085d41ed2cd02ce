"""The storage-design study (comparison 8b) simulates designs exactly: today's row equals
the engine's own quantized cache, tokens are rounded only when the design says, and the
per-channel rounding keeps its error bound."""

import pytest
import torch

from h2o_chat import make_cache
from h2o_chat.bench.storage_designs import BLOCK, Design, DesignLayer, design_cache, hadamard, slots_at
from h2o_chat.bench.streaming import reference_logprobs, stream_pass


@pytest.mark.parametrize("key_bits", [8, 4])
def test_todays_design_streams_exactly_as_the_engines_quantized_cache(tiny_model, key_bits):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 70))
    ref = reference_logprobs(tiny_model, ids)
    engine = stream_pass(tiny_model, make_cache(tiny_model, "full", key_bits=key_bits, value_bits=4), ids, ref, 4)
    design = stream_pass(tiny_model, design_cache(tiny_model, Design("today", key_bits=key_bits)), ids, ref, 4)
    full = stream_pass(tiny_model, make_cache(tiny_model, "full"), ids, ref, 4)
    torch.testing.assert_close(design[0], engine[0], rtol=1e-5, atol=1e-5)
    assert float((design[0] - full[0]).abs().max()) > 1e-3  # the rounding shows


def test_tokens_in_the_window_or_an_open_block_stay_exact(tiny_model):
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (1, 80))
    ref = reference_logprobs(tiny_model, ids)
    full = stream_pass(tiny_model, make_cache(tiny_model, "full"), ids, ref, 4)[0]
    window = stream_pass(tiny_model, design_cache(tiny_model, Design("w", window=40)), ids, ref, 4)[0]
    channel = stream_pass(tiny_model, design_cache(tiny_model, Design("c", keys="channel")), ids, ref, 4)[0]
    # Entry t predicts token t + 1 after seeing t + 1 tokens.
    torch.testing.assert_close(window[:, :40], full[:, :40], rtol=1e-5, atol=1e-5)
    assert float((window[:, 41:] - full[:, 41:]).abs().max()) > 1e-4
    torch.testing.assert_close(channel[:, :BLOCK], full[:, :BLOCK], rtol=1e-5, atol=1e-5)
    assert float((channel[:, BLOCK:] - full[:, BLOCK:]).abs().max()) > 1e-4


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_per_channel_blocks_round_each_channel_within_half_its_step(bits):
    torch.manual_seed(3)
    keys = torch.randn(2, 3, 2 * BLOCK, 64) * torch.linspace(0.1, 20, 64)  # channels of unlike ranges
    rounded = DesignLayer(Design("c", keys="channel", key_bits=bits))._round_keys(keys)
    blocks, got = keys.unflatten(-2, (-1, BLOCK)), rounded.unflatten(-2, (-1, BLOCK))
    step = (blocks.amax(-2, keepdim=True) - blocks.amin(-2, keepdim=True)) / (2**bits - 1)
    assert bool(((got - blocks).abs() <= step * 0.5 * 1.01 + 1e-3).all())
    assert float((got - blocks).abs().max()) > 0


def test_the_rotation_is_its_own_inverse_and_the_byte_count_adds_up(tiny_model):
    h = hadamard(64, torch.device("cpu"))
    torch.testing.assert_close(h @ h, torch.eye(64), rtol=0, atol=1e-6)
    assert Design("k8", key_bits=8).slot_bytes(64) == 64 + 8 + 32 + 8
    assert Design("c", keys="channel").slot_bytes(64) == Design("t").slot_bytes(64) == 32 + 8 + 32 + 8
    # Fewer bits counted as packed: 24 bytes of codes at 3 bits, 16 at 2.
    assert Design("c3", keys="channel", key_bits=3, value_bits=3).slot_bytes(64) == 24 + 8 + 24 + 8
    assert Design("c2", keys="channel", key_bits=2, value_bits=2).slot_bytes(64) == 16 + 8 + 16 + 8
    # The window's exact tokens (float32 here) come off the budget before any slot.
    assert slots_at(tiny_model, Design("w", window=9), 0.05, 1536) < slots_at(tiny_model, Design("t"), 0.05, 1536)
