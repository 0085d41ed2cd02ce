"""The peer column: llama.cpp on the same GGUF file as the app's embedded model, against
h2o-chat, one conversation, greedy, the same prompt tokens and thread count, runs
alternating in one process.

llama.cpp comes from the ``llama-cpp-python`` package, an optional benchmark-only install
(``make test`` never needs it): ``pip install llama-cpp-python`` builds it from source
(a C++ compiler and cmake; minutes). llama.cpp reads the file's own Q4_1 weights, while
the app dequantizes them to float32 once (``loading``); for the same weights in float32 on
both sides, ``f32_copy`` writes the file out again with every tensor dequantized.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from h2o_chat.config import CacheConfig
from h2o_chat.engine.build import cache_from_config
from h2o_chat.loading import cache_root, embedded_gguf_path

from . import data
from .report import pyplot
from .speed import decode, prefill


def f32_copy(gguf: Path, target: Path) -> Path:
    """``gguf`` with every tensor dequantized to float32 (metadata kept), at ``target``."""
    import gguf as gguf_lib  # a dependency of the app (it reads GGUF files)

    reader = gguf_lib.GGUFReader(gguf)
    arch = reader.fields[gguf_lib.Keys.General.ARCHITECTURE].contents()
    writer = gguf_lib.GGUFWriter(target, arch)
    for field in reader.fields.values():
        # The writer writes the architecture and the GGUF.* header fields itself.
        if field.name == gguf_lib.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf_lib.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf_lib.Keys.General.FILE_TYPE:
            value = int(gguf_lib.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        weights = gguf_lib.quants.dequantize(tensor.data, tensor.tensor_type).astype("float32")
        writer.add_tensor(tensor.name, weights, raw_dtype=gguf_lib.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def llama_cpp_decode(path: Path, prompt: list[int], tokens: int, threads: int) -> float:
    """Seconds for ``tokens`` greedy decode steps after ``prompt`` in llama.cpp."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompt) + tokens + 16, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)
    # Greedy through llama.cpp's own sampler (top-k 1); each step decodes the token before.
    steps = llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0)
    next(steps)  # reads the prompt and picks the first token
    started = time.perf_counter()
    for _ in range(tokens):
        next(steps)
    seconds = time.perf_counter() - started
    llm.close()
    return seconds


def h2o_chat_decode(model, prompt: list[int], tokens: int, policy: str) -> float:
    """The same in h2o-chat's engine, on the app's default cache settings under ``policy``
    (``full``, or ``h2o`` at the app's budget, below the context: it evicts)."""
    settings = CacheConfig(policy=policy)
    cache = cache_from_config(model, settings)
    return decode(model, cache, prefill(model, cache, torch.tensor([prompt]), settings.prefill_chunk_size), tokens)


def run(model, tokenizer, context: int, tokens: int, repeats: int, threads: int, log=print) -> dict:
    """The float copy (540 MB) is written once beside the app's converted model, not
    among the results."""
    import llama_cpp  # noqa: F401  before anything is written or measured: a missing install names itself

    gguf = embedded_gguf_path()
    f32 = cache_root() / (gguf.stem + ".F32.gguf")
    if not f32.exists():
        log(f"  peer: writing {f32}")
        f32.parent.mkdir(parents=True, exist_ok=True)
        partial = f32.with_suffix(".partial")  # a run cut while writing leaves no file taken as whole
        f32_copy(gguf, partial).replace(f32)
    book = tokenizer(data.read_text(data.BOOK)[: 8 * context], add_special_tokens=False).input_ids[:context]
    engines = {
        "h2o-chat full cache (float32)": lambda: h2o_chat_decode(model, book, tokens, "full"),
        "h2o-chat h2o, the app's budget (float32)": lambda: h2o_chat_decode(model, book, tokens, "h2o"),
        "llama.cpp F32": lambda: llama_cpp_decode(f32, book, tokens, threads),
        "llama.cpp Q4_1 (the file as shipped)": lambda: llama_cpp_decode(gguf, book, tokens, threads),
    }
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(repeats):
        names = list(engines)
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            seconds[name].append(engines[name]())
        log(f"  peer round {round_ + 1}: " + ", ".join(f"{n} {tokens / s[-1]:.1f} tok/s" for n, s in seconds.items()))
    rows = [{"engine": name, "tok_s": tokens / statistics.median(runs), "runs_tok_s": [tokens / s for s in runs]}
            for name, runs in seconds.items()]
    return {"rows": rows, "config": {"context": context, "decode_tokens": tokens, "repeats": repeats,
                                     "threads": threads, "gguf": gguf.name}}


def markdown(result: dict) -> str:
    config = result["config"]
    by = {row["engine"]: row["tok_s"] for row in result["rows"]}
    f32, q4 = by["llama.cpp F32"], by["llama.cpp Q4_1 (the file as shipped)"]
    lines = [f"One conversation, {config['context']} tokens of context (*Pride and Prejudice*), "
             f"{config['decode_tokens']} greedy tokens per timed run, {config['repeats']} runs per engine "
             f"alternating, {config['threads']} thread(s), `{config['gguf']}`.", "",
             "| engine | decode tok/s (median) | vs llama.cpp F32 | vs llama.cpp Q4_1 | runs |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        runs = ", ".join(f"{x:.1f}" for x in row["runs_tok_s"])
        lines.append(f"| {row['engine']} | {row['tok_s']:.2f} | {row['tok_s'] / f32:.2f}x | "
                     f"{row['tok_s'] / q4:.2f}x | {runs} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    rows = result["rows"]
    ax.barh([row["engine"] for row in rows], [row["tok_s"] for row in rows])
    ax.set_xlabel("decode tokens/s, one conversation")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
