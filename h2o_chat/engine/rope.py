"""Moving rotary-embedded vectors to other positions, for position rolling.

transformers applies RoPE before the cache sees the keys. Rotations compose,
``R(a) R(b) = R(a + b)``, so a key rotated at position ``p`` is moved to position ``q`` by
rotating it by ``q - p``, with the model's own frequencies and without a forked model.
Only the rotate-half layout (Llama, Mistral, Qwen, Gemma, ...) is supported.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RopeShifter:
    def __init__(self, inv_freq: torch.Tensor) -> None:
        # float64 angles: a shift by tens of thousands of positions keeps its precision.
        self.inv_freq = inv_freq.detach().double()
        self._on: dict[torch.device, torch.Tensor] = {}

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        """The frequencies on ``device``, copied there once (a CUDA graph captures no copy
        from host memory)."""
        if device not in self._on:
            self._on[device] = self.inv_freq.to(device)
        return self._on[device]

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> RopeShifter:
        """The frequencies of the model's rotary embedding (scaling already applied)."""
        for module in model.modules():
            inv_freq = getattr(module, "inv_freq", None)
            if isinstance(inv_freq, torch.Tensor):
                return cls(inv_freq)
        raise ValueError("position rolling needs a model with rotary position embeddings (RoPE)")

    def shift(self, x: torch.Tensor, by: int | torch.Tensor) -> torch.Tensor:
        """``x`` (..., head_dim) moved by ``by`` positions: an int, or a tensor shaped like
        ``x.shape[:-1]`` (one shift per vector)."""
        by = torch.as_tensor(by, device=x.device)
        angles = by[..., None].double() * self._frequencies(x.device)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
        moved = x.float() * cos + _rotate_half(x.float()) * sin
        return moved.to(x.dtype)
