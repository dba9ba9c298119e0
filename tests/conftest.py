"""Shared fixtures: tiny random Hugging Face models on disk and the real default model."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NIXL/UCX in tests: bind loopback only; skip the InfiniBand module (it can crash at exit
# on machines with ibverbs providers installed). Subprocesses inherit these.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
# Stored /v1/responses (agent_api/store.py) of servers the tests start without their own
# --response-store go to a scratch directory, not the user's data directory.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="pdserve-tests-data-")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3")

# What each family's tiny model sets beyond the common sizes: the features that make the
# family differ (Gemma 3: five sliding layers, then a global one, as every Gemma 3 and as
# llama.cpp lays out a GGUF file's, each kind with its own rotary base, the global one
# scaled; Phi-3: half the head rotated, LongRoPE's short factors).
_FAMILY_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},
    "gemma3": {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "num_hidden_layers": 6,
        "sliding_window": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
    "phi3": {
        "partial_rotary_factor": 0.5,
        "pad_token_id": 0,
        "original_max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
        },
    },
}

# Property-based tests of the HTTP surface (tests/api/test_http_properties.py,
# tests/proxy/test_proxy_properties.py): `ci` is the suite's share, a few examples per
# property, the same ones every run; `soak` explores (bench/fuzz_http.sh, or
# `pytest --hypothesis-profile soak`). Each example is HTTP round trips to real processes.
_HTTP_PROPERTIES = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "ci", max_examples=20, derandomize=True, database=None, **_HTTP_PROPERTIES
)
settings.register_profile("soak", max_examples=300, **_HTTP_PROPERTIES)
settings.load_profile("ci")


def save_tiny_hf_model(path: Path, arch: str, seed: int = 0, **sizes: int) -> Path:
    """A 2-layer random model of the given family, saved as a Hugging Face directory;
    `sizes` override its config's (hidden_size=128 gives heads of 32, the CPU kernels')."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=arch in ("qwen2", "gemma3"),
    )
    common.update(copy.deepcopy(_FAMILY_CONFIG.get(arch, {})))
    common.update(sizes)
    if "hidden_size" in sizes and "head_dim" in common:  # heads follow the width asked for
        common["head_dim"] = common["hidden_size"] // common["num_attention_heads"]
        if "query_pre_attn_scalar" in common:
            common["query_pre_attn_scalar"] = common["head_dim"]
    rope = common.get("rope_parameters", {})
    if rope.get("rope_type") == "longrope":  # a factor per rotated pair
        head_dim = common["hidden_size"] // common["num_attention_heads"]
        pairs = int(head_dim * rope["partial_rotary_factor"]) // 2
        rope["short_factor"] = [1.0 + i / 2 for i in range(pairs)]
        rope["long_factor"] = [2.0 * (i + 1) for i in range(pairs)]
    config, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = cls(config(**common))
    with torch.no_grad():  # HF's init leaves biases at 0 and norms at 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return path


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF transformers' greedy continuation (ignoring EOS) and its raw logits [max_new, V]."""
    eos = model.config.eos_token_id
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=(eos[0] if isinstance(eos, list) else eos) or 0,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = save_tiny_hf_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_kernels_family(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`tiny_kernels_model`'s sizes in any family of TINY_ARCHS: family -> its directory."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(f"tiny-kernels-{family}")
            made[family] = save_tiny_hf_model(path, family, hidden_size=128, intermediate_size=256)
        return made[family]

    return get


@pytest.fixture(scope="session")
def tiny_kernels_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose head size (32) and widths fit the fused CPU kernels: where the
    kernel paths must run (exactness, batch invariance, chaos's `--batch-invariant`)."""
    return save_tiny_hf_model(
        tmp_path_factory.mktemp("tiny-kernels"), "llama", hidden_size=128, intermediate_size=256
    )


@cache
def _default_hf_reference() -> Any:
    from pdserve.model.files import default_model_path
    from pdserve_bench.hf_reference import hf_model_from_gguf

    model, _ = hf_model_from_gguf(default_model_path(), torch.float32)
    return model


@pytest.fixture(scope="session")
def smollm2_hf() -> Any:
    """HF transformers' Llama with SmolLM2's weights (fp32), the reference."""
    return _default_hf_reference()


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="session")
def smollm2_references(smollm2_llm: Any, smollm2_hf: Any) -> list[tuple[list[int], list[int], Any]]:
    """(prompt ids, HF's 16 greedy tokens, HF's logits) for each of SMOLLM2_PROMPTS, fp32."""
    refs = []
    for text in SMOLLM2_PROMPTS:
        ids = smollm2_llm.tokenizer.encode(text)
        tokens, logits = hf_greedy(smollm2_hf, ids, 16)
        refs.append((ids, tokens, logits))
    return refs


def assert_matches_hf(
    llm: Any, references: list[tuple[list[int], list[int], Any]], atol: float = 2e-3
) -> None:
    """Greedy tokens equal to HF's, and top-10 logprobs within `atol` of HF's, in fp32."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=10)
    for ids, tokens, logits in references:
        out = llm.generate([ids], params)[0].outputs[0]
        assert out.token_ids == tokens
        ref = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(out.logprobs):
            top_ids = [t for t, _ in entry.top]
            ours = torch.tensor([v for _, v in entry.top])
            torch.testing.assert_close(ours, ref[step, top_ids], atol=atol, rtol=1e-3)


@contextmanager
def cpu_level(name: str) -> Iterator[None]:
    """Run what is built inside at CPU level `name`, as PDSERVE_CPU_ISA=name would."""
    from pdserve.model import cpu_isa

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CPU_ISA", name)
        cpu_isa.effective.cache_clear()
        try:
            yield
        finally:
            cpu_isa.effective.cache_clear()


@pytest.fixture(scope="session")
def smollm2_llm() -> Any:
    """pdserve's LLM on the default model, fp32 with the weights dequantized (references
    are compared in fp32, to HF's model of the same dequantized weights)."""
    from pdserve import LLM

    return LLM("default", dtype="float32", quantization="none", num_blocks=512, max_model_len=2048)


# -- skips: each one for hardware or a kernel feature the machine lacks, never a package --
#
# make test prints every skip with its reason (`-rs`) and, below, their count by reason.
# The packages the suite needs are requirements (requirements-dev.txt): a test that finds
# one missing fails. Where PDSERVE_STRICT_SKIPS=1 (.ci/run sets it), a skip that names an
# install fails the run too, so one cannot creep back in.
_SKIPS: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        _SKIPS[reason] = _SKIPS.get(reason, 0) + 1


def _package_skips() -> list[str]:
    return [r for r in _SKIPS if "install" in r.lower()]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("PDSERVE_STRICT_SKIPS") == "1" and _package_skips() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _SKIPS:
        return
    terminalreporter.section("skips by reason")
    for reason, count in sorted(_SKIPS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{count:5d}  {reason}")
    if os.environ.get("PDSERVE_STRICT_SKIPS") == "1" and _package_skips():
        terminalreporter.write_line(f"FAILED: skips for a missing package: {_package_skips()}")
