"""Part of the GPU check (``gpu.py``): the decode step's kernels alone, one layer at a
large batch, against the torch path they replace, so a run on a GPU says what each is
worth and how its launch should be tuned.

- **attention**: one layer's scored decode attention over ``rows`` rows of ``slots``
  live slots, slots as floats and as 8-bit keys and 4-bit values (codes read by the
  kernel; the torch path dequantizes a copy first, compiled as the engine does on CUDA),
  the kernel at several launch settings (warps per program, pipeline stages), and float
  slots read by torch's own fused attention, which keeps no scores: the pace a plain read
  of the same bytes reaches there; and at few rows (1 and 16), the kernel with each
  row's slots read whole and in the parts it splits them into there;
- **eviction**: the choice of the slot to drop for every layer, row and KV head at once
  (``evict_kernel`` against ``selection``'s operations);
- **draws** (``draw_rows``): a step's tokens drawn from its logits over the model's
  vocabulary (``sampling.draw_tokens``, outside the step's graph): greedy, and at the
  app's temperature and top-p unseeded and seeded, at one row and at many.

Each row gives the median time of a call and the bytes its inputs hold per second (a
lower bound on what was read). On a device without the kernels (the CPU) only the torch
path runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from h2o_chat.config import GenerationConfig
from h2o_chat.engine import kernels
from h2o_chat.engine.attention import scored_attention
from h2o_chat.engine.batch import END, FIELDS, POSITION, SLOT, START
from h2o_chat.engine.selection import RANK_SCORE, lowest_slot, middle_slots
from h2o_chat.engine.stored import StoredSlots
from h2o_chat.sampling import Draw, Sampling, draw_tokens

# The attention kernel's launch settings tried: (warps, stages); Triton's default first.
LAUNCHES = ((4, 3), (2, 2), (4, 1), (4, 2), (8, 2), (8, 3))
PLAIN_READ = "sdpa, no scores"


def timed(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``call`` after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            call()
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def _held_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class AttentionInputs:
    """One layer's decode attention at ``rows`` rows of ``slots`` live slots each, shaped
    as ``model``'s: a query per row, the rows' lengths, their scores, and slots to read."""

    def __init__(self, model, rows: int, slots: int, device: torch.device) -> None:
        config = model.config
        heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.rows, self.slots, self.dtype, self.device = rows, slots, model.dtype, device
        self.lengths = torch.full((rows,), slots, dtype=torch.long, device=device)
        self.query = torch.randn(rows, heads, 1, self.dim, dtype=model.dtype, device=device)
        self.scores = torch.zeros((rows, self.kv_heads, slots), dtype=torch.float32, device=device)

    def stored(self, bits: int | None, name: str) -> StoredSlots:
        """Random slots stored as floats (``bits`` None) or as ``bits``-bit codes."""
        return StoredSlots.encode(torch.randn(self.rows, self.kv_heads, self.slots, self.dim, dtype=self.dtype,
                                              device=self.device), bits, name)


def attention_rows(model, rows: int, slots: int, device: torch.device, repeats: int) -> list[dict]:
    inputs = AttentionInputs(model, rows, slots, device)
    query, lengths, scores, kv_heads, dim = inputs.query, inputs.lengths, inputs.scores, inputs.kv_heads, inputs.dim
    heads = query.shape[1]
    mask = torch.ones((rows, 1, 1, slots), dtype=torch.bool, device=device)
    kernel = kernels.load("decode_kernel", device)
    results = []
    for label, key_bits, value_bits in (("float", None, None), ("K8/V4", 8, 4)):
        keys, values = inputs.stored(key_bits, "keys"), inputs.stored(value_bits, "values")
        held = _held_bytes(keys.data, keys.scale, keys.minimum, values.data, values.scale, values.minimum)

        def reference() -> None:
            probabilities = scored_attention(query, keys.read(model.dtype), values.read(model.dtype), mask,
                                             dim ** -0.5)[1]
            scores.add_(probabilities.sum(dim=(2, 3)))

        paths = [("torch", reference)]
        if key_bits is None:
            # The same keys and values read by torch's fused attention (flash on CUDA), which
            # returns no scores: the pace a plain read of these bytes reaches, for the kernel's
            # to be judged against. A group's query heads stand as its KV head's query rows.
            grouped = query.view(rows, kv_heads, heads // kv_heads, dim)
            paths.append((PLAIN_READ, lambda: F.scaled_dot_product_attention(grouped, keys.data, values.data)))
        if kernel is not None and kernel.usable(query, keys, values):
            paths += [(f"kernel, {warps} warps, {stages} stages",
                       lambda launch=dict(num_warps=warps, num_stages=stages): kernel.scored_decode(
                           query, keys, values, lengths, dim ** -0.5, scores, launch=launch))
                      for warps, stages in LAUNCHES]
        for path, call in paths:
            ms = timed(call, device, repeats)
            results.append({"what": f"attention, {label}", "path": path, "rows": rows, "slots": slots, "ms": ms,
                            "held_mb": held / 2**20, "gb_s": held / ms / 1e6})
    return results


def split_rows(model, slots: int, device: torch.device, repeats: int, counts: tuple[int, ...] = (1, 16)) -> list[dict]:
    """The attention kernel at few rows, each (row, KV head)'s slots read by one program
    and in the parts ``decode_kernel.split_count`` gives there: what splitting is worth
    where the rows alone cannot fill the GPU. Nothing off the kernels' devices."""
    kernel = kernels.load("decode_kernel", device)
    if kernel is None:
        return []
    results = []
    for rows in counts:
        inputs = AttentionInputs(model, rows, slots, device)
        keys, values = inputs.stored(None, "keys"), inputs.stored(None, "values")
        held = _held_bytes(keys.data, values.data)
        for splits in sorted({1, kernel.split_count(rows, inputs.kv_heads, slots, kernel.processors(device))}):
            ms = timed(lambda: kernel.scored_decode(inputs.query, keys, values, inputs.lengths, inputs.dim ** -0.5,
                                                    inputs.scores, splits=splits), device, repeats)
            results.append({"what": "attention, float", "path": f"kernel, {splits} part{'s' * (splits > 1)} a row",
                            "rows": rows, "slots": slots, "ms": ms, "held_mb": held / 2**20, "gb_s": held / ms / 1e6})
    return results


def eviction_rows(model, rows: int, slots: int, device: torch.device, repeats: int) -> list[dict]:
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    shape = (layers, rows, kv_heads, slots)
    scores = torch.rand(shape, device=device)
    positions = torch.randperm(slots, device=device).expand(shape).contiguous()
    pinned = torch.zeros(shape, dtype=torch.bool, device=device)
    plan = torch.zeros((rows, FIELDS), dtype=torch.long, device=device)
    plan[:, SLOT], plan[:, POSITION], plan[:, START], plan[:, END] = slots - 1, slots - 1, 4, slots - slots // 2
    live = torch.ones((1, rows, 1, slots), dtype=torch.bool, device=device)

    def per_row(field: int) -> torch.Tensor:
        return plan[:, field].view(1, -1, 1, 1)

    def reference() -> torch.Tensor:
        middle = middle_slots(positions, pinned, per_row(START), per_row(END), live)
        return lowest_slot(scores, positions, middle)

    paths = [("torch", reference)]
    kernel = kernels.load("evict_kernel", device)
    if kernel is not None and kernel.usable(scores, positions, pinned):
        paths.append(("kernel", lambda: kernel.lowest_slot(scores, positions, pinned, plan,
                                                           frozenset({RANK_SCORE}), False)))
    held = _held_bytes(scores, positions, pinned)
    return [{"what": "eviction, every layer", "path": path, "rows": rows, "slots": slots,
             "ms": (ms := timed(call, device, repeats)), "held_mb": held / 2**20, "gb_s": held / ms / 1e6}
            for path, call in paths]


def run(model, rows: int, slots: int, device: torch.device, repeats: int = 10) -> list[dict]:
    """The table's rows for ``model``'s shapes at ``rows`` rows of ``slots`` slots."""
    with torch.inference_mode():
        return (attention_rows(model, rows, slots, device, repeats) + split_rows(model, slots, device, repeats)
                + eviction_rows(model, rows, slots, device, repeats))


def draw_rows(model, counts: tuple[int, ...], device: torch.device, repeats: int = 10) -> list[dict]:
    """A step's draws at each row count of ``counts``, from logits over the model's
    vocabulary (normal, spread as a trained model's peaked ones are): greedy, and at the
    app's temperature and top-p unseeded (fresh noise) and seeded (each row's noise hashed
    from its seed and the token's index); the host's read of the tokens included."""
    vocab, settings = model.config.vocab_size, GenerationConfig()
    generator = torch.Generator().manual_seed(4)
    results = []
    for rows in counts:
        logits = (torch.randn(rows, vocab, generator=generator) * 4).to(device)
        for path, seeded, temperature in (("greedy", False, 0.0), ("unseeded", False, settings.temperature),
                                          ("seeded", True, settings.temperature)):
            draws = [Draw(Sampling(temperature=temperature, top_p=settings.top_p, seed=row if seeded else None))
                     for row in range(rows)]
            ms = timed(lambda: draw_tokens(logits, list(range(rows)), draws), device, repeats)
            results.append({"path": path, "rows": rows, "vocab": vocab, "ms": ms})
    return results
