"""A layer's input projections as one matrix product each, and the rotary embedding of
queries and keys in four operations.

On a GPU a decode step of one conversation is bound by the kernels it runs (see
``fused_norms``). transformers' Llama attention runs its query, key and value
projections as three products and rotates queries and keys apart (a negation, a
concatenation, two products and a sum each: ten kernels a layer); its MLP runs the gate
and up projections as two. Here each attention's three weights are one matrix, and each
MLP's two: one product, whose output is cut into its parts by views. Each projection's
own weight becomes a view of the stacked matrix, so the model holds its weights once and
its state dict keeps its keys. The queries and keys of the one output are rotated
together: ``x·cos + roll(x)·sin'``, where ``roll`` swaps the halves of each head and
``sin'`` is the sine with its first half negated (computed once a forward and shared by
the layers) — the same products and sums as transformers' ``rotate_half``, so the same
bits.

Only modules that are exactly what is rewritten are replaced: an attention whose forward
is transformers' Llama code (Llama, Granite, Gemma), or that code passing the attention
function a sliding window (Mistral, Qwen2: passed on the same), not Qwen3's (it norms
queries and keys); an MLP whose forward is Llama's (most models'); plain ``nn.Linear``
projections (not bitsandbytes' quantized ones) in one dtype on one device; no
accelerate hook. A probe input checked when the model loads confirms each replacement
computes what the module computes. The projection modules stay in the model (their
weights, views, are what is saved) but the fused forms do not call them: a hook on one,
or a wrapper put around one after loading, is not run.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable

import torch
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

from h2o_chat.fused_norms import probe_input

_PROBE_TOKENS = 3
# A stacked product may sum in another order than the separate ones (another GPU kernel
# for the wider matrix): a few units in the last place of the dtype, relative to the
# output's scale. A different formula is off by the output's own size.
_PROBE_UNITS = 8
# A forward's signature ends at the line closing its parentheses; its body follows.
_SIGNATURE_END = re.compile(r"^\s*\)( -> .*)?:\s*$")
# The one argument Mistral's and Qwen2's copies of Llama's attention add to the attention
# call, and how each reads it from its module.
_WINDOW_LINE = re.compile(r"^\s*sliding_window=(?P<expression>.+?),\s*(#.*)?$")
_WINDOWS: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "self.sliding_window": lambda module: module.sliding_window,
    'getattr(self.config, "sliding_window", None)': lambda module: getattr(module.config, "sliding_window", None),
}


class SignedSine(threading.local):
    """The rotary sine with its first half negated, for the ``sin`` tensor a forward hands
    every layer: computed by the first layer, reused by the rest. Per thread, as two
    threads may run the model at once."""

    source: torch.Tensor | None = None
    signed: torch.Tensor | None = None

    def of(self, sin: torch.Tensor) -> torch.Tensor:
        if self.source is not sin:
            half = sin.shape[-1] // 2
            self.signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            self.source = sin
        return self.signed


class FusedAttention(torch.nn.Module):
    """A Llama attention with its three projections as one product and its queries and
    keys rotated at once; the replaced module serves what this does not (another dtype
    than the weights', no rotary embedding) and is what the attention function sees."""

    def __init__(self, replaced: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                 sine: SignedSine, extras: dict) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, getattr(replaced, name))  # the same modules: the state dict's keys
        # Not persistent: the projections' own weights are views of it and are what is saved.
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)
        self.head_dim = replaced.head_dim
        self.rotated_heads = (replaced.q_proj.out_features + replaced.k_proj.out_features) // self.head_dim
        self.query_heads = replaced.q_proj.out_features // self.head_dim
        self.sine, self.extras = sine, extras  # extras: what the replaced forward adds to the attention call
        self.__dict__["replaced"] = replaced  # not a submodule: its projections are this one's
        # The fallback the replaced forward names, from its own modeling file.
        self.__dict__["eager"] = type(replaced).forward.__globals__["eager_attention_forward"]

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.replaced
        if (position_embeddings is None or hidden_states.dtype != self.qkv_weight.dtype
                or position_embeddings[0].shape[-1] != self.head_dim):
            return module(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                          past_key_values=past_key_values, **kwargs)
        input_shape = hidden_states.shape[:-1]
        heads = F.linear(hidden_states, self.qkv_weight, self.qkv_bias).view(*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        rotating = heads[..., : self.rotated_heads, :]
        rotated = rotating * cos.unsqueeze(-2)
        rotated += torch.roll(rotating, self.head_dim // 2, dims=-1).mul_(self.sine.of(sin).unsqueeze(-2))
        query = rotated[..., : self.query_heads, :].transpose(1, 2)
        key = rotated[..., self.query_heads :, :].transpose(1, 2)
        value = heads[..., self.rotated_heads :, :].transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, module.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, self.eager)
        output, weights = attend(module, query, key, value, attention_mask,
                                 dropout=0.0 if not module.training else module.attention_dropout,
                                 scaling=module.scaling, **self.extras, **kwargs)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class FusedMLP(torch.nn.Module):
    """A gated MLP with its gate and up projections as one product."""

    def __init__(self, replaced: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = replaced.gate_proj, replaced.up_proj, replaced.down_proj
        self.register_buffer("gate_up_weight", weight, persistent=False)
        self.register_buffer("gate_up_bias", bias, persistent=False)
        self.act_fn = replaced.act_fn
        self.split = (replaced.gate_proj.out_features, replaced.up_proj.out_features)
        self.__dict__["replaced"] = replaced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.gate_up_weight.dtype:
            return self.replaced(x)
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).split(self.split, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(model: torch.nn.Module) -> tuple[int, int]:
    """Replace every Llama attention and gated MLP of ``model`` that the fused forms
    compute as they do; returns how many attentions and MLPs were replaced."""
    sine = SignedSine()
    attentions = mlps = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            extras = _attention_extras(module)
            if extras is not None:
                fused = _fused(module, ("q_proj", "k_proj", "v_proj"), _attention_probe,
                               lambda weight, bias: FusedAttention(module, weight, bias, sine, extras))
                attentions += fused is not None
            elif _source(module) == _llama_sources()[1]:
                fused = _fused(module, ("gate_proj", "up_proj"), _mlp_probe,
                               lambda weight, bias: FusedMLP(module, weight, bias))
                mlps += fused is not None
            else:
                continue
            if fused is not None:
                setattr(parent, name, fused)
    return attentions, mlps


@functools.cache
def _llama_sources() -> tuple[tuple[str, ...] | None, str | None]:
    """The body of transformers' Llama attention forward, and its MLP's forward."""
    return _body(_class_source(modeling_llama.LlamaAttention)), _class_source(modeling_llama.LlamaMLP)


def _source(module: torch.nn.Module) -> str | None:
    """The source of ``module``'s forward (a modeling file's copy of another's is equal to
    it), or None where accelerate has hooked it or there is none to read."""
    return None if hasattr(module, "_hf_hook") else _class_source(type(module))


@functools.cache
def _class_source(cls: type) -> str | None:
    """``cls``'s forward as written, read once per class (a model has hundreds of modules
    of a few classes)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def _body(source: str | None) -> tuple[str, ...] | None:
    """A forward's lines after its signature (whose annotations vary between copies)."""
    lines = (source or "").splitlines()
    end = next((index for index, line in enumerate(lines) if _SIGNATURE_END.match(line)), None)
    return None if end is None else tuple(lines[end + 1 :])


def _attention_extras(module: torch.nn.Module) -> dict | None:
    """The arguments ``module``'s forward adds to the attention call where its forward is
    Llama's attention but for them (none for Llama's own); None for any other code."""
    if not hasattr(module, "q_proj"):
        return None
    body, llama = _body(_source(module)), _llama_sources()[0]
    if body is None:
        return None
    if body == llama:
        return {}
    windows = [(index, match) for index, line in enumerate(body) if (match := _WINDOW_LINE.match(line))]
    if len(windows) != 1 or windows[0][1]["expression"] not in _WINDOWS:
        return None
    index, match = windows[0]
    if body[:index] + body[index + 1 :] != llama:
        return None
    return {"sliding_window": _WINDOWS[match["expression"]](module)}


def _fused(module: torch.nn.Module, names: tuple[str, ...], probe, build) -> torch.nn.Module | None:
    """The fused form of ``module`` (``build(weight, bias)``, the projections ``names``
    stacked) when the probe shows it computes what ``module`` does, its projections'
    weights then views of the stacked one; else None, and ``module`` untouched."""
    linears = [getattr(module, name, None) for name in names]
    if not all(type(linear) is torch.nn.Linear for linear in linears):  # bitsandbytes' are subclasses
        return None
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    first = weights[0]
    if (first.device.type == "meta" or not first.is_floating_point()
            or any(w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1] for w in weights)
            or any((b is None) != (biases[0] is None) for b in biases)):
        return None
    with torch.no_grad():
        weight = _stacked([w.detach() for w in weights])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        fused = build(weight, bias)
        if not probe(module, fused):
            return None
        start = 0
        for linear in linears:
            rows = linear.out_features
            linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                linear.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
    return fused


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights one under the other, ``(sum of outputs, inputs)``, laid out as they are:
    column-major where ``loading.own_weights_for_decoding`` made them so on a CPU."""
    if all(w.dim() == 2 and w.shape[0] > 1 and w.stride() == (1, w.shape[0]) for w in weights):
        return torch.cat([w.t() for w in weights], dim=1).t()
    return torch.cat(weights, dim=0)


def _attention_probe(module: torch.nn.Module, fused: FusedAttention) -> bool:
    hidden = probe_input((1, _PROBE_TOKENS, module.q_proj.in_features), fused.qkv_weight)
    generator = torch.Generator(device=hidden.device).manual_seed(1)
    angles = torch.rand((1, _PROBE_TOKENS, module.head_dim // 2), generator=generator, device=hidden.device) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    rotary = (angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype))
    try:
        own = module(hidden, position_embeddings=rotary, attention_mask=None)[0]
        theirs = fused(hidden, position_embeddings=rotary, attention_mask=None)[0]
    except Exception:  # whatever an unforeseen module raises: it keeps its own forward
        return False
    return _close(own, theirs)


def _mlp_probe(module: torch.nn.Module, fused: FusedMLP) -> bool:
    hidden = probe_input((1, _PROBE_TOKENS, module.gate_proj.in_features), fused.gate_up_weight)
    return _close(module(hidden), fused(hidden))


def _close(own: torch.Tensor, theirs: torch.Tensor) -> bool:
    if own.dtype != theirs.dtype or own.shape != theirs.shape:
        return False
    tolerance = _PROBE_UNITS * torch.finfo(own.dtype).eps
    own, theirs = own.float(), theirs.float()
    scale = own.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return bool(((own - theirs).abs().max() <= tolerance * scale).item())
