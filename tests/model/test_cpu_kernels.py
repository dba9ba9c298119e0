"""The fused CPU kernels against PyTorch, one kernel at a time and as a whole model.

Every kernel test runs on every variant this CPU can execute (`VARIANTS`): bf16 with and
without AMX, and float32 on AVX-512 and on AVX2, whatever PDSERVE_CPU_ISA says; a
variant the CPU cannot run is skipped with the level and the flags it lacks. References
are computed in float64 from the same inputs; a bf16 kernel must be as close to them as
PyTorch's own bf16 op is (both round once to bf16; the bounds allow that rounding), a
float32 kernel within float32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.errors import ConfigError
from pdserve.model import cpu_isa, cpu_kernels, kv_format
from pdserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    causal_mask_with_context,
    decode_attention_gathered,
)
from pdserve.model.backends import select_ops
from pdserve.model.cpu_isa import CpuIsa
from pdserve.model.cpu_ops import CpuKernelOps
from pdserve.model.ops import TorchOps
from tests.conftest import assert_matches_hf, cpu_level

BF16 = torch.bfloat16
DETECTED = cpu_isa.detect()
VARIANTS = {
    "bf16-amx": (BF16, CpuIsa.AMX),
    "bf16": (BF16, CpuIsa.AVX512_BF16),
    "fp32-avx512": (torch.float32, CpuIsa.AVX512),
    "fp32-avx2": (torch.float32, CpuIsa.AVX2),
}
"""name -> (dtype, CPU level): each library at each level it runs at."""


def variant_params(names: Any = VARIANTS) -> list[Any]:
    params = []
    for name in names:
        dtype, isa = VARIANTS[name]
        reason = cpu_kernels.unavailable_reason(dtype, isa) if isa <= DETECTED else (
            f"the CPU lacks {isa.label} ({', '.join(cpu_isa.missing_flags(isa))})"
        )  # fmt: skip
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(
            reason is not None, reason=f"{name}: {reason}")))  # fmt: skip
    return params


@pytest.fixture(params=variant_params())
def k(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    dtype, isa = VARIANTS[request.param]
    kernels = cpu_kernels.load(dtype, isa)
    assert kernels is not None, cpu_kernels.unavailable_reason(dtype, isa)
    assert kernels.isa == isa and kernels.dtype == dtype
    return kernels


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 2.0) -> None:
    """Within `ulps` steps of the reference in the kernel's dtype (bf16: 2^-8, float32:
    2^-20 allowing for sums in another order), relative to each row's scale."""
    step = 2**-8 if actual.dtype == BF16 else 2**-20
    expected = expected.double()
    scale = expected.abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    err = ((actual.double() - expected) / scale).abs().max().item()
    assert err <= ulps * step, f"max error {err:.2e} of row scale"


# 1-4 rows: the bf16 small-M kernel's range; float32 takes up to FP32_MAX_M, in tiles of 4
# rows (5: a short last tile) below 2 kLanes rows and in panels of 2 kLanes from there (16,
# 33, 40, 57: full, padded and half panels on AVX2 and AVX-512). n = 130: weight rows beyond
# a multiple of either tile.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 33, 40, 57])
@pytest.mark.parametrize("n", [96, 130])
def test_linear_small(k: Any, m: int, n: int) -> None:
    if m > k.small_m:
        pytest.skip(f"{k.build.name} takes up to {k.small_m} rows")
    torch.manual_seed(m * n)
    x, w, b = (randn(*shape, dtype=k.dtype) for shape in ((m, 192), (n, 192), (n,)))
    expected = F.linear(x.double(), w.double(), b.double())
    assert_close(k.linear(x, w, b), expected)
    assert_close(k.linear(x, w, None), F.linear(x.double(), w.double()))


@pytest.mark.parametrize("m", [7, 16, 20, 33, 64, 65, 128, 147])  # >64: blocks, short last
@pytest.mark.parametrize("k", variant_params(["bf16-amx"]), indirect=True)
def test_linear_amx(k: Any, m: int) -> None:
    torch.manual_seed(m)
    x, w, b = torch.randn(m, 192, dtype=BF16), torch.randn(96, 192, dtype=BF16), torch.randn(96)
    bias = b.to(BF16)
    assert_close(k.linear_amx(x, k.pack_amx(w), bias), F.linear(x.float(), w.float(), bias.float()))


def test_linear_routes_by_rows(k: Any) -> None:
    ops = CpuKernelOps(k)
    layer = torch.nn.Linear(64, 32, bias=False).to(k.dtype)
    small = k.small_m
    assert k.route(torch.empty(small, 64), layer.weight) == "small"
    past_small = "amx" if k.amx else None
    assert k.route(torch.empty(small + 1, 64), layer.weight) == past_small
    if k.amx:
        assert k.route(torch.empty(cpu_kernels.AMX_MAX_M, 64), layer.weight) == "amx"
        assert k.route(torch.empty(cpu_kernels.AMX_MAX_M + 1, 64), layer.weight) is None
    assert k.route(torch.empty(1, 40), torch.empty(8, 40)) is None  # K % k_multiple != 0
    for rows in (1, 5, 67, small + 3):  # every route, same numbers
        x = torch.randn(rows, 64, dtype=k.dtype)
        assert_close(ops.linear(x, layer), F.linear(x.double(), layer.weight.double()))


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(k: Any, with_delta: bool) -> None:
    torch.manual_seed(1)
    x, delta = randn(5, 576, dtype=k.dtype), randn(5, 576, dtype=k.dtype)
    norm = torch.nn.Module()
    norm.weight, norm.eps = randn(576, dtype=k.dtype), 1e-5  # type: ignore[assignment]
    summed = (x + delta) if with_delta else x.clone()
    expected = F.rms_norm(summed.double(), (576,), norm.weight.double(), 1e-5)  # type: ignore[arg-type]
    x_kernel = x.clone()
    out = CpuKernelOps(k).add_rms_norm(x_kernel, delta if with_delta else None, norm)
    assert torch.equal(x_kernel, summed)  # the residual stream is updated in place
    assert_close(out, expected)


def test_silu_mul(k: Any) -> None:
    gate_up = randn(3, 2 * 256, dtype=k.dtype) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert_close(k.silu_mul(gate_up), F.silu(gate) * up, ulps=4)


def _kv_cache(
    num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype
) -> torch.Tensor:
    """One layer's view of a two-layer cache, so every stride is the real, non-dense one."""
    full = randn(num_blocks, 2, 2, block_size, hkv, d, dtype=dtype)
    return full[:, 1]


def test_rotary_write_kv_matches_torch_ops(k: Any) -> None:
    torch.manual_seed(2)
    h, hkv, d, bs = 6, 2, 64, 16
    kv = _kv_cache(8, bs, hkv, d, k.dtype)
    qkv = randn(5, h + 2 * hkv, d, dtype=k.dtype)
    positions = torch.tensor([0, 7, 16, 33, 100])
    blocks, offsets = torch.tensor([3, 3, 5, 1, 6]), positions % bs
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(128).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    c, s = cos[positions].unsqueeze(1).double(), sin[positions].unsqueeze(1).double()
    x = qkv[:, : h + hkv].double()
    rotated = x * c + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * s
    kv_kernel, qkv_kernel = kv.clone(), qkv.clone()
    k.rotary_write_kv(qkv_kernel, h, hkv, cos, sin, positions, kv_kernel, blocks, offsets)
    assert_close(qkv_kernel[:, : h + hkv], rotated)
    assert torch.equal(qkv_kernel[:, h + hkv :], qkv[:, h + hkv :])  # values untouched
    assert_close(kv_kernel[blocks, 0, offsets], rotated[:, h:])
    assert torch.equal(kv_kernel[blocks, 1, offsets], qkv[:, h + hkv :])
    untouched = torch.ones(kv.shape[0], kv.shape[2], dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert torch.equal(kv_kernel.transpose(1, 2)[untouched], kv.transpose(1, 2)[untouched])


def test_rotary_write_kv_int8_stores_the_bytes_torch_ops_do(k: Any) -> None:
    """The 8-bit cache: each head's values and scale, byte for byte as kv_format.quantize
    stores the rotated keys and the values (the same arithmetic on both paths)."""
    torch.manual_seed(3)
    h, hkv, d, bs = 6, 2, 64, 16
    kv = _kv_cache(8, bs, hkv, d + kv_format.SCALE_BYTES, torch.float32).to(torch.int8)
    qkv = randn(5, h + 2 * hkv, d, dtype=k.dtype) * 3
    qkv[2, h] = 0  # an all-zero head: scale 0, values 0
    positions = torch.tensor([0, 7, 16, 33, 100])
    blocks, offsets = torch.tensor([3, 3, 5, 1, 6]), positions % bs
    freqs = torch.outer(torch.arange(128).float(), 1.0 / (10000 ** (torch.arange(0, d, 2) / d)))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    kv_kernel, rotated = kv.clone(), qkv.clone()
    k.rotary_write_kv(rotated, h, hkv, cos, sin, positions, kv_kernel, blocks, offsets)
    assert torch.equal(kv_kernel[blocks, 0, offsets], kv_format.quantize(rotated[:, h : h + hkv]))
    assert torch.equal(kv_kernel[blocks, 1, offsets], kv_format.quantize(qkv[:, h + hkv :]))
    assert not kv_kernel[blocks[2], 0, offsets[2], 0].any()


# Query heads per kv head 1-12 and every head size. The value pass takes as many query
# heads at a time as the registers hold (bf16: 4 at D <= 64, 2 at 128, 1 at 256; float32
# AVX2: 3 at D = 32, else 1 per 64-dim slice; AVX-512: 12, 6, 3 and 3 per 128-dim slice),
# so these cover full and partial passes and several slices.
@pytest.mark.parametrize(
    ("h", "hkv", "d"),
    [(9, 3, 64), (8, 8, 32), (12, 1, 32), (4, 1, 128), (16, 2, 128), (10, 2, 64), (2, 1, 256)],
)
@pytest.mark.parametrize("bs", [4, 16, 64])
# Six sequences: a task per sequence; one: a task per (sequence, kv head); longer than
# 1,024 keys (the bf16 library): parts of 1,024 over the threads, merged.
@pytest.mark.parametrize("seq_lens", [[1, 15, 16, 17, 200, 61], [133], [2100, 1025, 40]])
@pytest.mark.parametrize("int8", [False, True], ids=["kv-dense", "kv-int8"])
def test_decode_attention_matches_gathered_sdpa(
    k: Any, h: int, hkv: int, d: int, bs: int, seq_lens: list[int], int8: bool
) -> None:
    torch.manual_seed(h * d)
    num_blocks = max(4 * 256, max(seq_lens)) // bs + 1
    kv = _kv_cache(num_blocks, bs, hkv, d, k.dtype)
    rng = np.random.default_rng(0)
    tables = [rng.permutation(num_blocks)[: -(-n // bs)] for n in seq_lens]
    padded = np.zeros((len(seq_lens), max(len(t) for t in tables)), dtype=np.int64)
    for row, t in enumerate(tables):
        padded[row, : len(t)] = t
    block_tables = torch.from_numpy(padded)
    # q rows strided, as inside a fused qkv buffer
    q = randn(len(seq_lens), h + 2 * hkv, d, dtype=k.dtype)[:, :h]
    keys = torch.arange(padded.shape[1] * bs)
    mask = torch.where(keys[None, :] < torch.tensor(seq_lens)[:, None], 0.0, float("-inf"))
    meta = AttentionMetadata(
        num_decode_tokens=len(seq_lens),
        slot_block_ids=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        decode_groups=(
            DecodeGroup(
                None, block_tables, mask[:, None, None, :].double(), torch.tensor(seq_lens)
            ),
        ),
        decode_block_tables=None,
        decode_seq_lens=None,
        decode_kv_buffer=None,
        prefills=(),
    )
    # The 8-bit cache: the same keys and values quantized; PyTorch ops dequantize what
    # they gather, in float64 here.
    kv = kv_format.quantize(kv) if int8 else kv
    expected = torch.empty(len(seq_lens), h, d, dtype=torch.float64)
    decode_attention_gathered(q.double(), kv if int8 else kv.double(), meta, d**-0.5, expected)
    out = k.decode_attention(q, kv, block_tables, torch.tensor(seq_lens), d**-0.5)
    assert_close(out, expected, ulps=3)


# (context, chunk) tokens: no context (a whole prompt), short and long chunks, lengths off
# the 16-query and 64-key blocks, and a chunk after a long context (chunked prefill).
@pytest.mark.parametrize(("ctx", "n"), [(0, 1), (0, 37), (0, 130), (50, 17), (3, 200), (190, 64)])
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (8, 1, 64), (2, 1, 256)])
# The bf16 library's two ways of taking the products: AMX tiles, AVX512-BF16 dot products.
@pytest.mark.parametrize("k", variant_params(["bf16", "bf16-amx"]), indirect=True)
@pytest.mark.parametrize("int8", [False, True], ids=["kv-dense", "kv-int8"])
def test_prefill_attention_matches_causal_sdpa(
    k: Any, ctx: int, n: int, h: int, hkv: int, d: int, int8: bool
) -> None:
    torch.manual_seed(ctx + n + d)
    bs, total = 16, ctx + n
    kv = _kv_cache(32, bs, hkv, d, BF16)
    kv = kv_format.quantize(kv) if int8 else kv  # the 8-bit cache, dequantized as packed
    table = torch.from_numpy(np.random.default_rng(n).permutation(32)[: -(-total // bs)])
    q = torch.randn(n, h + 2 * hkv, d, dtype=BF16)[:, :h]  # strided rows, as in qkv
    out = torch.full((n, h, d), float("nan"), dtype=BF16)
    k.prefill_attention(q, kv, table, ctx, d**-0.5, out)

    keys, values = (
        kv_format.readable(kv[table, i], torch.float32).reshape(-1, hkv, d)[:total].float()
        for i in (0, 1)
    )
    mask = causal_mask_with_context(n, ctx, torch.device("cpu"))
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=d**-0.5, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    assert_close(out, expected, ulps=3)


@pytest.mark.parametrize("k", variant_params(["bf16", "bf16-amx"]), indirect=True)
def test_prefill_attention_is_the_exact_one_rounded(k: Any) -> None:
    """P goes to the bf16 products in two halves: the output's mean error is bf16's own
    rounding of the exact attention (P rounded once: 1.10x it, SDPA in bf16 1.12x)."""
    torch.manual_seed(0)
    h, hkv, d, bs, n, ctx = 9, 3, 64, 64, 512, 1536
    kv = _kv_cache((n + ctx) // bs, bs, hkv, d, BF16)
    table = torch.randperm((n + ctx) // bs)
    q = randn(n, h, d, dtype=BF16)
    out = torch.empty(n, h, d, dtype=BF16)
    k.prefill_attention(q, kv, table, ctx, d**-0.5, out)
    keys, values = (kv[table, i].reshape(-1, hkv, d).double() for i in (0, 1))
    exact = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=causal_mask_with_context(n, ctx, torch.device("cpu")), scale=d**-0.5,
        enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    rounding = (exact.to(BF16).double() - exact).abs().mean().item()
    assert (out.double() - exact).abs().mean().item() <= 1.03 * rounding


def test_select_ops_follows_dtype_and_cpu_level() -> None:
    arch = type("Arch", (), dict(head_dim=64, hidden_size=576, intermediate_size=1536))()
    cpu = torch.device("cpu")
    level = cpu_isa.effective()
    for dtype in (BF16, torch.float32):
        ops = select_ops("auto", cpu, dtype, arch)
        if cpu_kernels.build_for(dtype, level) is None:
            assert type(ops) is TorchOps
        else:
            assert isinstance(ops, CpuKernelOps) and ops.k.dtype == dtype
        assert type(select_ops("torch", cpu, dtype, arch)) is TorchOps
    assert type(select_ops("auto", cpu, torch.float16, arch)) is TorchOps
    odd = type("Arch", (), dict(head_dim=16, hidden_size=64, intermediate_size=128))()
    assert type(select_ops("auto", cpu, torch.float32, odd)) is TorchOps
    with pytest.raises(ConfigError, match="CUDA"):
        select_ops("triton", cpu, BF16, arch)


@pytest.fixture(scope="module", params=variant_params())
def variant_llm(request: pytest.FixtureRequest) -> Any:
    """The default model on one variant's kernels (built at that CPU level)."""
    from pdserve import LLM

    dtype, isa = VARIANTS[request.param]
    with cpu_level(isa.label):
        # A small token budget splits prompts into chunks that run beside other decodes.
        llm = LLM("default", dtype=str(dtype).removeprefix("torch."), num_blocks=256,
                  max_model_len=1024, max_num_batched_tokens=48,
                  quantization="none")  # fmt: skip
    ops = llm.engine.runner.ops
    assert isinstance(ops, CpuKernelOps) and ops.k.isa == isa and ops.k.dtype == dtype
    return llm


@pytest.fixture(scope="module", params=variant_params())
def variant_llm_int8(request: pytest.FixtureRequest) -> Any:
    """variant_llm with the 8-bit KV cache."""
    from pdserve import LLM

    dtype, isa = VARIANTS[request.param]
    with cpu_level(isa.label):
        return LLM("default", dtype=str(dtype).removeprefix("torch."), num_blocks=256,
                   max_model_len=1024, max_num_batched_tokens=48, quantization="none",
                   kv_cache_dtype="int8")  # fmt: skip


@pytest.fixture(scope="module")
def torch_bf16_llm() -> Any:
    from pdserve import LLM

    opts = dict(num_blocks=256, max_model_len=1024, max_num_batched_tokens=48)
    return LLM("default", dtype="bfloat16", kernels="torch", **opts)


def test_default_model_on_each_variant_is_as_close_to_hf_as_torch(
    variant_llm: Any, smollm2_llm: Any, smollm2_references: Any, torch_bf16_llm: Any
) -> None:
    """float32 kernels: HF's greedy tokens and logprobs, as PyTorch's float32 path has them.
    bf16 kernels, over mixed steps (decodes beside prefill chunks, batches above the
    small-M kernel's rows): logprobs as close to the fp32 model's as PyTorch's bf16 path."""
    from pdserve import SamplingParams

    if variant_llm.engine.runner.ops.k.dtype == torch.float32:
        assert_matches_hf(variant_llm, smollm2_references)
        return
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"] * 2
    prompts = [smollm2_llm.tokenizer.encode(t) + [300 + i] * 12 * i for i, t in enumerate(texts)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    reference = smollm2_llm.generate(prompts, params)

    def error(llm: Any) -> float:
        errs = []
        for ref, out in zip(reference, llm.generate(prompts, params), strict=True):
            for r, o in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
                ours = dict(o.top)
                errs += [abs(v - ours[t]) for t, v in r.top if t in ours]
                if r.token_id != o.token_id:
                    break  # diverged: later steps see different contexts
        return float(np.mean(errs))

    kernel_err, torch_err = error(variant_llm), error(torch_bf16_llm)
    assert kernel_err <= 1.25 * torch_err + 0.01, (kernel_err, torch_err)


def test_decode_only_steps_run_all_layers_in_one_call_bit_identically(
    variant_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pd_decode_layers` (small-M linear up to small_m rows, AMX above where the CPU has
    it) gives exactly the per-op path's logprobs."""
    assert_one_call_is_bit_identical(variant_llm, monkeypatch)


def test_one_call_steps_are_bit_identical_with_the_int8_cache(
    variant_llm_int8: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_one_call_is_bit_identical(variant_llm_int8, monkeypatch)


def assert_one_call_is_bit_identical(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve import SamplingParams

    kernels = llm.engine.runner.ops.k
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3,",
             "Paris is", "import numpy as np"]  # fmt: skip
    batches = [texts[:1], texts[1:3], texts[:6]]

    def run() -> list[Any]:
        outputs = [o.outputs[0] for batch in batches for o in llm.generate(batch, params)]
        return [(s.token_id, s.top) for out in outputs for s in out.logprobs]

    rows: set[int] = set()
    fused = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: rows.add(a[1].shape[0]) or fused(*a))
    with_fused = run()
    assert {1, 2} <= rows and (6 in rows) == (kernels.max_one_call_m >= 6), rows
    monkeypatch.setattr(llm.engine.runner.ops, "one_call", False)
    assert run() == with_fused
