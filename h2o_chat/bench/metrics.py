"""Quality metrics from logits: pure torch, no model.

Every function takes logits ``(..., vocab)`` over the same positions; ``targets`` are the
true next tokens ``(...)``. The reference is the full cache: KL is KL(full || policy), the
divergence of the policy's next-token distribution from the full cache's.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def token_metrics(
    logits: torch.Tensor, targets: torch.Tensor, ref_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position negative log-likelihood of the target, top-1 agreement with the
    reference and KL(reference || policy), in nats.

    ``ref_logprobs`` are log-probabilities (``log_softmax`` of the reference logits).
    Returns three tensors shaped like ``targets``: nll (float), agree (bool), kl (float).
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = token_nll(logp, targets)
    agree = logp.argmax(-1) == ref_logprobs.argmax(-1)
    ref = ref_logprobs.float()
    # p_ref * (log p_ref - log p_pol); terms where p_ref == 0 contribute 0, not NaN.
    kl = torch.where(ref.exp() > 0, ref.exp() * (ref - logp), torch.zeros_like(ref)).sum(-1)
    return nll, agree, kl.clamp(min=0.0)


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target under ``logprobs`` (``log_softmax`` of the
    logits), shaped like ``targets``."""
    return -logprobs.gather(-1, targets[..., None]).squeeze(-1)


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean nll) over every element."""
    return math.exp(float(nll.double().mean()))


def summarize(nll: torch.Tensor, agree: torch.Tensor, kl: torch.Tensor) -> dict[str, float]:
    """Pool per-token values: perplexity, top-1 agreement (fraction) and mean KL."""
    return {
        "ppl": perplexity(nll),
        "top1": float(agree.double().mean()),
        "kl": float(kl.double().mean()),
        "tokens": int(nll.numel()),
    }
