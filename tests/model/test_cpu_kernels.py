"""The fused bf16 CPU kernels against PyTorch, one kernel at a time and as a whole model.

References are computed in fp32 from the same bf16 inputs; a kernel must be as close to
them as PyTorch's own bf16 op is (both round once to bf16; the bounds allow that rounding).
Skipped, with the reason, on machines where the kernels cannot be built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.errors import ConfigError
from pdserve.model import cpu_kernels
from pdserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    causal_mask_with_context,
    decode_attention_gathered,
)
from pdserve.model.ops import CpuKernelOps, TorchOps, select_ops

BF16 = torch.bfloat16
KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason=f"CPU kernels unavailable: {cpu_kernels._unavailable_reason()}"
)


@pytest.fixture
def k() -> cpu_kernels.CpuKernels:
    assert KERNELS is not None
    return KERNELS


def bf16_close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 2.0) -> None:
    """Within `ulps` bf16 steps of the fp32 reference (relative to each row's scale)."""
    scale = expected.abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    err = ((actual.float() - expected) / scale).abs().max().item()
    assert err <= ulps * 2**-8, f"max error {err:.2e} of row scale"


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [96, 130])  # 130: rows beyond a multiple of the 4-row tile
def test_linear_small(k: Any, m: int, n: int) -> None:
    torch.manual_seed(m * n)
    x, w, b = torch.randn(m, 192, dtype=BF16), torch.randn(n, 192, dtype=BF16), torch.randn(n)
    bias = b.to(BF16)
    expected = F.linear(x.float(), w.float(), bias.float())
    bf16_close(k.linear(x, w, bias), expected)
    bf16_close(k.linear(x, w, None), F.linear(x.float(), w.float()))


@pytest.mark.parametrize("m", [7, 16, 20, 33, 64, 65, 128, 147])  # >64: blocks, short last
def test_linear_amx(k: Any, m: int) -> None:
    if not k.amx:
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(m)
    x, w, b = torch.randn(m, 192, dtype=BF16), torch.randn(96, 192, dtype=BF16), torch.randn(96)
    bias = b.to(BF16)
    bf16_close(k.linear_amx(x, k.pack_amx(w), bias), F.linear(x.float(), w.float(), bias.float()))


def test_linear_routes_by_rows(k: Any) -> None:
    ops = CpuKernelOps(k)
    layer = torch.nn.Linear(64, 32, bias=False).to(BF16)
    small = cpu_kernels.AMX_SMALL_M if k.amx else cpu_kernels.SMALL_M
    assert k.route(torch.empty(small, 64), layer.weight) == "small"
    amx = "amx" if k.amx else None
    assert k.route(torch.empty(small + 1, 64), layer.weight) == amx
    assert k.route(torch.empty(cpu_kernels.AMX_MAX_M, 64), layer.weight) == amx
    assert k.route(torch.empty(cpu_kernels.AMX_MAX_M + 1, 64), layer.weight) is None
    assert k.route(torch.empty(1, 48), torch.empty(8, 48)) is None  # K % 32 != 0
    for rows in (1, small + 3, 67, cpu_kernels.AMX_MAX_M + 3):  # every route, same numbers
        x = torch.randn(rows, 64, dtype=BF16)
        bf16_close(ops.linear(x, layer), F.linear(x.float(), layer.weight.float()))


@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(k: Any, with_delta: bool) -> None:
    torch.manual_seed(1)
    x, delta = torch.randn(5, 576, dtype=BF16), torch.randn(5, 576, dtype=BF16)
    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.randn(576, dtype=BF16), 1e-5  # type: ignore[assignment]
    summed = (x + delta) if with_delta else x.clone()
    expected = F.rms_norm(summed.float(), (576,), norm.weight.float(), 1e-5)  # type: ignore[arg-type]
    x_kernel = x.clone()
    out = CpuKernelOps(k).add_rms_norm(x_kernel, delta if with_delta else None, norm)
    assert torch.equal(x_kernel, summed)  # the residual stream is updated in place
    bf16_close(out, expected)


def test_silu_mul(k: Any) -> None:
    gate_up = torch.randn(3, 2 * 256, dtype=BF16) * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    bf16_close(k.silu_mul(gate_up), F.silu(gate) * up)


def _kv_cache(num_blocks: int, block_size: int, hkv: int, d: int) -> torch.Tensor:
    """One layer's view of a two-layer cache, so every stride is the real, non-dense one."""
    full = torch.randn(num_blocks, 2, 2, block_size, hkv, d, dtype=BF16)
    return full[:, 1]


def test_rotary_write_kv_matches_torch_ops(k: Any) -> None:
    torch.manual_seed(2)
    h, hkv, d, bs = 6, 2, 64, 16
    kv = _kv_cache(8, bs, hkv, d)
    qkv = torch.randn(5, h + 2 * hkv, d, dtype=BF16)
    positions = torch.tensor([0, 7, 16, 33, 100])
    blocks, offsets = torch.tensor([3, 3, 5, 1, 6]), positions % bs
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(128).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x = qkv[:, : h + hkv].float()
    rotated = x * c + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * s
    kv_kernel, qkv_kernel = kv.clone(), qkv.clone()
    k.rotary_write_kv(qkv_kernel, h, hkv, cos, sin, positions, kv_kernel, blocks, offsets)
    bf16_close(qkv_kernel[:, : h + hkv], rotated)
    assert torch.equal(qkv_kernel[:, h + hkv :], qkv[:, h + hkv :])  # values untouched
    bf16_close(kv_kernel[blocks, 0, offsets], rotated[:, h:])
    assert torch.equal(kv_kernel[blocks, 1, offsets], qkv[:, h + hkv :])
    untouched = torch.ones(kv.shape[0], kv.shape[2], dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert torch.equal(kv_kernel.transpose(1, 2)[untouched], kv.transpose(1, 2)[untouched])


# Query heads per kv head 1-8 and every head size: the value pass takes up to 4 (D <= 64),
# 2 (D = 128) or 1 (D = 256) query heads at a time, so these cover full and partial passes.
@pytest.mark.parametrize(
    ("h", "hkv", "d"),
    [(9, 3, 64), (8, 8, 32), (4, 1, 128), (16, 2, 128), (10, 2, 64), (2, 1, 256)],
)
@pytest.mark.parametrize("bs", [4, 16, 64])
# Six sequences: a task per sequence; one: a task per (sequence, kv head).
@pytest.mark.parametrize("seq_lens", [[1, 15, 16, 17, 200, 61], [133]])
def test_decode_attention_matches_gathered_sdpa(
    k: Any, h: int, hkv: int, d: int, bs: int, seq_lens: list[int]
) -> None:
    torch.manual_seed(h * d)
    num_blocks = 4 * 256 // bs
    kv = _kv_cache(num_blocks, bs, hkv, d)
    rng = np.random.default_rng(0)
    tables = [rng.permutation(num_blocks)[: -(-n // bs)] for n in seq_lens]
    padded = np.zeros((len(seq_lens), max(len(t) for t in tables)), dtype=np.int64)
    for row, t in enumerate(tables):
        padded[row, : len(t)] = t
    block_tables = torch.from_numpy(padded)
    # q rows strided, as inside a fused qkv buffer
    q = torch.randn(len(seq_lens), h + 2 * hkv, d, dtype=BF16)[:, :h]
    keys = torch.arange(padded.shape[1] * bs)
    mask = torch.where(keys[None, :] < torch.tensor(seq_lens)[:, None], 0.0, float("-inf"))
    meta = AttentionMetadata(
        num_decode_tokens=len(seq_lens),
        slot_block_ids=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        decode_groups=(DecodeGroup(None, block_tables, mask[:, None, None, :]),),
        decode_block_tables=None,
        decode_seq_lens=None,
        decode_kv_buffer=None,
        prefills=(),
    )
    expected = torch.empty(len(seq_lens), h, d)
    decode_attention_gathered(q.float(), kv.float(), meta, d**-0.5, expected)
    out = k.decode_attention(q, kv, block_tables, torch.tensor(seq_lens), d**-0.5)
    bf16_close(out, expected, ulps=3)


# (context, chunk) tokens: no context (a whole prompt), short and long chunks, lengths off
# the 16-query and 64-key blocks, and a chunk after a long context (chunked prefill).
@pytest.mark.parametrize(("ctx", "n"), [(0, 1), (0, 37), (0, 130), (50, 17), (3, 200), (190, 64)])
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 128), (8, 1, 64), (2, 1, 256)])
def test_prefill_attention_matches_causal_sdpa(
    k: Any, ctx: int, n: int, h: int, hkv: int, d: int
) -> None:
    if not k.amx:
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(ctx + n + d)
    bs, total = 16, ctx + n
    kv = _kv_cache(32, bs, hkv, d)
    table = torch.from_numpy(np.random.default_rng(n).permutation(32)[: -(-total // bs)])
    q = torch.randn(n, h + 2 * hkv, d, dtype=BF16)[:, :h]  # strided rows, as in qkv
    out = torch.full((n, h, d), float("nan"), dtype=BF16)
    k.prefill_attention(q, kv, table, ctx, d**-0.5, out)

    keys, values = (kv[table, i].reshape(-1, hkv, d)[:total].float() for i in (0, 1))
    mask = causal_mask_with_context(n, ctx, torch.device("cpu"))
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=d**-0.5, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    bf16_close(out, expected, ulps=3)


def test_select_ops() -> None:
    arch = type("Arch", (), dict(head_dim=64, hidden_size=576, intermediate_size=1536))()
    cpu = torch.device("cpu")
    assert isinstance(select_ops("auto", cpu, BF16, arch), CpuKernelOps)
    assert type(select_ops("torch", cpu, BF16, arch)) is TorchOps
    assert type(select_ops("auto", cpu, torch.float32, arch)) is TorchOps
    odd = type("Arch", (), dict(head_dim=16, hidden_size=64, intermediate_size=128))()
    assert type(select_ops("auto", cpu, BF16, odd)) is TorchOps
    with pytest.raises(ConfigError, match="CUDA"):
        select_ops("triton", cpu, BF16, arch)


@pytest.fixture(scope="module")
def bf16_llms() -> dict[str, Any]:
    from pdserve import LLM

    # A small token budget splits prompts into chunks that run beside other decodes.
    opts = dict(dtype="bfloat16", num_blocks=256, max_model_len=1024, max_num_batched_tokens=48)
    return {name: LLM("default", kernels=name, **opts) for name in ("auto", "torch")}


def test_default_model_kernels_as_close_to_fp32_as_torch_bf16(
    bf16_llms: dict[str, Any], smollm2_llm: Any
) -> None:
    """Mixed steps (decodes beside prefill chunks, batches above SMALL_M): the kernel path's
    logprobs stay as close to the fp32 model's as PyTorch's own bf16 path does."""
    from pdserve import SamplingParams

    assert bf16_llms["auto"].engine.runner.ops.name == "cpu-kernels"
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

    kernel_err, torch_err = error(bf16_llms["auto"]), error(bf16_llms["torch"])
    assert kernel_err <= 1.25 * torch_err + 0.01, (kernel_err, torch_err)


def test_decode_only_steps_run_all_layers_in_one_call_bit_identically(
    bf16_llms: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pd_decode_layers` (small-M linear up to small_m rows, AMX above where the CPU has
    it) gives exactly the per-op path's logprobs."""
    from pdserve import SamplingParams

    llm = bf16_llms["auto"]
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
    assert {1, 2} <= rows and (6 in rows) == kernels.amx, rows
    monkeypatch.setattr(llm.engine.runner.ops, "one_call", False)
    assert run() == with_fused
