"""Weights kept in GGUF blocks (Q8_0, Q4_0, Q4_1): the formats against the gguf library,
the kernels against a PyTorch reference of the same integer arithmetic on every kernel
variant this CPU runs, and the default model loaded quantized against it dequantized."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.errors import ConfigError, ModelLoadError
from pdserve.model import cpu_kernels, quant
from pdserve.model.files import default_model_path
from pdserve.model.loader import load_model
from pdserve.model.ops import CpuKernelOps
from pdserve.model.quant import QuantLinear, QuantType
from tests.conftest import assert_matches_hf, cpu_level
from tests.model.test_cpu_kernels import VARIANTS, variant_params

TYPES = list(QuantType)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.label)
def test_formats_match_the_gguf_library(qtype: QuantType) -> None:
    """Our quantizer writes ggml's bytes and our dequantizer reads them back as gguf does."""
    import gguf

    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.rand(64, 1)  # rows of different scales
    w[3] = 0.0  # an all-zero block: scale 0
    ours = quant.quantize(w, qtype)
    ggml_type = gguf.GGMLQuantizationType[qtype.name]
    theirs = gguf.quants.quantize(w.numpy(), ggml_type)
    assert ours.shape == (64, qtype.row_bytes(256))
    assert np.array_equal(ours.numpy(), theirs)
    dense = quant.dequantize(ours, qtype, 256)
    assert torch.equal(dense, torch.from_numpy(gguf.quants.dequantize(theirs, ggml_type)))


@pytest.fixture(params=variant_params())
def k(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    dtype, isa = VARIANTS[request.param]
    kernels = cpu_kernels.load(dtype, isa)
    assert kernels is not None
    return kernels


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.label)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 33])  # 1-4: widened in registers
def test_linear_is_the_dequantized_product(
    k: cpu_kernels.CpuKernels, qtype: QuantType, m: int
) -> None:
    torch.manual_seed(m)
    n, kk = 67, 576  # odd n: a last weight-row pair of one
    blocks = quant.quantize(torch.randn(n, kk) * 0.05, qtype)
    bias = torch.randn(n).to(k.dtype)
    layer = QuantLinear(kk, n, qtype, torch.nn.Parameter(bias, requires_grad=False))
    layer.qweight = blocks
    x = torch.randn(m, kk).to(k.dtype)
    y = k.linear_quant(x, layer)
    dense = quant.dequantize(blocks, qtype, kk).double()
    expected = x.double() @ dense.T + bias.double()
    assert y.dtype == k.dtype and y.shape == (m, n)
    step = 2**-8 if k.dtype == torch.bfloat16 else 2**-18  # float32: sums in another order
    scale = expected.abs().amax().item()
    assert (y.double() - expected).abs().max().item() <= 2 * step * scale


@pytest.mark.parametrize("qtype", [None, *TYPES], ids=lambda t: t.label if t else "dense")
@pytest.mark.parametrize("m", [1, 4, 5, 33])  # blocks: 1-4 widened in registers
def test_logits_are_float32_products(qtype: QuantType | None, m: int) -> None:
    """The bf16 library's LM head (`pd_logits`) writes float32: the product of the bf16
    activations and the weight as kept, summed in float32, not rounded to bf16. (From 5
    rows, blocks are dequantized to bf16 for the dense loop, as every bf16 linear does.)"""
    k = cpu_kernels.load(torch.bfloat16)
    if k is None:
        pytest.skip(f"no bf16 kernels: {cpu_kernels.unavailable_reason(torch.bfloat16)}")
    torch.manual_seed(m)
    n, kk = 203, 576  # n % 4 != 0: the dense loop's leftover rows
    w = torch.randn(n, kk) * 0.05
    if qtype is None:
        head: Any = torch.nn.Linear(kk, n, bias=False).to(torch.bfloat16)
        head.weight.data.copy_(w)
        dense = head.weight.double()
    else:
        head = QuantLinear(kk, n, qtype, None)
        head.qweight = quant.quantize(w, qtype)
        dense = quant.dequantize(head.qweight, qtype, kk)
        dense = (dense if m <= 4 else dense.to(torch.bfloat16)).double()
    x = torch.randn(m, kk).to(torch.bfloat16)
    y = k.logits(x, head)
    expected = x.double() @ dense.T
    assert y.dtype == torch.float32 and y.shape == (m, n)
    scale = expected.abs().amax().item()
    assert (y.double() - expected).abs().max().item() <= 2**-18 * scale  # float sums only


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.label)
def test_dequantize_kernel_equals_the_reference(
    k: cpu_kernels.CpuKernels, qtype: QuantType
) -> None:
    blocks = quant.quantize(torch.randn(300, 128), qtype)  # 300 rows: the parallel split
    assert torch.equal(
        k.dequantize(blocks, qtype, 128), quant.dequantize(blocks, qtype, 128).to(k.dtype)
    )


@pytest.fixture(scope="module", params=variant_params(["fp32-avx512", "fp32-avx2", "bf16"]))
def quant_llm(request: pytest.FixtureRequest) -> Any:
    """The default model as its file stores it (Q4_1 layers, Q8_0 embedding and head), on
    one variant's kernels."""
    dtype, isa = VARIANTS[request.param]
    with cpu_level(isa.label):  # quantization "auto": the file's blocks, in either dtype
        llm = LLM("default", dtype=str(dtype).removeprefix("torch."), num_blocks=256,
                  max_model_len=1024, max_num_batched_tokens=48)  # fmt: skip
    assert llm.engine.loaded.model.quantized
    assert isinstance(llm.engine.runner.ops, CpuKernelOps)
    return llm


def test_quantized_model_computes_the_dequantized_one(
    quant_llm: Any, smollm2_llm: Any, smollm2_references: Any
) -> None:
    """On its blocks the model computes what HF computes on the dequantized weights: in
    float32, HF's greedy tokens and logprobs. In bf16, along the float32 model's greedy
    path, the same top choice almost everywhere and logprobs within bf16's reach."""
    if quant_llm.engine.runner.ops.k.dtype == torch.float32:
        assert_matches_hf(quant_llm, smollm2_references)
        return
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    agree = total = 0
    errs = []
    for text in ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]:
        prompt = smollm2_llm.tokenizer.encode(text)
        ref = smollm2_llm.generate([prompt], params)[0].outputs[0]
        for step, token in enumerate(ref.token_ids):
            out = quant_llm.generate([prompt + ref.token_ids[:step]], one)[0].outputs[0]
            total += 1
            agree += out.token_ids[0] == token
            ours = dict(out.logprobs[0].top)
            errs += [abs(v - ours[t]) for t, v in ref.logprobs[step].top if t in ours]
    assert agree / total >= 0.9, f"top-1 agreement {agree}/{total}"
    assert float(np.mean(errs)) < 0.1, f"mean |logprob difference| {np.mean(errs):.3f}"


def test_quantized_one_call_is_bit_identical_to_per_op(quant_llm: Any) -> None:
    prompts = [[100 + i] * (5 + 7 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    ops = quant_llm.engine.runner.ops
    try:
        ops.one_call = False
        per_op = quant_llm.generate(prompts, params)
    finally:
        ops.one_call = True
    one_call = quant_llm.generate(prompts, params)
    for a, b in zip(per_op, one_call, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [e.top for e in a.outputs[0].logprobs] == [e.top for e in b.outputs[0].logprobs]


def test_quantized_default_model_names_paris(quant_llm: Any) -> None:
    """A near tie ("The" 0.08 above "L" in float32): bf16 answers Paris too since its logits
    are float32; rounded to bf16 they said "L'Étoile" on the blocks."""
    out = quant_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12),
    )
    assert "Paris" in out[0].outputs[0].text


def test_memory_follows_the_file(quant_llm: Any) -> None:
    """The weights in memory are about the file's size, not the dense model's."""
    loaded = quant_llm.engine.loaded
    blocks = sum(m.qweight.nbytes for m in quant.quant_modules(loaded.model))
    file_size = default_model_path().stat().st_size
    assert blocks <= file_size
    assert sum(p.nbytes for p in loaded.model.parameters()) < 0.05 * file_size  # norms only
    assert "MB in memory" in loaded.quantization


@pytest.mark.parametrize("asked", ["q8_0", "q4_0"])
def test_asked_format_converts_the_file(asked: str) -> None:
    if cpu_kernels.load(torch.float32) is None:
        pytest.skip(f"no float32 kernels: {cpu_kernels.unavailable_reason(torch.float32)}")
    llm = LLM("default", dtype="float32", quantization=asked, num_blocks=32, max_model_len=256)
    model = llm.engine.loaded.model
    assert model.layers[0].mlp.down_proj.qtype == QuantType.parse(asked)
    assert model.embed_tokens.qtype == QuantType.Q8_0
    assert model.lm_head.qweight is model.embed_tokens.qweight  # still tied
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12),
    )
    assert "Paris" in out[0].outputs[0].text


def test_auto_without_kernels_dequantizes_and_asking_is_an_error() -> None:
    loaded = load_model(ModelConfig(dtype="float32", kernels="torch", max_model_len=128))
    assert not loaded.model.quantized and loaded.quantization.startswith("none (auto")
    loaded = load_model(ModelConfig(dtype="bfloat16", kernels="torch", max_model_len=128))
    assert not loaded.model.quantized and loaded.quantization.startswith("none (auto")
    with pytest.raises(ConfigError, match="quantization q8_0 computes on the CPU kernels"):
        load_model(ModelConfig(dtype="float32", kernels="torch", quantization="q8_0"))
    with pytest.raises(ConfigError, match="quantization must be one of"):
        ModelConfig(quantization="q3_k")


def test_corrupt_scale_is_refused(tmp_path: Any) -> None:
    """A block whose fp16 scale is NaN: a clear load error naming the tensor."""
    if cpu_kernels.load(torch.float32) is None:
        pytest.skip(f"no float32 kernels: {cpu_kernels.unavailable_reason(torch.float32)}")
    import gguf

    reader = gguf.GGUFReader(default_model_path())
    offset = next(t.data_offset for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    data = bytearray(default_model_path().read_bytes())
    data[offset : offset + 2] = np.array([np.nan], np.float16).tobytes()
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"layers\.3\.mlp\.down_proj\.weight.*not a finite"):
        load_model(ModelConfig(model=str(bad), dtype="float32", max_model_len=128))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied head; tied head and qkv bias
def test_hf_checkpoint_quantized_at_load(arch: str, tmp_path: Any) -> None:
    """A dense checkpoint asked for Q8_0: every linear and the embedding in blocks, and
    logprobs close to the dense model's (Q8_0 keeps ~0.4% of each weight)."""
    if cpu_kernels.load(torch.float32) is None:
        pytest.skip(f"no float32 kernels: {cpu_kernels.unavailable_reason(torch.float32)}")
    from tests.conftest import save_tiny_hf_model

    path = save_tiny_hf_model(tmp_path / arch, arch, hidden_size=128, intermediate_size=256)
    opts = dict(dtype="float32", num_blocks=32, max_model_len=128)
    dense = LLM(str(path), quantization="none", **opts)
    q8 = LLM(str(path), quantization="q8_0", **opts)
    model = q8.engine.loaded.model
    assert all(
        isinstance(m, quant.QuantModule) and m.qtype == QuantType.Q8_0
        for m in (model.embed_tokens, model.lm_head, model.layers[1].self_attn.qkv_proj)
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    for prompt in ([5, 6, 7, 8], [100, 200, 300]):
        a = dense.generate([prompt], params)[0].outputs[0]
        b = q8.generate([prompt], params)[0].outputs[0]
        first_a, first_b = dict(a.logprobs[0].top), dict(b.logprobs[0].top)
        assert a.token_ids[0] == b.token_ids[0]
        assert all(abs(v - first_b[t]) < 0.05 for t, v in first_a.items() if t in first_b)
