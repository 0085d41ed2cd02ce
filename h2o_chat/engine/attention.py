"""The ``h2o`` attention function and its mask function, registered with transformers.

The attention function is where H2O sees the attention probabilities. A cache's
``update`` hands over (``hand_over``, thread-local) an ``AttentionClient`` to the
attention call that follows: a cache layer (``layer.H2OLayer``), the layer of several
conversations' prompt pieces (``rows``), or a layer of the batched decode step
(``step``). The attention function gives it the call, and the client attends with the
math below: explicit float32 probabilities where its policy scores slots, else the
fused sdpa kernel; it then keeps the probabilities' mass as scores and evicts.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels
from .stored import StoredSlots

ATTENTION_NAME = "h2o"


class AttentionClient(Protocol):
    """What the attention function hands an attention call to."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention output ``(batch, query, q_heads, head_dim)`` and, where computed,
        the probabilities; ``key``/``value`` are what the cache's ``update`` returned."""


_pending = threading.local()


def hand_over(client: AttentionClient | None) -> None:
    """Make ``client`` the one the next attention call in this thread serves (None: none).

    Thread-local rather than stored on the model, so sessions decoding in two threads
    with one shared model never touch each other's cache.
    """
    _pending.client = client


def awaiting_attention() -> AttentionClient | None:
    """The client handed over in this thread and not yet served."""
    return getattr(_pending, "client", None)


@dataclass(frozen=True)
class AttentionCall:
    """What a model handed the attention function in one call: the shapes of the keys and
    values ``(batch, kv_heads, slots, head_dim)`` and its extra arguments by name."""

    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    extras: dict


@contextmanager
def recording_calls() -> Iterator[list[AttentionCall]]:
    """Note every call of the attention function in this thread meanwhile, in a list: a
    probe forward then shows what a model asks of its attention (``loading.py``)."""
    _pending.calls = calls = []
    try:
        yield calls
    finally:
        _pending.calls = None


def h2o_mask(*args, **kwargs) -> torch.Tensor | None:
    """The standard sdpa boolean mask (None when a plain causal mask suffices).

    Its columns assume the cached slots are the contiguous positions just before the
    query; that holds for causality (every cached slot is in the past) but not for
    padding after eviction, so the attention function only trusts the columns of the new
    tokens and takes the cached slots' validity from the layer.
    """
    return sdpa_mask(*args, **kwargs)


def _causal_block(query_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril()


def slot_mask(valid: torch.Tensor | None, mask: torch.Tensor | None, query_len: int,
              key: torch.Tensor, narrow: bool = False) -> torch.Tensor | None:
    """Boolean mask over the held slots (``key``'s), broadcastable to ``(batch, kv_heads,
    query, slots)``, or None when every slot is visible to every query (plain decoding).
    ``valid``: which held slots are real tokens, None when all are. ``narrow``: where
    only a chunk's own causality hides anything, its causal block alone, the mask of the
    last ``query_len`` slots (``scored_attention`` takes such a mask)."""
    held, device = key.shape[2], key.device
    if valid is None:
        # No padding anywhere: the standard mask's columns are exact (all cached slots
        # are in the past); without one, only a multi-token chunk needs causality.
        if mask is None and query_len > 1:
            causal = _causal_block(query_len, device)[None, None]
            if narrow:
                return causal
            old = torch.ones(1, 1, query_len, held - query_len, dtype=torch.bool, device=device)
            return torch.cat([old, causal], dim=-1)
        return mask
    new = _causal_block(query_len, device) if mask is None else mask[..., -query_len:]
    new = new.expand(valid.shape[0], valid.shape[1], query_len, query_len)
    cached = valid[..., :-query_len, None].transpose(-1, -2)
    return torch.cat([cached.expand(-1, -1, query_len, -1), new], dim=-1)


def _narrow_on_cuda(t: torch.Tensor) -> bool:
    """Half-precision tensors on a GPU, whose matrix products can write float32 directly
    (on the CPU, or in float32, the operands are simply made float32)."""
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16) and _writes_float32(t.dtype, t.device)


@functools.cache
def _writes_float32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch's batched matrix product takes ``out_dtype`` for ``dtype`` there."""
    try:
        operand = torch.zeros((1, 1, 1), dtype=dtype, device=device)
        return torch.bmm(operand, operand, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _float32_logits(grouped: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``grouped @ key.T`` in float32, ``(batch, kv_heads, q, slots)``, without a float32
    copy of the keys where the GPU can write float32 from half-precision operands."""
    if _narrow_on_cuda(key):
        batch, kv_heads, rows, dim = grouped.shape
        flat = torch.bmm(grouped.reshape(batch * kv_heads, rows, dim),
                         key.reshape(batch * kv_heads, key.shape[2], dim).transpose(1, 2), out_dtype=torch.float32)
        return flat.view(batch, kv_heads, rows, -1)
    return torch.matmul(grouped.float(), key.float().transpose(-1, -2))


def _weighted_values(probabilities: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``probabilities @ value``; in the values' own precision where they are narrow on a
    GPU (as a fused kernel would), else in float32."""
    if _narrow_on_cuda(value):
        return torch.matmul(probabilities.to(value.dtype), value)
    return torch.matmul(probabilities, value.float())


def scored_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, hides_rows: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with explicit float32 probabilities.

    ``mask`` as ``slot_mask`` gives it (True: seen), or as ``hiding_bias`` gives it (added
    to the logits: made once for every layer of a step); one narrower than the slots is
    the mask of the last ones, the earlier seen by every query. ``hides_rows``: whether a
    boolean mask may hide every slot from a query (a padding query), whose probabilities
    are then zeroed; a narrow mask hides no whole row, nor does a bias (its callers' rows
    each see their own new token).

    Returns the output ``(batch, query, q_heads, head_dim)`` and the probabilities
    ``(batch, kv_heads, groups, query, slots)``, query heads grouped by KV head.
    """
    batch, q_heads, query_len, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    # Grouping query heads by KV head avoids materialising repeated keys and values.
    grouped = query.reshape(batch, kv_heads, groups * query_len, head_dim)
    logits = _float32_logits(grouped, key).mul_(scaling).view(batch, kv_heads, groups, query_len, slots)
    if mask is not None:
        mask = mask[:, :, None]  # broadcast over the query heads of each group
        # In place, and over the masked slots only (a chunk hides only its own later
        # tokens): a copy and a pass over every logit of a long prefill fewer.
        masked = logits if mask.shape[-1] == slots else logits[..., slots - mask.shape[-1]:]
        if mask.dtype == torch.bool:
            masked.masked_fill_(~mask, torch.finfo(torch.float32).min)
        else:
            masked.add_(mask)
    probs = torch.softmax(logits, dim=-1)
    if mask is not None and hides_rows and mask.dtype == torch.bool:
        # Padding queries see nothing: give them no probability mass to hand out.
        probs.mul_(mask.any(dim=-1, keepdim=True))
    output = _weighted_values(probs.view(batch, kv_heads, groups * query_len, slots), value)
    output = output.view(batch, q_heads, query_len, -1).transpose(1, 2).to(query.dtype)
    return output.contiguous(), probs


def hiding_bias(visible: torch.Tensor) -> torch.Tensor:
    """The boolean mask ``visible`` as a float32 one to add to logits: 0 where seen, the
    float32 minimum where hidden. A logit plus that minimum rounds to the minimum itself
    (a logit is far below its last place), so adding it gives exactly what filling the
    hidden logits with it gives, in one operation instead of two."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(
        ~visible, torch.finfo(torch.float32).min)


def fused_decode_kernel(query: torch.Tensor, keys: StoredSlots, values: StoredSlots):
    """The ``decode_kernel`` module where its kernel computes this call, else None."""
    kernel = kernels.load("decode_kernel", query.device)
    return kernel if kernel is not None and kernel.usable(query, keys, values) else None


def scored_decode(query: torch.Tensor, keys: StoredSlots, values: StoredSlots, lengths: torch.Tensor,
                  mask: torch.Tensor, scaling: float, scores: torch.Tensor,
                  counted: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per row over its first ``lengths[row]`` slots (``mask``, the same as
    a ``(rows, 1, 1, slots)`` mask of ``scored_attention``'s, a ``hiding_bias`` being the
    cheaper where it serves every layer): the output; the mass each slot received, summed
    over the query heads of its KV head, is added to ``scores`` ``(rows, kv_heads,
    slots)`` float32 where ``counted`` (None: everywhere). One fused kernel on a GPU,
    reading the stored slots (codes included) in place (``decode_kernel``), else
    ``scored_attention`` over what ``StoredSlots.read`` gives."""
    kernel = fused_decode_kernel(query, keys, values)
    if kernel is not None:
        return kernel.scored_decode(query, keys, values, lengths, scaling, scores, counted)
    # A row sees at least its own new token, so no row is all hidden.
    output, probabilities = scored_attention(query, keys.read(query.dtype), values.read(query.dtype), mask, scaling,
                                             hides_rows=False)
    received = probabilities.sum(dim=(2, 3))
    scores.add_(received if counted is None else received * counted)
    return output


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scaling: float) -> torch.Tensor:
    q_heads, kv_heads = query.shape[1], key.shape[1]
    if mask is not None and mask.shape[1] != 1:
        mask = mask.repeat_interleave(q_heads // kv_heads, dim=1)
    # Without a mask a multi-token query is a prefill into an empty cache: plain causal.
    is_causal = mask is None and query.shape[2] > 1
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling,
        enable_gqa=q_heads != kv_heads,
    )
    return output.transpose(1, 2).contiguous()


def h2o_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    calls = getattr(_pending, "calls", None)
    if calls is not None:
        calls.append(AttentionCall(tuple(key.shape), tuple(value.shape), kwargs))
    client = awaiting_attention()
    if client is None:
        # No H2O cache in this call (e.g. a forward without past_key_values): plain sdpa.
        return sdpa_attention(query, key, value, attention_mask, scaling), None
    return client.attend(query, key, value, attention_mask, scaling)


def register_h2o_attention() -> None:
    """Make ``attn_implementation="h2o"`` available to every transformers model."""
    AttentionInterface.register(ATTENTION_NAME, h2o_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, h2o_mask)
