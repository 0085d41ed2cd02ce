"""The model's RMS norms as torch's own fused operation.

On a GPU a decode step of one conversation is bound by the kernels it runs, not by the
bytes it reads (the 1B shapes on an H200: about 800 kernels of about 3 µs each for a
step whose weights stream in 0.6 ms; docs/benchmarks.md, "The GPU check"). transformers'
RMS norm modules compute in eight operations (two casts, the square, the mean, the
epsilon, the reciprocal root, two products; in bfloat16 eight kernels), two norms a
layer; ``torch.nn.functional.rms_norm`` is one kernel on CUDA, and on the CPU one
operation where there were eight.

A norm is replaced only where the fused operation computes what it computes, checked on
a probe input when the model loads: a model whose norm differs (Gemma's ``1 + weight``,
a norm without a weight) keeps its own. Modules whose weights accelerate moves between
devices keep theirs too (replacing one would drop its hook).
"""

from __future__ import annotations

import inspect

import torch
from torch.nn import functional as F

# The probe's rows: values of a residual stream's scale.
_PROBE_ROWS = 4
_PROBE_SCALE = 3.0


class FusedRMSNorm(torch.nn.Module):
    """``weight * x / sqrt(mean(x²) + eps)`` over the last dimension, in one operation;
    the weight is the replaced module's own parameter (shared, not copied). An input of
    another dtype than the weight's (a model that keeps its norms in float32) goes to the
    replaced module, whose products promote where the fused operation would not."""

    def __init__(self, replaced: torch.nn.Module, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps
        # Not a submodule: its weight is this module's, and the state dict keeps one copy.
        self.__dict__["replaced"] = replaced

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            return self.replaced(hidden_states)
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Replace every RMS norm module of ``model`` that ``FusedRMSNorm`` computes exactly
    as it does (within its dtype's rounding) by one; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            fused = _fused_equivalent(module)
            if fused is not None:
                setattr(parent, name, fused)
                replaced += 1
    return replaced


def probe_input(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A seeded input of ``shape`` for checking a replacement module against the one it
    replaces, in ``like``'s dtype and on its device: values of a residual stream's scale."""
    generator = torch.Generator(device=like.device).manual_seed(0)
    return torch.randn(shape, generator=generator, device=like.device,
                       dtype=torch.float32).mul_(_PROBE_SCALE).to(like.dtype)


def _fused_equivalent(module: torch.nn.Module) -> FusedRMSNorm | None:
    """A ``FusedRMSNorm`` that computes what ``module`` does, or None."""
    if (not type(module).__name__.endswith("RMSNorm") or hasattr(module, "_hf_hook")
            or len(inspect.signature(module.forward).parameters) != 1):  # e.g. a gated norm
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or weight.device.type == "meta"
            or not weight.is_floating_point() or not isinstance(eps, float)):
        return None
    fused = FusedRMSNorm(module, weight, eps)
    probe = probe_input((_PROBE_ROWS, weight.shape[0]), weight)
    with torch.no_grad():
        own, theirs = module(probe), fused(probe)
    # The fused operation rounds once where the module may round twice (before and after
    # the weight), and on a GPU sums in another order: a few units in the last place of
    # the dtype apart at most. Any other formula is far further off.
    tolerance = 4 * torch.finfo(weight.dtype).eps
    if own.dtype != theirs.dtype or not torch.allclose(own.float(), theirs.float(), rtol=tolerance, atol=tolerance):
        return None
    return fused
