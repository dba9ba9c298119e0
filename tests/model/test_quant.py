"""Weights kept in GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the
formats against the gguf library, the kernels against a PyTorch reference of the same
arithmetic on every kernel variant this CPU runs, and models loaded on their blocks (the
default model, a Q4_K_M file) against them dequantized."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.errors import ConfigError, ModelLoadError
from pdserve.model import cpu_isa, cpu_kernels, quant
from pdserve.model.cpu_ops import CpuKernelOps
from pdserve.model.files import default_model_path
from pdserve.model.loader import load_model
from pdserve.model.quant import QuantLinear, QuantType
from tests.conftest import assert_matches_hf, cpu_level
from tests.model.test_cpu_kernels import VARIANTS, variant_params

TYPES = list(QuantType)
QUANTIZABLE = [QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1]
"""The formats pdserve quantizes to; it reads the others from files."""


def random_blocks(qtype: QuantType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row bytes] of random quants and small random scales (what a file of any
    format holds, without a quantizer for it)."""
    from pdserve_bench.synthetic_gguf import random_blocks as blocks

    rng = np.random.default_rng(seed)
    return torch.from_numpy(blocks(qtype.name, n, k, rng, random_scales=True))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.label)
def test_every_format_reads_as_the_gguf_library_reads_it(qtype: QuantType) -> None:
    import gguf

    blocks = random_blocks(qtype, 9, 768)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype.name])
    assert torch.equal(quant.dequantize(blocks, qtype, 768), torch.from_numpy(theirs))


def test_formats_without_a_quantizer_are_refused() -> None:
    with pytest.raises(ValueError, match="does not quantize to q4_k"):
        quant.quantize(torch.zeros(2, 256), QuantType.Q4_K)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.label)
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


# 768: three K-quant super-blocks; 800: 25 blocks, an odd count (x is split in pairs of blocks)
SHAPES = [(t, 768) for t in TYPES] + [(t, 800) for t in TYPES if t.block_weights == 32]


@pytest.mark.parametrize(
    ("qtype", "kk"), SHAPES, ids=lambda v: v.label if isinstance(v, QuantType) else str(v)
)
# in registers: float 1-4, bf16 1-7; then dequantized (AMX: 70 rows are 4 + 1 tiles of 16)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 33, 70])
def test_linear_is_the_dequantized_product(
    k: cpu_kernels.CpuKernels, qtype: QuantType, kk: int, m: int
) -> None:
    torch.manual_seed(m)
    n = 67  # odd
    blocks = random_blocks(qtype, n, kk, seed=m)
    bias = torch.randn(n).to(k.dtype)
    layer = QuantLinear(kk, n, qtype, torch.nn.Parameter(bias, requires_grad=False))
    layer.qweight = blocks
    x = torch.randn(m, kk).to(k.dtype)
    y = k.linear_quant(x, layer)
    dense = quant.dequantize(blocks, qtype, kk).double()
    # the float32 library's AVX2 build takes one row of x split in two bytes a weight, as
    # the bf16 library does (quant_linear.h's linear_split_one_row): its exact product is with x so
    splits = k.isa == cpu_isa.CpuIsa.AVX2 and m == 1
    expected = (split_x(x) if splits else x.double()) @ dense.T + bias.double()
    assert y.dtype == k.dtype and y.shape == (m, n)
    step = 2**-8 if k.dtype == torch.bfloat16 else 2**-18  # float32: sums in another order
    scale = expected.abs().amax().item()
    assert (y.double() - expected).abs().max().item() <= 2 * step * scale


def split_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the bf16 library's integer dot products take it (quant_linear.h's
    `split_x`): per block of 32, s a power of two with 32 <= max|x| / s < 64, x1 = round(x /
    s), x2 = round(256 (x / s - x1)) (a tie x2 = 128 carried into x1), x = s (x1 + x2 / 256)."""
    m, k = x.shape
    xb = x.double().reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = f 2^exponent, 1/2 <= f < 1
    s = torch.pow(2.0, (exponent - 6).double())
    t = xb / s
    x1 = torch.round(t)
    x2 = torch.round((t - x1) * 256)
    tie = x2 == 128
    x1, x2 = torch.where(tie, x1 + 1, x1), torch.where(tie, -128.0, x2)
    assert x1.abs().max() <= 65 and x2.min() >= -128 and x2.max() <= 127  # signed bytes
    kept = torch.where(amax >= 2.0**-121, s * (x1 + x2 / 256), 0.0)
    return kept.reshape(m, k)


def test_split_x_keeps_bf16_near_the_block_maximum_exactly() -> None:
    """The reference above: a bf16 x within 2^-6 of its block's largest kept exactly, any
    other within 2^-14 of the largest."""
    x = (torch.randn(8, 256) * torch.logspace(-3, 3, 8).unsqueeze(1)).to(torch.bfloat16)
    x[0, :32] = 0.0
    kept = split_x(x)
    amax = x.double().reshape(8, 8, 32).abs().amax(-1, keepdim=True).expand(8, 8, 32)
    amax = amax.reshape(8, 256)
    near = x.double().abs() >= amax / 64
    assert torch.equal(kept[near], x.double()[near])
    assert ((kept - x.double()).abs() <= amax * 2.0**-14).all()
    assert not torch.equal(kept, x.double())  # some small x is rounded


@pytest.mark.parametrize("qtype", [None, *TYPES], ids=lambda t: t.label if t else "dense")
@pytest.mark.parametrize("m", [1, 4, 7, 8, 33, 70])  # blocks: 1-7 dotted from the blocks
def test_logits_are_float32_products(qtype: QuantType | None, m: int) -> None:
    """The bf16 library's LM head (`pd_logits`) writes float32: the product of the bf16
    activations and the weight as kept, summed in float32, not rounded to bf16. (From 8
    rows, blocks are dequantized to bf16 for the dense loop or AMX tiles, as every bf16
    linear does; up to 7 they are integer dot products with x split in two bytes, where the
    CPU has VNNI: quant_linear.h's kFusedMaxMInt8.)"""
    k = cpu_kernels.load(torch.bfloat16)
    if k is None:
        pytest.skip(f"no bf16 kernels: {cpu_kernels.unavailable_reason(torch.bfloat16)}")
    torch.manual_seed(m)
    n, kk = 203, 768  # n % 4 != 0: the dense loop's leftover rows
    w = torch.randn(n, kk) * 0.05
    if qtype is None:
        head: Any = torch.nn.Linear(kk, n, bias=False).to(torch.bfloat16)
        head.weight.data.copy_(w)
        dense = head.weight.double()
    else:
        head = QuantLinear(kk, n, qtype, None)
        head.qweight = random_blocks(qtype, n, kk, seed=m)
        dense = quant.dequantize(head.qweight, qtype, kk)
        dense = (dense if m <= 7 else dense.to(torch.bfloat16)).double()
    x = torch.randn(m, kk).to(torch.bfloat16)
    y = k.logits(x, head)
    integer = qtype is not None and m <= 7 and "avx512_vnni" in cpu_isa.cpu_flags()
    expected = (split_x(x) if integer else x.double()) @ dense.T
    assert y.dtype == torch.float32 and y.shape == (m, n)
    scale = expected.abs().amax().item()
    assert (y.double() - expected).abs().max().item() <= 2**-18 * scale  # float sums only


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.label)
def test_dequantize_kernel_equals_the_reference(
    k: cpu_kernels.CpuKernels, qtype: QuantType
) -> None:
    blocks = random_blocks(qtype, 300, 256)  # 300 rows: the parallel split
    assert torch.equal(
        k.dequantize(blocks, qtype, 256), quant.dequantize(blocks, qtype, 256).to(k.dtype)
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
    k = quant_llm.engine.runner.ops.k
    if k.dtype == torch.float32:
        # The AVX2 build takes one row of x split into fixed point 2^-14 below each block's
        # largest (quant_linear.h's split x) where AVX-512 widens the blocks: its logprobs
        # sat 4.6e-3 to 6.0e-3 from HF's on these prompts (AVX-512: 2e-5), at the edge of
        # 2e-3 + 1e-3 |logprob|, so a change of the last bits anywhere tipped it over.
        atol = 1e-2 if k.isa == cpu_isa.CpuIsa.AVX2 else 2e-3
        assert_matches_hf(quant_llm, smollm2_references, atol)
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


# untied head; tied head and qkv bias; q/k norms; Gemma's norms, GeGLU and sliding layers;
# Phi's half-rotated heads (their q/k rows laid out again in the blocks)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
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


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A small Llama in llama.cpp's Q4_K_M mix (random weights): Q4_K, Q6_K for layer 1's
    attn_v and ffn_down and for the output, as the quantizer picks them."""
    from pdserve_bench.synthetic_gguf import SHAPES, write

    path = tmp_path_factory.mktemp("gguf") / "tiny.q4_k_m.gguf"
    write(path, SHAPES["tiny"], "q4_k_m")
    return path


@pytest.mark.parametrize("variant", variant_params(["fp32-avx512", "fp32-avx2", "bf16"]))
def test_q4_k_m_file_computes_its_dequantized_model(q4_k_m_file: Any, variant: str) -> None:
    """Loaded by default, a Q4_K_M file stays in its blocks (a fused q/k/v of two formats
    in Q8_0) and computes what the same file dequantized at load computes."""
    dtype, isa = VARIANTS[variant]
    options = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 128, "num_blocks": 16}
    with cpu_level(isa.label):
        blocks = LLM(str(q4_k_m_file), **options)
        dense = LLM(str(q4_k_m_file), quantization="none", **options)
    model = blocks.engine.loaded.model
    assert model.layers[0].mlp.down_proj.qtype == QuantType.Q4_K
    assert model.layers[1].mlp.down_proj.qtype == QuantType.Q6_K
    assert model.layers[1].self_attn.qkv_proj.qtype == QuantType.Q8_0  # v Q6_K, q/k Q4_K
    assert model.lm_head.qtype == QuantType.Q6_K
    assert sum(m.qweight.nbytes for m in quant.quant_modules(model)) < q4_k_m_file.stat().st_size
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    tolerance = 2e-3 if dtype == torch.float32 else 0.05  # bf16: dense weights rounded
    for prompt in ([5, 6, 7, 8], [100] * 20, list(range(300, 340))):
        ours = dict(blocks.generate([prompt], params)[0].outputs[0].logprobs[0].top)
        theirs = dict(dense.generate([prompt], params)[0].outputs[0].logprobs[0].top)
        shared = ours.keys() & theirs.keys()
        assert len(shared) >= 3
        assert max(abs(ours[t] - theirs[t]) for t in shared) < tolerance
