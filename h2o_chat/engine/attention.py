"""The ``h2o`` attention function and its mask function, registered with transformers.

The attention function is where H2O sees the attention probabilities. A cache layer's
``update`` hands the layer over (``hand_over``, thread-local) to the attention call that
follows; the attention function then asks it for its inputs (``prepare``), computes the
probabilities explicitly in float32 where the layer wants them, and gives them back
(``receive``): the layer scores and evicts. Everything the attention function needs of a
layer is ``AttentionClient``. Where the layer wants no probabilities, the fused sdpa
kernel runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "h2o"


class AttentionClient(Protocol):
    """What the attention function needs of a cache layer (``H2OLayer``)."""

    @property
    def wants_probabilities(self) -> bool:
        """Whether ``receive`` wants this call's probabilities (else sdpa may run)."""

    def prepare(self, query: torch.Tensor, new_valid: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Take which of the just-added slots are real tokens (``(batch, new)`` bool,
        None: all) and return the query as attention must use it and which held slots
        are real tokens, ``(batch, kv_heads, held)`` bool, or None when all are."""

    def receive(self, probabilities: torch.Tensor | None) -> None:
        """End of the attention call: its probabilities, ``(batch, kv_heads, groups,
        query, held)`` float32 (query heads grouped by the KV head whose slots they
        read), where the layer wanted them; else None (also where ``Rows.scores`` took
        them already)."""


_pending = threading.local()


def hand_over(layer: AttentionClient | None) -> None:
    """Make ``layer`` the one the next attention call in this thread serves (None: none).

    Thread-local rather than stored on the model, so sessions decoding in two threads
    with one shared model never touch each other's cache.
    """
    _pending.layer = layer


def awaiting_attention() -> AttentionClient | Rows | None:
    """The layer (or rows of layers) handed over in this thread and not yet served."""
    return getattr(_pending, "layer", None)


@dataclass
class Rows:
    """One attention call serving several conversations' own caches: batch row r is
    attention over ``clients[r]``'s layer, which holds ``held[r]`` slots (``engine.rows``).

    ``keys``/``values``: each row's own, ``(1, kv_heads, held[r], head_dim)``, or every
    row's already side by side, ``(rows, kv_heads, max(held), head_dim)`` (a ``RowPool``'s,
    read where they lie; past a row's own held slots anything finite: it is masked out).
    ``batched``: the rows are attended in one call, padded to the longest and the padding
    masked out; else each row runs its own call, exactly as it would alone. ``fed``: the
    tokens each row feeds in this call, packed one row after another in the call's one
    batch row (pieces of prompts: no padding to compute); None: batch row r is row r's.
    Rows feeding several tokens run their own calls. ``scores``:
    where given, every row's scores side by side, ``(rows, kv_heads, max(held))``, where
    the rows' policies simply add the mass each slot receives: it is added there for all
    rows at once (padding receives exactly zero) and each row then receives None.
    """

    clients: list[AttentionClient]
    held: list[int]
    keys: list[torch.Tensor] | torch.Tensor
    values: list[torch.Tensor] | torch.Tensor
    batched: bool = True
    scores: torch.Tensor | None = None
    fed: list[int] | None = None


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


def _slot_mask(valid: torch.Tensor | None, mask: torch.Tensor | None, query_len: int,
               key: torch.Tensor) -> torch.Tensor | None:
    """Boolean mask over the held slots (``key``'s), broadcastable to ``(batch, kv_heads,
    query, slots)``, or None when every slot is visible to every query (plain decoding).
    ``valid``: which held slots are real tokens, None when all are."""
    held, device = key.shape[2], key.device
    if valid is None:
        # No padding anywhere: the standard mask's columns are exact (all cached slots
        # are in the past); without one, only a multi-token chunk needs causality.
        if mask is None and query_len > 1:
            old = torch.ones(query_len, held - query_len, dtype=torch.bool, device=device)
            return torch.cat([old, _causal_block(query_len, device)], dim=-1)[None, None]
        return mask
    new = _causal_block(query_len, device) if mask is None else mask[..., -query_len:]
    new = new.expand(valid.shape[0], valid.shape[1], query_len, query_len)
    cached = valid[..., :-query_len, None].transpose(-1, -2)
    return torch.cat([cached.expand(-1, -1, query_len, -1), new], dim=-1)


def _scored_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with explicit float32 probabilities.

    Returns the output ``(batch, query, q_heads, head_dim)`` and the probabilities
    ``(batch, kv_heads, groups, query, slots)``, query heads grouped by KV head.
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
    return output.contiguous(), probs


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
    layer = awaiting_attention()
    if layer is None:
        # No H2O cache in this call (e.g. a forward without past_key_values): plain sdpa.
        return _sdpa_attention(query, key, value, attention_mask, scaling), None
    if isinstance(layer, Rows):
        if layer.batched:
            return _attend_rows(layer, query, scaling), None
        return _attend_each(layer, query, scaling), None
    return _attend(layer, query, key, value, attention_mask, scaling)


def _attend_each(rows: Rows, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Each row's attention in a call of its own, as alone, over its own slots and its own
    queries: batch row r, or its stretch of the one batch row where ``rows.fed`` packs them."""
    if rows.fed is None:
        queries, dim = query.split(1), 0
    else:
        queries, dim = query.split(rows.fed, dim=2), 1
    return torch.cat([_attend(client, row_query, keys, values, None, scaling)[0]
                      for client, row_query, keys, values in zip(rows.clients, queries, rows.keys, rows.values)],
                     dim=dim)


def _attend_rows(rows: Rows, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One decode step's attention for rows of different caches in one call: each row's
    held slots beside the others', padded to the longest row's where they differ and the
    padding masked out (it gets exactly zero probability), so a row's scores and
    eviction are its own. A per-row loop launched a dozen small operations per row and
    layer, which dominates at many rows or on a GPU."""
    clients, held = rows.clients, rows.held
    prepared = [client.prepare(query[r : r + 1], None) for r, client in enumerate(clients)]
    keys, values = rows.keys, rows.values
    if not isinstance(keys, torch.Tensor):
        keys, values = _stacked(keys, held), _stacked(values, held)
    queries = torch.cat([row_query for row_query, _ in prepared])
    mask = _rows_mask([valid for _, valid in prepared], held, keys)
    if any(client.wants_probabilities for client in clients):
        output, probabilities = _scored_attention(queries, keys, values, mask, scaling)
        if rows.scores is not None:
            rows.scores.add_(probabilities.sum(dim=(2, 3)))
            probabilities = None  # every row's share is in its scores already
    else:
        output, probabilities = _sdpa_attention(queries, keys, values, mask, scaling), None
    for r, client in enumerate(clients):
        wanted = probabilities is not None and client.wants_probabilities
        client.receive(probabilities[r : r + 1, ..., : held[r]] if wanted else None)
    return output


def _stacked(tensors: list[torch.Tensor], held: list[int]) -> torch.Tensor:
    """``(1, kv_heads, held_r, ...)`` per row -> ``(rows, kv_heads, max held, ...)``, zeros
    after each row's own slots. Contiguous: a padded copy of transposed rows (what
    ``pad_sequence`` gives) took a third of a 32-row step, and made both matmuls after it
    four times slower."""
    longest = max(held)
    if min(held) == longest:  # every row at its budget: the common case once rows evict
        return torch.cat(tensors)
    stacked = tensors[0].new_zeros((len(tensors), tensors[0].shape[1], longest, *tensors[0].shape[3:]))
    for row, tensor in enumerate(tensors):
        stacked[row, :, : tensor.shape[2]] = tensor[0]
    return stacked


def _rows_mask(valid: list[torch.Tensor | None], held: list[int], keys: torch.Tensor) -> torch.Tensor | None:
    """Which of the stacked slots each row attends to, ``(rows, kv_heads, 1, slots)``: its
    own held slots that are real tokens (``valid``: a row's ``(1, kv_heads, held)``, None
    when all are). None when every slot of every row is."""
    longest = max(held)
    if min(held) == longest and all(v is None for v in valid):
        return None
    lengths = torch.tensor(held, device=keys.device)
    visible = torch.arange(longest, device=keys.device) < lengths[:, None]
    visible = visible[:, None, :].repeat(1, keys.shape[1], 1)
    for row, row_valid in enumerate(valid):
        if row_valid is not None:
            visible[row, :, : held[row]] &= row_valid[0]
    return visible[:, :, None, :]


def _attend(layer: AttentionClient, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query`` over one layer's held slots ``key``/``value``; the layer
    gets the probabilities it wants, then scores and evicts."""
    query_len = query.shape[2]
    # The last query row sees every real new token, so it tells which are padding.
    new_valid = None if attention_mask is None else attention_mask[:, 0, -1, -query_len:]
    query, valid = layer.prepare(query, new_valid)
    mask = _slot_mask(valid, attention_mask, query_len, key)
    if layer.wants_probabilities:
        output, probabilities = _scored_attention(query, key, value, mask, scaling)
        layer.receive(probabilities)
        return output, probabilities.flatten(1, 2)
    output = _sdpa_attention(query, key, value, mask, scaling)
    layer.receive(None)
    return output, None


def register_h2o_attention() -> None:
    """Make ``attn_implementation="h2o"`` available to every transformers model."""
    AttentionInterface.register(ATTENTION_NAME, h2o_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, h2o_mask)
