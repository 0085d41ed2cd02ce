"""Correctness of the engine on the device the GPU check runs on (``gpu.py``).

- **the tolerance** (a measurement, no verdict): how far bfloat16 rounding alone moves
  this model's logits, measured against the same weights cast to float32; two bfloat16
  paths must agree within a few times that.
- **h2o equals sdpa**: an h2o cache whose budget exceeds the context never evicts, so its
  logits (explicit float32 softmax, scores kept) must equal the full cache's (the fused
  sdpa kernel) within that tolerance, prompt chunks and decode steps alike.
- **batched rows equal each row alone**: conversations of different lengths, policies,
  pins, rolling and storage precisions decoding as one batch (``DecodeStep``, what the
  scheduler runs, captured as a CUDA graph on a GPU) against each decoding alone
  (``forward_one``) from copies of the same caches: logits within the tolerance, and the
  same kept positions but for a stated share of near-tied (layer, row, KV head) sets.
- **a captured step equals an eager one**: the same rows stepped as a replayed CUDA graph
  with rows padded (on a CPU: padded, not captured) and eagerly without padding.
- **kept positions equal the CPU rule**: a cache holds its eviction, its scores and slots
  are copied to the CPU, the CPU evicts them (``evict_slots``) and the device evicts its
  own: every layer, row and KV head must keep the same positions, for a prompt chunk (the
  sorting path) and a decode step (the sort-free ``drop_one``).
- **the fused decode attention equals the reference**: the decode step's scored
  attention (``attention.scored_decode``, one Triton kernel on a GPU) against
  ``scored_attention`` in float32 on the same inputs, rows of unlike lengths: outputs and
  each slot's received mass, for slots held as floats and as 8-bit keys and 4-bit values
  (read as codes by the kernel) with the exact window over the newest;
- **seeded draws on the device equal the host's**: the same logits drawn from on the
  device and on the CPU by seeded rows (peaked and flat, top-p below 1 and at 1, so
  every way a draw goes), at a few indices of a reply: a seed's noise is a hash of
  integers, so only the softmax's rounding may move a token (a near tie). No verdict
  where the device is the CPU.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from h2o_chat.config import GenerationConfig
from h2o_chat.engine.attention import fused_decode_kernel, scored_attention, scored_decode
from h2o_chat.engine.build import cache_for_policy, make_cache
from h2o_chat.engine.budget import split_slots
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.policies import make_policy
from h2o_chat.engine.slots import evict_slots
from h2o_chat.engine.step import DecodeStep
from h2o_chat.engine.stored import StoredSlots
from h2o_chat.engine.window import window_name
from h2o_chat.sampling import Draw, Sampling, draw_tokens
from h2o_chat.scheduler import forward_one

# Two code paths in bfloat16 may each stray from the exact logits as far as rounding
# moves them (measured against the same weights in float32, ``rounding_noise``): they must
# agree within this many times that, and never less than FLOOR. A wrong mask or a
# forgotten token moves the logits many times further (tens of times on the tiny model).
NOISE_FACTOR = 3.0
FLOOR = 1e-3
SINK = 4
# Share of (layer, row, KV head) sets whose kept positions may differ between two paths
# in bfloat16: rounding flips near-tied scores (none may differ in float32).
NEAR_TIES = 0.02
# The fused decode attention against float32: its outputs are rounded to the model's
# dtype (a relative 2**-8 in bfloat16) and its value products take bfloat16
# probabilities; the received mass stays float32 throughout.
FUSED_OUTPUT_GAP = 0.01
FUSED_MASS_GAP = 1e-4
# Share of seeded draws that must be the same on the device as on the host: the two round
# the softmax differently, which may flip a near tie between two tokens (none expected).
SAME_DRAWS = 0.99
# Rows of logits the seeded draws are compared over (the first quarter of them flat), and
# the indices of a reply drawn at: the host's draws over a 128k vocabulary take seconds.
DRAW_ROWS, DRAW_INDICES = 64, 4
# Characters of an error's message a failed check keeps (a CUDA out-of-memory one runs long).
MESSAGE_CHARS = 400

T = TypeVar("T")
# The checks' names, which a check that raised keeps.
SDPA = "h2o (budget above the context) equals sdpa"
BATCHED = "batched rows equal each row alone"
CAPTURED = "a captured step equals an eager one"
POSITIONS = "kept positions equal the CPU rule for the same scores"
FUSED = "the fused decode attention equals the reference"
DRAWS = "seeded draws on the device equal the host's"


@dataclass
class Check:
    name: str
    passed: bool | None  # None: a measurement, with no verdict
    measured: str  # the figures the verdict rests on, in words
    details: dict = field(default_factory=dict)


def attempt(name: str, work: Callable[[], T]) -> tuple[T | None, Check | None]:
    """``work()``'s value, or None and a failed check ``name`` saying what it raised and
    where. A GPU run has the few minutes of a lent machine: one part's error (a kernel that
    does not build there, a library's missing branch) must not cost every part after it.
    The check keeps text only, never the traceback, whose frames would keep the failed
    part's caches allocated."""
    try:
        return work(), None
    except Exception as error:  # reported as a failed check: the run's verdict fails
        where = traceback.extract_tb(error.__traceback__)[-1]
        message = str(error)[:MESSAGE_CHARS]
        return None, Check(name, False, f"raised {type(error).__name__}: {message} "
                                        f"({Path(where.filename).name}:{where.lineno}, in {where.name})",
                           {"error": type(error).__name__, "traceback": "".join(traceback.format_exception(error))})


def logits_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference of ``got`` from ``want``, relative to ``want``'s largest
    absolute logit."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def random_ids(model, length: int, device: torch.device, seed: int, rows: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(model.config.vocab_size, (rows, length), generator=generator).to(device)


def h2o_budgets(slots: int) -> dict[str, int]:
    """h2o's sink, heavy and recent for ``slots`` slots: the engine's even split."""
    return split_slots("h2o", slots, SINK)


def _logits(model, cache, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits


@contextmanager
def parameters_in(model, dtype: torch.dtype) -> Iterator[None]:
    """The model's parameters cast to ``dtype`` while inside, then back (bfloat16 to float32
    and back is exact). Buffers such as RoPE frequencies keep their own dtype."""
    original = {param: param.dtype for param in model.parameters()}
    with torch.no_grad():
        for param in original:
            param.data = param.data.to(dtype)
        try:
            yield
        finally:
            for param, param_dtype in original.items():
                param.data = param.data.to(param_dtype)


def _pieces(ids: torch.Tensor, context: int, chunk: int) -> list[torch.Tensor]:
    """The first ``context`` tokens in chunks, then one token at a time."""
    return list(ids[:, :context].split(chunk, dim=1)) + list(ids[:, context:].split(1, dim=1))


def rounding_noise(model, ids: torch.Tensor, context: int, chunk: int) -> float:
    """How far the model's own dtype moves its logits (full cache, sdpa) from the same
    weights in float32, as ``logits_gap`` over ``ids`` fed as ``_pieces``."""
    pieces = _pieces(ids, context, chunk)
    with torch.inference_mode():
        cache = make_cache(model, "full")
        low = [_logits(model, cache, piece) for piece in pieces]
        with parameters_in(model, torch.float32):
            cache = make_cache(model, "full")
            return max(logits_gap(got, _logits(model, cache, piece)) for got, piece in zip(low, pieces))


def h2o_equals_sdpa(model, ids: torch.Tensor, context: int, chunk: int, tolerance: float) -> Check:
    steps = ids.shape[1] - context
    full = make_cache(model, "full")
    # Above the context: never evicts. Built around the policy, since make_cache refuses
    # budgets past a model's trained context.
    scored = cache_for_policy(model, make_policy("h2o", **h2o_budgets(2 * (context + steps))))
    gap = 0.0
    with torch.inference_mode():
        for piece in _pieces(ids, context, chunk):
            gap = max(gap, logits_gap(_logits(model, scored, piece), _logits(model, full, piece)))
    return Check(SDPA, gap <= tolerance,
                 f"largest logit gap {gap:.4f} of the largest logit over {context} prompt tokens in "
                 f"{chunk}-token chunks and {steps} decode steps (tolerance {tolerance:.4f})",
                 {"gap": gap, "tolerance": tolerance, "context": context, "steps": steps})


def _row_caches(model, context: int) -> list[tuple[str, H2OCache]]:
    """Conversations unlike each other: lengths, policies, precisions, pins, rolling."""
    budget = h2o_budgets(max(SINK + 2, context // 4))
    pinned = make_cache(model, "h2o", score_norm="mean", **budget)
    pinned.protect(0, context // 8)
    return [
        ("h2o", make_cache(model, "h2o", **budget)),
        ("h2o K8/V4", make_cache(model, "h2o", key_bits=8, value_bits=4, **budget)),
        ("full", make_cache(model, "full")),
        ("h2o mean, pinned", pinned),
        ("h2o rolling", make_cache(model, "h2o", rolling=True, **budget)),
        ("sink", make_cache(model, "sink", sink=SINK, recent=budget["recent"])),
    ]


def _prefilled(model, context: int, chunk: int, device: torch.device) -> tuple[list[tuple[str, H2OCache]],
                                                                                 list[int], list[torch.Tensor]]:
    rows = _row_caches(model, context)
    lengths = [context - i * context // (2 * len(rows)) for i in range(len(rows))]
    last = []
    with torch.inference_mode():
        for (_, cache), length in zip(rows, lengths):
            for piece in random_ids(model, length, device, seed=length).split(chunk, dim=1):
                logits = forward_one(model, cache, piece)
            last.append(logits)
    return rows, lengths, last


def _same_share(same: int, sets: int) -> bool:
    return same >= (1 - NEAR_TIES) * sets


def batched_rows_equal_alone(model, context: int, steps: int, chunk: int, device: torch.device,
                             tolerance: float) -> Check:
    rows, lengths, last = _prefilled(model, context, chunk, device)
    batched = [cache for _, cache in rows]
    alone = copy.deepcopy(batched)
    step = DecodeStep()
    gap = 0.0
    with torch.inference_mode():
        for _ in range(steps):
            tokens = [int(logits.argmax()) for logits in last]
            together = step(model, batched, tokens)
            last = [forward_one(model, cache, torch.tensor([[token]], device=device))
                    for cache, token in zip(alone, tokens)]
            gap = max(gap, max(logits_gap(got, want) for got, want in zip(together, last)))
    same, sets = _same_positions(batched, alone)
    return Check(BATCHED, gap <= tolerance and _same_share(same, sets),
                 f"largest logit gap {gap:.4f} over {steps} decode steps of {len(rows)} rows "
                 f"({', '.join(f'{name} at {n}' for (name, _), n in zip(rows, lengths))} tokens; "
                 f"tolerance {tolerance:.4f}); kept positions identical in {same} of {sets} "
                 f"(layer, row, KV head) sets (at least {1 - NEAR_TIES:.0%}: bfloat16 rounding may flip "
                 "near-tied scores)",
                 {"gap": gap, "tolerance": tolerance, "rows": [name for name, _ in rows],
                  "lengths": lengths, "same_position_sets": same, "position_sets": sets})


def captured_step_equals_eager(model, context: int, steps: int, chunk: int, device: torch.device,
                               tolerance: float) -> Check:
    rows, _, last = _prefilled(model, context, chunk, device)
    captured = [cache for _, cache in rows]
    eager = copy.deepcopy(captured)
    graphs = device.type == "cuda"
    replayed, plain = DecodeStep(graphs=graphs, pad=True), DecodeStep(graphs=False, pad=False)
    gap = 0.0
    with torch.inference_mode():
        tokens = [int(logits.argmax()) for logits in last]
        for _ in range(steps):
            got, want = replayed(model, captured, tokens), plain(model, eager, tokens)
            gap = max(gap, logits_gap(got, want))
            tokens = want.argmax(dim=-1).tolist()
    same, sets = _same_positions(captured, eager)
    replays, failure = replayed.graph_replays, replayed.graph_failure
    how = f"replayed as a CUDA graph {replays} times, rows padded" if graphs else "rows padded (no graphs on a CPU)"
    if failure:
        how = f"capture failed ({failure}), every step eager"
    passed = gap <= tolerance and _same_share(same, sets) and (replays > 0 or not graphs) and failure is None
    return Check(CAPTURED, passed,
                 f"{how}: largest logit gap {gap:.4f} over {steps} steps of {len(rows)} rows from the "
                 f"eager unpadded step (tolerance {tolerance:.4f}); kept positions identical in {same} of {sets} sets",
                 {"gap": gap, "replays": replays, "failure": failure, "same_position_sets": same,
                  "position_sets": sets})


def _same_positions(caches: list[H2OCache], others: list[H2OCache]) -> tuple[int, int]:
    same = total = 0
    for cache, other in zip(caches, others):
        for mine, theirs in zip(cache.stats().layers, other.stats().layers):
            equal = (mine.positions == theirs.positions).all(dim=-1)
            same, total = same + int(equal.sum()), total + equal.numel()
    return same, total


def _cpu_kept(cache: H2OCache) -> list[torch.Tensor]:
    """Per layer, the positions the CPU rule keeps of the cache's slots as they are now."""
    kept = []
    for layer in cache.layers:
        buffers = {name: t.to("cpu", copy=True) for name, t in layer.held_slots().items()}
        capacity, bounds = layer.eviction_rule()
        held = evict_slots(buffers, layer.held, capacity, bounds, None)
        kept.append(buffers["positions"][:, :, :held].sort(dim=-1).values)
    return kept


def _evict_both(model, cache: H2OCache, ids: torch.Tensor) -> tuple[int, int]:
    """Feed ``ids`` with eviction held, then evict on the CPU (copies) and on the device;
    the (layer, KV head) sets that agree, and all of them."""
    with torch.inference_mode():
        cache.hold_eviction(True)
        forward_one(model, cache, ids)
        want = _cpu_kept(cache)
        cache.hold_eviction(False)
    got = [layer.positions.cpu() for layer in cache.stats().layers]
    same = sum(int((g == w).all(dim=-1).sum()) for g, w in zip(got, want) if g.shape == w.shape)
    return same, sum(w.shape[0] * w.shape[1] for w in want)


def kept_positions_equal_cpu_rule(model, context: int, chunk: int, device: torch.device) -> Check:
    slots = max(SINK + 2, context // 4)
    cache = make_cache(model, "h2o", **h2o_budgets(slots))
    ids = random_ids(model, context + chunk + 1, device, seed=7)
    with torch.inference_mode():
        for piece in ids[:, :context].split(chunk, dim=1):
            forward_one(model, cache, piece)
    chunk_same, chunk_sets = _evict_both(model, cache, ids[:, context : context + chunk])
    step_same, step_sets = _evict_both(model, cache, ids[:, -1:])
    passed = chunk_same == chunk_sets and step_same == step_sets
    return Check(POSITIONS, passed,
                 f"identical in {chunk_same} of {chunk_sets} (layer, KV head) sets after a {chunk}-token "
                 f"chunk and {step_same} of {step_sets} after a decode step, {slots} slots, "
                 f"{context} tokens before",
                 {"chunk": [chunk_same, chunk_sets], "decode_step": [step_same, step_sets], "slots": slots})


def fused_decode_equals_reference(model, device: torch.device) -> Check:
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    slots, lengths, ring = 300, [300, 153, 64, 17, 1], 16
    generator = torch.Generator(device=device).manual_seed(3)
    rows = len(lengths)
    live = torch.tensor(lengths, device=device)
    newest = live - 1
    mask = (torch.arange(slots, device=device) < live[:, None])[:, None, None, :]
    # Per ring entry its token's slot: the newest, shuffled as eviction leaves them.
    back = torch.randperm(ring, generator=generator, device=device)
    entries = (newest[:, None, None] - back).expand(rows, kv_heads, ring)
    entries = torch.where(entries >= 0, entries, newest[:, None, None]).contiguous()

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=model.dtype)

    def stored(bits: int | None, name: str) -> StoredSlots:
        # As a pool's views: a row's slots beyond its own size are spare.
        whole = StoredSlots.encode(draw(rows, kv_heads, slots + 8, dim), bits, name)
        buffers = {key: t[:, :, :slots] for key, t in whole.buffers.items()}
        if bits is None:
            return StoredSlots(whole.codec, buffers, whole.name)
        buffers[window_name(name)] = draw(rows, kv_heads, ring, dim)
        return StoredSlots(whole.codec, buffers, name, entries, draw(rows, kv_heads, dim),
                           (torch.arange(rows, device=device), slice(None), newest))

    gaps, fused = {}, True
    for key_bits, value_bits in ((None, None), (8, 4)):
        keys, values, query = stored(key_bits, "keys"), stored(value_bits, "values"), draw(rows, heads, 1, dim)
        received = torch.zeros((rows, kv_heads, slots), dtype=torch.float32, device=device)
        with torch.inference_mode():
            output = scored_decode(query, keys, values, live, mask, dim ** -0.5, received)
            want, probabilities = scored_attention(query.float(), keys.read(model.dtype).float(),
                                                   values.read(model.dtype).float(), mask, dim ** -0.5)
        label = "float" if key_bits is None else f"K{key_bits}/V{value_bits} +{ring} exact"
        gaps[label] = (logits_gap(output.float(), want), (received - probabilities.sum(dim=(2, 3))).abs().max().item())
        kernel = fused_decode_kernel(query, keys, values)
        fused = fused and kernel is not None
    passed = all(output_gap <= FUSED_OUTPUT_GAP and mass_gap <= FUSED_MASS_GAP for output_gap, mass_gap in gaps.values())
    # On a GPU of many multiprocessors so few rows read their slots in parts (flash-decoding's split).
    parts = kernel.split_count(rows, kv_heads, slots, kernel.processors(device)) if fused else 1
    how = (f"fused kernel, each row's slots read {'whole' if parts == 1 else f'in {parts} parts'}" if fused
           else "no fused kernel on this device")
    return Check(FUSED, passed if fused else None,
                 f"{how}: "
                 + "; ".join(f"{label}: output gap {output_gap:.4f}, received mass gap {mass_gap:.2e}"
                             for label, (output_gap, mass_gap) in gaps.items())
                 + f" (at most {FUSED_OUTPUT_GAP} and {FUSED_MASS_GAP:g}) over {rows} rows of "
                 f"{', '.join(map(str, lengths))} live slots of {slots}, the newest token as given",
                 {"gaps": gaps, "fused": fused, "parts": parts})


def seeded_draws_equal_host(model, device: torch.device) -> Check:
    """The tokens seeded rows draw from the same logits on ``device`` and on the CPU."""
    vocab, settings = model.config.vocab_size, GenerationConfig()
    logits = torch.randn(DRAW_ROWS, vocab, generator=torch.Generator().manual_seed(11)) * 4
    logits[: DRAW_ROWS // 4] *= 0.001  # flat: a nucleus past the candidates
    on_device, rows = logits.to(device), list(range(DRAW_ROWS))
    same = 0
    for index in range(DRAW_INDICES):
        draws = [Draw(Sampling(temperature=settings.temperature, top_p=settings.top_p if row % 2 else 1.0,
                               seed=1000 * index + row), index) for row in rows]
        same += sum(a == b for a, b in zip(draw_tokens(on_device, rows, draws), draw_tokens(logits, rows, draws)))
    total = DRAW_INDICES * DRAW_ROWS
    if device.type == "cpu":
        return Check(DRAWS, None, f"the device is the host: {same} of {total} draws compared with themselves",
                     {"same": same, "draws": total})
    return Check(DRAWS, same >= SAME_DRAWS * total,
                 f"{same} of {total} seeded draws the same (at least {SAME_DRAWS:.0%} must be)",
                 {"same": same, "draws": total})


def run(model, context: int, steps: int, chunk: int, device: torch.device) -> list[Check]:
    ids = random_ids(model, context + steps, device, seed=1)
    noise = rounding_noise(model, ids, context, chunk)
    tolerance = max(NOISE_FACTOR * noise, FLOOR)
    rounding = Check(f"rounding of {str(model.dtype).removeprefix('torch.')} measured", None,
                     f"largest logit gap {noise:.4f} from the same weights in float32 (sdpa, full cache): "
                     f"the tolerance below is {NOISE_FACTOR:g} times that, at least {FLOOR:g}",
                     {"noise": noise, "tolerance": tolerance})
    checks = [rounding]
    for name, work in ((SDPA, lambda: h2o_equals_sdpa(model, ids, context, chunk, tolerance)),
                       (BATCHED, lambda: batched_rows_equal_alone(model, context, steps, chunk, device, tolerance)),
                       (CAPTURED, lambda: captured_step_equals_eager(model, context, steps, chunk, device, tolerance)),
                       (POSITIONS, lambda: kept_positions_equal_cpu_rule(model, context, chunk, device)),
                       (FUSED, lambda: fused_decode_equals_reference(model, device)),
                       (DRAWS, lambda: seeded_draws_equal_host(model, device))):
        check, failure = attempt(name, work)
        checks.append(check or failure)
    return checks
