"""The families beyond Llama (Qwen3, Gemma 3, Phi-3) against Hugging Face transformers in
float32, on every kernel path this CPU runs; their GGUF files as llama.cpp's own converter
writes them; their SentencePiece vocabularies read from GGUF.

The tiny models (tests/conftest.py) carry each family's differences: Qwen3's per-head q/k
norms; Gemma 3's four norms with (1 + w), GeGLU, scaled embeddings, a sliding layer (a
window of 24, shorter than most prompts here) beside a global one with its own rotary base
and linear scaling; Phi-3's half-rotated heads and LongRoPE's short factors. Heads of 32
and widths of 128/256, so the CPU kernels run them.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import cpu_isa
from tests.conftest import cpu_level, hf_greedy, save_tiny_hf_model
from tests.model.test_cpu_kernels import VARIANTS, variant_params

pytestmark = pytest.mark.timeout(300)

FAMILIES = ("qwen3", "gemma3", "phi3")
SPM_FAMILIES = ("gemma3", "phi3")
"""Families whose tokenizers are SentencePiece's (Gemma's, and Phi-3's Llama 2 one)."""
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
MULTILINGUAL = (
    "The capital of France is Paris. Héllo wörld! 你好，世界。 Привет мир 🚀  two  spaces\n"
)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(5, 90))] for _ in range(n)]


def save_sentencepiece_tokenizer(path: Path, family: str) -> None:
    """A SentencePiece BPE vocabulary of the tiny models' 320 pieces (byte fallback), as
    `tokenizer.model` and as the Hugging Face tokenizer the family uses."""
    import sentencepiece as spm
    import transformers

    text = (
        "The capital of France is Paris. Two plus two is four. Once upon a time, in a "
        "small village, there lived an old man.\ndef fibonacci(n): return n\n"
    ) * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_writer=model, vocab_size=320,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, add_dummy_prefix=family != "gemma3",
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2,
    )  # fmt: skip
    (path / "tokenizer.model").write_bytes(model.getvalue())
    cls = "GemmaTokenizer" if family == "gemma3" else "LlamaTokenizer"
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    # transformers converts the model file into its tokenizer (tokenizer.json).
    transformers.AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(path))


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(f"family-{family}")
            save_tiny_hf_model(path, family, hidden_size=128, intermediate_size=256)
            if family in SPM_FAMILIES:
                save_sentencepiece_tokenizer(path, family)
            else:
                from tests.proxy.conftest import save_byte_tokenizer

                save_byte_tokenizer(path)
            made[family] = path
        return made[family]

    return get


@pytest.fixture(scope="module")
def references(family_dir: Any) -> Any:
    """HF transformers' greedy tokens and logits (float32) per family, for `prompts(3, 1)`."""
    made: dict[str, list[tuple[list[int], list[int], torch.Tensor]]] = {}

    def get(family: str) -> list[tuple[list[int], list[int], torch.Tensor]]:
        if family not in made:
            import transformers

            path = family_dir(family)
            ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            made[family] = [
                (p, *hf_greedy(ref.eval(), p, GREEDY.max_tokens)) for p in prompts(3, 1)
            ]
        return made[family]

    return get


def _assert_close_to(llm: LLM, refs: Any, atol: float) -> None:
    for prompt, tokens, logits in refs:
        out = llm.generate([prompt], GREEDY)[0].outputs[0]
        assert out.token_ids == tokens
        ref = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(out.logprobs or []):
            ids = [t for t, _ in entry.top]
            ours = torch.tensor([v for _, v in entry.top])
            torch.testing.assert_close(ours, ref[step, ids], atol=atol, rtol=1e-4)


def _bf16_close_to(llm: LLM, refs: Any) -> None:
    """bf16 against the float32 truth: the first step's logprobs within bf16's reach (as
    test_tiny_vs_hf's bf16 test), and greedy paths that mostly agree."""
    agree = total = 0
    for prompt, tokens, logits in refs:
        out = llm.generate([prompt], GREEDY)[0].outputs[0]
        entry = (out.logprobs or [])[0]
        ids = [t for t, _ in entry.top]
        ours = torch.tensor([v for _, v in entry.top])
        ref = torch.log_softmax(logits, -1)[0, ids]
        torch.testing.assert_close(ours, ref, atol=0.08, rtol=0.02)
        agree += out.token_ids[0] == tokens[0]
        total += 1
    assert agree == total, f"first tokens agree {agree}/{total}"


PATHS = [pytest.param("torch", id="torch"), *variant_params(["fp32-avx512", "fp32-avx2", "bf16"])]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_on_each_kernel_path(
    family: str, path: str, family_dir: Any, references: Any
) -> None:
    """Greedy tokens equal to HF's and logprobs within float32 rounding, on plain PyTorch
    ops and on each CPU kernel library this machine runs (the AVX2 one forced on bigger
    CPUs); bf16 within bf16's reach of the float32 truth."""
    refs = references(family)
    if path == "torch":
        llm = LLM(str(family_dir(family)), dtype="float32", kernels="torch", num_blocks=64)
        _assert_close_to(llm, refs, atol=2e-4)
        return
    dtype, isa = VARIANTS[path]
    with cpu_level(isa.label):
        llm = LLM(str(family_dir(family)), dtype=str(dtype).removeprefix("torch."), num_blocks=64)
    assert "cpu-kernels" in llm.engine.runner.ops.label, llm.engine.runner.ops.label
    if dtype == torch.float32:
        _assert_close_to(llm, refs, atol=2e-4)
    else:
        _bf16_close_to(llm, refs)


@pytest.fixture(scope="module")
def family_gguf(family_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each family's directory converted by llama.cpp's convert_hf_to_gguf.py (f32 or q8_0)."""
    from pdserve_bench.llamacpp_convert import convert

    made: dict[tuple[str, str], Path] = {}

    def get(family: str, outtype: str = "f32") -> Path:
        if (family, outtype) not in made:
            out = tmp_path_factory.mktemp("gguf") / f"{family}.{outtype}.gguf"
            pre = None if family in SPM_FAMILIES else "qwen2"
            made[family, outtype] = convert(family_dir(family), out, outtype, bpe_pre=pre)
        return made[family, outtype]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_from_llama_cpp_equals_the_directory(
    family: str, family_gguf: Any, references: Any
) -> None:
    """The file llama.cpp's converter writes (its names, its metadata: Gemma's norms with
    the 1 added, its sliding layout and local base, Phi-3's fused gate/up and rotary
    dimensions) runs as the directory does: HF's tokens and logprobs, float32 kernels."""
    llm = LLM(str(family_gguf(family)), dtype="float32", num_blocks=64)
    _assert_close_to(llm, references(family), atol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_runs_on_its_blocks(family: str, family_gguf: Any, family_dir: Any) -> None:
    """A Q8_0 file from the converter stays in its blocks (the kernels compute on them)
    and answers as the float32 directory does, within Q8_0's rounding."""
    if cpu_isa.effective() < cpu_isa.CpuIsa.AVX2:
        pytest.skip("no CPU kernels below AVX2: weights are dequantized at load")
    q8 = LLM(str(family_gguf(family, "q8_0")), dtype="float32", num_blocks=64)
    assert q8.engine.loaded.model.quantized, q8.engine.loaded.quantization
    dense = LLM(str(family_dir(family)), dtype="float32", num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    for prompt in prompts(3, 2):
        a = dense.generate([prompt], params)[0].outputs[0]
        b = q8.generate([prompt], params)[0].outputs[0]
        first_a, first_b = dict(a.logprobs[0].top), dict(b.logprobs[0].top)
        assert a.token_ids[0] == b.token_ids[0]
        assert all(abs(v - first_b[t]) < 0.05 for t, v in first_a.items() if t in first_b)


@pytest.mark.parametrize("family", SPM_FAMILIES)
def test_sentencepiece_vocabulary_from_gguf_equals_hf(
    family: str, family_gguf: Any, family_dir: Any
) -> None:
    """A SentencePiece vocabulary read back from the GGUF file tokenizes a multilingual
    text (bytes outside the vocabulary fall back to <0xNN> pieces) as the Hugging Face
    tokenizer of the same tokenizer.model does, and decodes back to the text."""
    import sentencepiece as spm
    import transformers

    from pdserve.model.gguf_file import open_gguf

    ours = open_gguf(family_gguf(family)).tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(str(family_dir(family)))
    sp = spm.SentencePieceProcessor(model_file=str(family_dir(family) / "tokenizer.model"))
    for text in (MULTILINGUAL, "plain words", " leading space", "two\n\nlines"):
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("path", variant_params(["fp32-avx512", "fp32-avx2", "bf16"]))
@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_decode_is_bit_identical_to_per_op(
    family: str, path: str, family_dir: Any
) -> None:
    """A decode step of every layer in one kernel call (`pd_decode_layers`: the families'
    norms, GeGLU, windows and rotary tables per layer) computes the per-op path's bits,
    so a request's numbers never depend on whether a prefill shared its step."""
    dtype, isa = VARIANTS[path]
    with cpu_level(isa.label):
        llm = LLM(str(family_dir(family)), dtype=str(dtype).removeprefix("torch."), num_blocks=64)
    ops = llm.engine.runner.ops
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    batch = prompts(4, 7)  # up to 90 tokens: past the tiny Gemma's window of 24
    try:
        ops.one_call = False
        per_op = llm.generate(batch, params)
    finally:
        ops.one_call = True
    one_call = llm.generate(batch, params)
    for a, b in zip(per_op, one_call, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e.top for e in a.outputs[0].logprobs] == [e.top for e in b.outputs[0].logprobs]
