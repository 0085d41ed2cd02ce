"""The ``h2o`` attention function and its mask function, registered with transformers.

The attention function is where H2O sees the attention probabilities: it computes them
explicitly in float32, sums the mass each cached slot received over the query heads that
share its KV head (GQA) and over the new queries, and hands that to the cache layer, which
accumulates it and evicts. Policies that need no scores use the fused sdpa kernel.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import H2OLayer, layer_awaiting_attention

ATTENTION_NAME = "h2o"


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


def _slot_mask(layer: H2OLayer, mask: torch.Tensor | None, query_len: int) -> torch.Tensor | None:
    """Boolean mask over the layer's slots, broadcastable to ``(batch, kv_heads, query,
    slots)``, or None when every slot is visible to every query (plain decoding)."""
    if mask is not None:
        # The last query row sees every real new token, so it tells which are padding.
        layer.mark_padding(mask[:, 0, -1, -query_len:])
    if not layer.has_padding:
        # No padding anywhere: the standard mask's columns are exact (all cached slots
        # are in the past); without one, only a multi-token chunk needs causality.
        if mask is None and query_len > 1:
            cached = layer.held - query_len
            old = torch.ones(query_len, cached, dtype=torch.bool, device=layer.device)
            return torch.cat([old, _causal_block(query_len, layer.device)], dim=-1)[None, None]
        return mask
    new = _causal_block(query_len, layer.device) if mask is None else mask[..., -query_len:]
    new = new.expand(layer.valid.shape[0], layer.valid.shape[1], query_len, query_len)
    cached = layer.valid[..., :-query_len, None].transpose(-1, -2)
    return torch.cat([cached.expand(-1, -1, query_len, -1), new], dim=-1)


def _scored_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention with explicit float32 probabilities.

    Returns the output ``(batch, query, q_heads, head_dim)``, the probabilities
    ``(batch, q_heads, query, slots)`` and the mass each slot received,
    ``(batch, kv_heads, slots)``, summed over queries and the query heads of its group.
    """
    batch, q_heads, query_len, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    # Grouping query heads by KV head avoids materialising repeated keys and values.
    grouped = query.reshape(batch, kv_heads, groups * query_len, head_dim).float()
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)) * scaling
    logits = logits.view(batch, kv_heads, groups, query_len, slots)
    if mask is not None:
        mask = mask[:, :, None]  # broadcast over the query heads of each group
        logits = logits.masked_fill(~mask, torch.finfo(torch.float32).min)
    probs = torch.softmax(logits, dim=-1)
    if mask is not None:
        # Padding queries see nothing: give them no probability mass to hand out.
        probs = probs * mask.any(dim=-1, keepdim=True)
    output = torch.matmul(probs.view(batch, kv_heads, groups * query_len, slots), value.float())
    output = output.view(batch, q_heads, query_len, -1).transpose(1, 2).to(query.dtype)
    received = probs.sum(dim=(2, 3))
    return output.contiguous(), probs.view(batch, q_heads, query_len, slots), received


def _sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
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
    layer = layer_awaiting_attention()
    if layer is None:
        # No H2O cache in this call (e.g. a forward without past_key_values): plain sdpa.
        return _sdpa_attention(query, key, value, attention_mask, scaling), None
    if layer.query_shift:
        query = layer.rope.shift(query, layer.query_shift)
    mask = _slot_mask(layer, attention_mask, query.shape[2])
    if layer.policy.needs_scores or layer.watch_newest:
        output, probs, received = _scored_attention(query, key, value, mask, scaling)
        if layer.watch_newest:
            batch, kv_heads, slots = received.shape
            newest = probs[:, :, -1].reshape(batch, kv_heads, -1, slots)
            layer.newest_attention = newest.sum(dim=2)
        layer.after_attention(received)
        return output, probs
    output = _sdpa_attention(query, key, value, mask, scaling)
    layer.after_attention(None)
    return output, None


def register_h2o_attention() -> None:
    """Make ``attn_implementation="h2o"`` available to every transformers model."""
    AttentionInterface.register(ATTENTION_NAME, h2o_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, h2o_mask)
