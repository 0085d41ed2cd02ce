"""Model loading: embedded GGUF, its converted safetensors copy, and configuration errors."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach the Hugging Face hub

import time
from pathlib import Path

import pytest
import torch

from h2o_chat import loading
from h2o_chat.engine.attention import ATTENTION_NAME
from h2o_chat.config import ModelConfig


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """Load the embedded model twice into an empty cache folder.

    The GGUF is dequantized only once (~13 s); the spy keeps that GGUF-loaded model so the
    copy can be compared with it without a second conversion.
    """
    cache = tmp_path_factory.mktemp("h2o-chat-cache")
    converted = []
    real_convert = loading.convert_gguf

    def spy(*args, **kwargs):
        converted.append(real_convert(*args, **kwargs))
        return converted[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("H2O_CHAT_CACHE", str(cache))
        mp.setattr(loading, "convert_gguf", spy)
        start = time.perf_counter()
        first = loading.load_model()
        first_s = time.perf_counter() - start
        conversions_after_first = len(converted)
        start = time.perf_counter()
        second = loading.load_model(ModelConfig())
        second_s = time.perf_counter() - start
        copy = loading.converted_copy_path(loading.embedded_gguf_path())
    print(f"\nfirst load (GGUF conversion) {first_s:.1f} s, cached load {second_s:.1f} s")
    return {
        "cache": cache, "copy": copy, "first": first, "second": second,
        "gguf_model": converted[0] if converted else None,
        "conversions_after_first": conversions_after_first,
        "conversions_after_second": len(converted),
    }


def test_embedded_model_chats(loads):
    model, tokenizer = loads["first"]
    assert not model.training
    assert model.config._attn_implementation == ATTENTION_NAME
    assert tokenizer.pad_token is not None
    assert model.generation_config.pad_token_id is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()


def test_gguf_is_converted_once_and_the_copy_reused(loads):
    copy = loads["copy"]
    assert copy.parent == loads["cache"]
    assert (copy / "config.json").is_file()
    assert list(copy.glob("*.safetensors"))
    assert (copy / "tokenizer.json").is_file() or (copy / "tokenizer_config.json").is_file()
    # Only the finished copy is left: the temp folder it was written in was renamed.
    assert [p.name for p in loads["cache"].iterdir()] == [copy.name]
    assert loads["conversions_after_first"] == 1
    assert loads["conversions_after_second"] == 1  # the second load did not convert
    for model, _ in (loads["first"], loads["second"]):
        assert Path(model.name_or_path) == copy


def test_copy_has_the_gguf_weights(loads):
    gguf_model = loads["gguf_model"]
    model, tokenizer = loads["second"]
    gguf_params = dict(gguf_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, gguf_params[name]), name
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = gguf_model(ids).logits
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")
def test_a_loaded_model_keeps_none_of_its_file_mapped(loads):
    """Weights copied into a decoding layout must not leave the file they came from mapped
    beside them (its pages would stay resident: the weights twice over)."""
    model, _ = loads["second"]
    folder = str(Path(model.name_or_path))
    assert any(p.is_file() for p in Path(folder).glob("*.safetensors"))
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if folder in line]
    assert mapped == []


def test_fingerprint_changes_with_the_file(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"a" * 3_000_000)
    before = loading.gguf_fingerprint(gguf)
    stat = gguf.stat()
    gguf.write_bytes(b"a" * 2_999_999 + b"b")  # same size; restore mtime as cp -p would
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert loading.gguf_fingerprint(gguf) != before


def test_threads_follow_available_physical_cores():
    expected = min(loading.psutil.cpu_count(logical=False) or 1, len(os.sched_getaffinity(0)))
    assert loading.set_torch_threads() == expected == torch.get_num_threads()


def test_missing_local_path_is_named(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        loading.load_model(ModelConfig(source=str(missing)))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(FileNotFoundError, match="models/missing"):  # a folder, not a hub user
        loading.load_model(ModelConfig(source="models/missing"))
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        loading.load_model(ModelConfig(source=str(tmp_path), gguf_file="nothing.gguf"))


def test_non_causal_model_is_refused(tmp_path):
    from transformers import T5Config  # encoder-decoder: no AutoModelForCausalLM class

    T5Config(d_model=8, num_layers=1, num_heads=1, d_ff=8, vocab_size=10).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal"):
        loading.load_model(ModelConfig(source=str(tmp_path)))


def test_quantization_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="4bit needs a CUDA GPU; none is available"):
        loading.load_model(ModelConfig(quantization="4bit"))


def test_cuda_device_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        loading.load_model(ModelConfig(device="cuda"))


def test_auto_dtype_is_float32_on_cpu():
    assert loading.resolve_dtype("auto", use_cuda=False) == torch.float32
