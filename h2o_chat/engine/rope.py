"""Moving rotary-embedded vectors to other positions, for position rolling.

transformers applies RoPE before the cache sees the keys. Rotations compose,
``R(a) R(b) = R(a + b)``, so a key rotated at position ``p`` is moved to position ``q`` by
rotating it by ``q - p``, with the model's own frequencies and without a forked model.
Only the rotate-half layout over the whole head (Llama, Mistral, Qwen, Gemma, ...) is
supported, with one set of frequencies for every layer; ``from_model`` refuses by name a
model that rotates otherwise, as shifting its keys would misplace them without an error.
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
        """The frequencies of the model's rotary embedding (scaling already applied);
        ValueError naming the model where shifting by them would misplace its keys."""
        name = type(model).__name__
        rotaries = [module for module in model.modules() if isinstance(getattr(module, "inv_freq", None), torch.Tensor)]
        if not rotaries:
            if any(buffer.endswith("_inv_freq") for buffer, _ in model.named_buffers()):
                raise ValueError(f"position rolling (cache.rolling) cannot serve {name}: its rotary position "
                                 "embeddings use other frequencies in each kind of layer, and the cache moves "
                                 "every layer's keys by one set")
            raise ValueError(f"position rolling (cache.rolling) needs a model with rotary position embeddings "
                             f"(RoPE); {name} has none")
        shifter = cls(rotaries[0].inv_freq)
        problem = shifter._layout_problem(rotaries[0], _head_dim(model))
        if problem is not None:
            raise ValueError(f"position rolling (cache.rolling) cannot serve {name}: its rotary position "
                             f"embedding {problem}, and the cache moves keys by rotating halves of the whole head")
        return shifter

    def _layout_problem(self, rotary: torch.nn.Module, head_dim: int | None) -> str | None:
        """How ``rotary``'s cos differs from the rotate-half layout over ``head_dim`` that
        ``shift`` assumes (None: it does not), seen on a few positions."""
        device = self.inv_freq.device if rotary.inv_freq.device.type == "meta" else rotary.inv_freq.device
        positions = torch.tensor([[0, 1, 7, 100]], device=device)
        with torch.no_grad():
            cos, _ = rotary(torch.zeros(1, device=device, dtype=torch.float32), positions)
        if head_dim is not None and cos.shape[-1] != head_dim:
            return f"rotates {cos.shape[-1]} of each head's {head_dim} dimensions (partial rotary)"
        angles = positions[..., None].double() * self._frequencies(device)
        expected = torch.cat((angles, angles), dim=-1).cos() * getattr(rotary, "attention_scaling", 1.0)
        if cos.shape != expected.shape or not torch.allclose(cos.double(), expected, atol=1e-4):
            return "pairs the dimensions of a head otherwise than in two halves (e.g. interleaved)"
        return None

    def shift(self, x: torch.Tensor, by: int | torch.Tensor) -> torch.Tensor:
        """``x`` (..., head_dim) moved by ``by`` positions: an int, or a tensor shaped like
        ``x.shape[:-1]`` (one shift per vector)."""
        by = torch.as_tensor(by, device=x.device)
        angles = by[..., None].double() * self._frequencies(x.device)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
        moved = x.float() * cos + _rotate_half(x.float()) * sin
        return moved.to(x.dtype)


def _head_dim(model: torch.nn.Module) -> int | None:
    """The size of the model's cached keys per head, where its config tells."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config(decoder=True)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
