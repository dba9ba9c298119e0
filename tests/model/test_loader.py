"""Model loading: sources, dummy weights, and clear errors for bad inputs."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.errors import ConfigError, ModelLoadError
from pdserve.model.files import default_model_path
from pdserve.model.loader import load_model


def test_dummy_weights_use_the_config_shape_and_generate(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir("llama")), load_format="dummy", dtype="float32", num_blocks=32)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, seed=1))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.loaded.arch.num_layers == 2


def test_loading_a_model_imports_neither_torch_dynamo_nor_sympy(tiny_model_dir: Any) -> None:
    """Both came in through random init and `to_empty` on meta tensors: 2-3 s of every
    engine start, twice a node's whole start-up on the tiny model."""
    code = (
        "import sys; from pdserve import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir('llama'))!r}, dtype='float32', num_blocks=16)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"


def test_dummy_default_model_keeps_tokenizer() -> None:
    llm = LLM("default", load_format="dummy", dtype="bfloat16", num_blocks=16, max_model_len=256)
    assert llm.tokenizer is not None and llm.tokenizer.encode("hi")
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelConfig(model=str(tmp_path / "nope")))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_corrupt_safetensors(tiny_model_dir: Any, tmp_path: Path) -> None:
    target = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), target)
    weights = next(target.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(ModelConfig(model=str(target), dtype="float32"))


def test_missing_weight_is_reported(tiny_model_dir: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    target = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), target)
    weights = next(target.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="lacks 1 weights"):
        load_model(ModelConfig(model=str(target), dtype="float32"))


def test_truncated_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(default_model_path().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(ModelConfig(model=str(bad)))


def test_gguf_reader_reads_what_the_gguf_package_reads() -> None:
    """Our header reader (fast) against gguf.GGUFReader: every metadata value, and every
    tensor's name, type, shape and bytes."""
    import gguf
    import numpy as np

    from pdserve.model.gguf_file import read_gguf

    fields, tensors, _ = read_gguf(default_model_path())
    reference = gguf.GGUFReader(str(default_model_path()))
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert fields == expected  # "GGUF.*" are the reader's own header entries
    assert len(tensors) == len(reference.tensors)
    for ours, theirs in zip(tensors, reference.tensors, strict=True):
        assert (ours.name, ours.tensor_type) == (theirs.name, theirs.tensor_type)
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)


def test_gguf_cut_inside_its_tensor_data(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(ModelConfig(model=str(bad)))


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError):
        load_model(ModelConfig(model=str(bad)))


def test_bad_config_values_fail_at_construction() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig(dtype="int3")
    with pytest.raises(ConfigError, match="load_format"):
        ModelConfig(load_format="pickle")


_HEAP_LEFT_RESIDENT = """
import ctypes, json
from pdserve.model.loader import _rss_bytes, release_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 1 MB blocks from the heap, as after big frees
libc.mallopt(-1, 1 << 40)  # M_TRIM_THRESHOLD: free never shrinks the heap by itself
blocks = [libc.malloc(1 << 20) for _ in range(300)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
keep = libc.malloc(1 << 20)  # above them: the heap's top stays in use
ctypes.memset(keep, 1, 1 << 20)
for b in blocks:
    libc.free(b)
before = _rss_bytes()
released = release_freed_memory()
print(json.dumps({"before": before, "after": _rss_bytes(), "released": released}))
"""


def _has_malloc_trim() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not _has_malloc_trim(), reason="no glibc: malloc_trim (and mallopt) absent")
def test_freed_heap_memory_goes_back_to_the_os() -> None:
    """What loading frees (conversion buffers, tensors copied to huge pages) glibc keeps
    resident; the loader hands it back (`release_freed_memory`). Here 300 MB freed below a
    live block, as a load leaves its heap: the RSS falls by most of it. (Its own process:
    the malloc settings it needs would stay with the test session.)"""
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_LEFT_RESIDENT], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout)
    assert r["released"] >= 250 << 20, r
    # what it reports is what the RSS lost, up to the pages Python touches between the two
    # readings (one 4 KB page once in a full suite run, 2026-12-05)
    assert abs(r["before"] - r["after"] - r["released"]) <= 16 << 12, r
