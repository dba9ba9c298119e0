"""`pdserve bench kernels`: each fused CPU kernel beside the PyTorch op it replaces.

Shapes are the model's own (default: SmolLM2-135M). Per case it prints the best of
`--repeat` timings for both sides and the ratio; the machines are shared and noisy, so
the best time is the one least disturbed by other work.

- linear: every layer's four weights plus the LM head, as one decode step reads them
  (distinct weights per layer, so the step streams them from memory as a real one does),
  for 1..`--max-m` rows and 16 to 512 (prefill-sized): the kernel `CpuKernels.route`
  picks (small-M or AMX) against `F.linear` (oneDNN). The routing in cpu_kernels.py
  comes from this.
- decode attention: the kernel reading the paged cache in place against gathering the
  blocks and calling SDPA (attention.py's path), for a few batch sizes and lengths; and
  with AMX, prefill attention: the flash kernel against SDPA for a few chunk lengths.
- the copy bandwidth of this machine (huge-page buffers, like the weights), for the
  weight-read floor of the decode steps below.
- decode steps of the real model (`--steps-batches`): all layers in one call
  (`pd_decode_layers`) against the same kernels called per op from Python, alternating,
  best of `--step-repeat` generations of 64 tokens, and the one-call rate as a fraction of
  the floor (weights + the batch's KV read once a step at the copy bandwidth).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.config import QUANTIZATIONS
from pdserve.model import huge_pages
from pdserve.model.quant import QuantLinear, QuantType, quantize


def add_parser(sub: Any) -> None:
    p = sub.add_parser("kernels", help="fused CPU kernels vs. the PyTorch ops they replace")
    p.add_argument("--model", default="default")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="which kernels: bf16 or float32 (auto: what the model would run in here)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="how the decode steps' model keeps its weights (the linear sweep adds a Q4_1 column)",
    )
    p.add_argument("--max-m", type=int, default=8, help="largest row count for the linear sweep")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--steps-batches",
        default="1,32",
        help="batch sizes for the one-call vs per-op decode steps ('' skips them)",
    )
    p.add_argument("--step-repeat", type=int, default=3)
    p.set_defaults(func=run)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(repeat: int, nbytes: int = 1 << 30) -> float:
    """Bytes per second moved by a large tensor copy, reads and writes both counted. The
    buffers sit on huge pages, like the weights and KV cache whose reads it bounds."""
    src = huge_pages.zeros((nbytes // 4,), torch.float32)
    dst = huge_pages.zeros((nbytes // 4,), torch.float32)
    return 2 * nbytes / best_of(lambda: dst.copy_(src), max(3, repeat // 3))


def run(args: argparse.Namespace) -> int:
    from pdserve.model import cpu_kernels
    from pdserve.model.loader import read_arch, resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    kernels = cpu_kernels.load(dtype)
    if kernels is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason(dtype)}")
    arch = read_arch(args.model)
    torch.manual_seed(0)
    bw = copy_bandwidth(args.repeat)
    print(
        f"{kernels.build.name} kernels at CPU level {kernels.isa.label}, {dtype}; "
        f"{torch.get_num_threads()} threads; copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    _linear_sweep(kernels, arch, args)
    _attention(kernels, arch, args)
    if args.steps_batches:
        _decode_steps(args, dtype, [int(b) for b in args.steps_batches.split(",")], bw)
    return 0


def _decode_steps(
    args: argparse.Namespace, dtype: torch.dtype, batches: list[int], bandwidth: float
) -> None:
    from pdserve import LLM, SamplingParams
    from pdserve.model.cpu_ops import CpuKernelOps

    name = str(dtype).removeprefix("torch.")
    llm = LLM(
        args.model,
        dtype=name,
        quantization=args.quantization,
        num_blocks=64 * max(batches),
        max_model_len=512,
    )
    if not isinstance(llm.engine.runner.ops, CpuKernelOps):
        print("\ndecode steps skipped: the model does not run on the CPU kernels")
        return
    num_tokens = 64
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    print(
        f"\ndecode steps, 32-token prompts + 64 tokens (the decode steps timed), "
        f"best of {args.step_repeat}"
    )
    print(
        f"{'batch':>6}{'per-op tok/s':>14}{'one-call tok/s':>16}{'speed-up':>10}"
        f"{'floor tok/s':>13}{'of floor':>10}"
    )
    ops = llm.engine.runner.ops
    weight_bytes = _weight_bytes_per_step(llm.engine.runner.model)
    kv_bytes_per_token = llm.engine.runner.kv_cache[0, :, :, 0].nbytes
    try:
        for batch in batches:
            prompts = [list(range(100 + i, 132 + i)) for i in range(batch)]
            best: dict[str, float] = {}
            for one_call in (False, True):  # warm-up
                ops.one_call = one_call
                llm.generate(prompts, params)
            for _ in range(args.step_repeat):  # alternate: the machine's drift hits both
                for name, one_call in (("per-op", False), ("one-call", True)):
                    ops.one_call = one_call
                    best[name] = max(best.get(name, 0.0), _decode_rate(llm, prompts, params))
            ratio = best["one-call"] / best["per-op"]
            # The weight-read floor: a step reads every weight once and each request's
            # context (64 tokens on average over the run) at the copy bandwidth.
            step_bytes = weight_bytes + batch * (32 + num_tokens // 2) * kv_bytes_per_token
            floor = batch * bandwidth / step_bytes
            print(
                f"{batch:>6}{best['per-op']:>14.1f}{best['one-call']:>16.1f}{ratio:>9.2f}x"
                f"{floor:>13.1f}{best['one-call'] / floor:>9.0%}"
            )
    finally:
        ops.one_call = True


def _decode_rate(llm: Any, prompts: list[list[int]], params: Any) -> float:
    """Tokens a second of the decode steps alone: from the step that gives every request its
    first token to the last. The prompts' prefill (one 32-row step at batch 1, as long as
    ~6 decode steps) is not what the weight-read floor bounds."""
    engine = llm.engine
    waiting = {engine.add_request(prompt, params) for prompt in prompts}
    start, decoded = 0.0, 0
    while engine.has_unfinished():
        outputs = engine.step()
        if not waiting:
            decoded += sum(len(out.outputs[0].delta_token_ids) for out in outputs)
        else:
            waiting -= {out.request_id for out in outputs if out.outputs[0].token_ids}
            if not waiting:
                start = time.perf_counter()
    return decoded / (time.perf_counter() - start)


def _weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights a decode step reads, as they sit in memory (quantized blocks
    included): every weight but an untied embedding table (of which a step reads one row
    per token)."""
    from pdserve.model.quant import QuantModule, quant_modules

    def weight(module: Any) -> torch.Tensor:
        return module.qweight if isinstance(module, QuantModule) else module.weight

    embedding = weight(model.embed_tokens)
    tied = weight(model.lm_head) is embedding
    tensors = [*model.parameters(), *(m.qweight for m in quant_modules(model))]
    return sum(t.nbytes for t in tensors if tied or t is not embedding)


def _linear_sweep(kernels: Any, arch: Any, args: argparse.Namespace) -> None:
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    shapes = [(qkv, h), (h, arch.num_heads * d), (2 * i, h), (h, i)]
    arena = huge_pages.Arena()  # where a loaded model's weights live

    dtype = kernels.dtype

    def weight(n: int, k: int) -> torch.Tensor:
        return arena.copy_of(torch.randn(n, k, dtype=dtype) * 0.02)

    layers = [[weight(n, k) for n, k in shapes] for _ in range(arch.num_layers)]
    head = weight(arch.vocab_size, h)
    nbytes = sum(w.nbytes for ws in layers for w in ws) + head.nbytes
    print(f"\nlinear: one decode step's weights ({nbytes / 1e6:.0f} MB), best of {args.repeat}")
    print(
        f"{'rows':>5}{'torch ms':>12}{'kernel ms':>12}{'speed-up':>10}{'kernel GB/s':>13}"
        f"{'kernel GFLOP/s':>16}{'q4_1 ms':>10}{'vs kernel':>11}"
    )
    packed = None
    if kernels.amx:
        packed = [[arena.copy_of(kernels.pack_amx(w)) for w in ws] for ws in layers]
    head_packed = arena.copy_of(kernels.pack_amx(head)) if kernels.amx else None
    # The same step on blocks, as the default model's file stores it: Q4_1 layers, Q8_0 head.
    quantized = [[_quant_linear(arena, w, QuantType.Q4_1) for w in ws] for ws in layers] + [
        [_quant_linear(arena, head, QuantType.Q8_0)]
    ]
    quant_bytes = sum(q.qweight.nbytes for qs in quantized for q in qs)
    print(f"(q4_1 column: the same shapes in Q4_1, Q8_0 head: {quant_bytes / 1e6:.0f} MB)")
    for m in (*range(1, args.max_m + 1), 16, 32, 64, 128, 256, 512):
        xs = {k: torch.randn(m, k, dtype=dtype) for _, k in shapes}

        def step(linear: Callable[..., torch.Tensor], xs: dict[int, torch.Tensor] = xs) -> None:
            for ws in layers:
                for w in ws:
                    linear(xs[w.shape[1]], w, None)
            linear(xs[h], head, None)

        def step_amx(xs: dict[int, torch.Tensor] = xs) -> None:
            assert packed is not None and head_packed is not None
            for ws, ps in zip(layers, packed, strict=True):
                for w, p in zip(ws, ps, strict=True):
                    kernels.linear_amx(xs[w.shape[1]], p, None)
            kernels.linear_amx(xs[h], head_packed, None)

        # Past AMX_MAX_M the AMX kernel is still timed, to show why `route` sends those
        # rows to oneDNN; without AMX, rows past the small-M kernel have only oneDNN.
        route = kernels.route(xs[h], head)
        if kernels.amx and m > kernels.small_m:
            ours_fn, name = step_amx, "AMX" if route == "amx" else "AMX; routed to oneDNN"
        elif route == "small" or kernels.dtype == torch.float32:
            ours_fn = lambda xs=xs: step(kernels.linear, xs)  # noqa: E731
            name = "small-M" if route == "small" else "small-M; routed to MKL"
        else:
            continue

        def step_quant(xs: dict[int, torch.Tensor] = xs) -> None:
            for qs in quantized:
                for q in qs:
                    kernels.linear_quant(xs[q.in_features], q)

        base = best_of(lambda: step(F.linear), args.repeat)
        ours = best_of(ours_fn, args.repeat)
        quant = best_of(step_quant, args.repeat)
        flops = 2 * m * nbytes // dtype.itemsize
        speed = f"{base / ours:>9.2f}x{nbytes / ours / 1e9:>13.1f}{flops / ours / 1e9:>16.0f}"
        q = f"{quant * 1e3:>10.2f}{ours / quant:>10.2f}x"
        print(f"{m:>5}{base * 1e3:>12.2f}{ours * 1e3:>12.2f}{speed}{q}  {name}")


def _quant_linear(arena: Any, weight: torch.Tensor, qtype: QuantType) -> QuantLinear:
    n, k = weight.shape
    layer = QuantLinear(k, n, qtype, None)
    layer.qweight = arena.copy_of(quantize(weight.float(), qtype))
    return layer


def _attention(kernels: Any, arch: Any, args: argparse.Namespace) -> None:
    from pdserve.model import kv_format
    from pdserve.model.attention import AttentionMetadata, DecodeGroup, decode_attention_gathered

    bs, hkv, d, h = 64, arch.num_kv_heads, arch.head_dim, arch.num_heads
    dtype = kernels.dtype
    print(
        f"\ndecode attention, one layer ({h} heads, {hkv} kv heads, D={d}), best of {args.repeat}"
    )
    print(
        f"{'batch':>6}{'length':>8}{'gather+SDPA ms':>16}{'kernel ms':>11}{'speed-up':>10}"
        f"{'int8 KV ms':>12}{'vs kernel':>11}"
    )
    rng = np.random.default_rng(0)
    for batch, length in ((1, 1000), (32, 160), (32, 1000), (64, 500)):
        per_seq = -(-length // bs)
        num_blocks = batch * per_seq + 1
        kv = torch.randn(num_blocks, 2, bs, hkv, d, dtype=dtype)
        tables = torch.from_numpy(
            rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
        )
        lens = torch.full((batch,), length)
        q = torch.randn(batch, h, d, dtype=dtype)
        keys = torch.arange(per_seq * bs)
        mask = torch.where(keys[None, :] < lens[:, None], 0.0, float("-inf")).to(dtype)
        meta = AttentionMetadata(
            num_decode_tokens=batch,
            slot_block_ids=torch.empty(0, dtype=torch.long),
            slot_offsets=torch.empty(0, dtype=torch.long),
            decode_groups=(DecodeGroup(None, tables, mask[:, None, None, :], lens),),
            decode_block_tables=tables,
            decode_seq_lens=lens,
            decode_kv_buffer=torch.empty(2, tables.numel(), bs, hkv, d, dtype=dtype),
            prefills=(),
        )
        out = torch.empty_like(q)
        base = best_of(lambda: decode_attention_gathered(q, kv, meta, d**-0.5, out), args.repeat)  # noqa: B023
        ours = best_of(lambda: kernels.decode_attention(q, kv, tables, lens, d**-0.5), args.repeat)  # noqa: B023
        kv8 = kv_format.quantize(kv)  # the 8-bit cache (--kv-cache-dtype int8)
        int8 = best_of(lambda: kernels.decode_attention(q, kv8, tables, lens, d**-0.5), args.repeat)  # noqa: B023
        print(
            f"{batch:>6}{length:>8}{base * 1e3:>16.2f}{ours * 1e3:>11.2f}{base / ours:>9.2f}x"
            f"{int8 * 1e3:>12.2f}{ours / int8:>10.2f}x"
        )
    if kernels.amx:
        _prefill_attention(kernels, arch, args)


def _prefill_attention(kernels: Any, arch: Any, args: argparse.Namespace) -> None:
    """One prefill chunk's causal attention: SDPA (attention.py's path: causal over the
    chunk's own K/V, or over the gathered context with a mask) against the AMX kernel
    reading the paged cache."""
    from pdserve.model.attention import (
        AttentionMetadata,
        PrefillChunk,
        prefill_attention,
    )

    bs, hkv, d, h = 16, arch.num_kv_heads, arch.head_dim, arch.num_heads
    BF16 = torch.bfloat16
    print(f"\nprefill attention, one layer, one chunk, best of {args.repeat}")
    print(f"{'context':>8}{'chunk':>7}{'SDPA ms':>9}{'kernel ms':>11}{'speed-up':>10}"
          f"{'kernel GFLOP/s':>16}")  # fmt: skip
    rng = np.random.default_rng(0)
    for ctx, n in ((0, 128), (0, 512), (0, 1024), (1024, 1024)):
        num_blocks = -(-(ctx + n) // bs)
        kv = torch.randn(num_blocks, 2, bs, hkv, d, dtype=BF16)
        table = torch.from_numpy(rng.permutation(num_blocks))
        q, k, v = (torch.randn(n, heads, d, dtype=BF16) for heads in (h, hkv, hkv))
        meta = AttentionMetadata(
            num_decode_tokens=0,
            slot_block_ids=torch.empty(0, dtype=torch.long),
            slot_offsets=torch.empty(0, dtype=torch.long),
            decode_groups=(),
            decode_block_tables=None,
            decode_seq_lens=None,
            decode_kv_buffer=None,
            prefills=(PrefillChunk(0, n, ctx, table),),
        )
        out = torch.empty_like(q)
        base = best_of(lambda: prefill_attention(q, k, v, kv, meta, d**-0.5, out), args.repeat)  # noqa: B023
        ours = best_of(
            lambda: kernels.prefill_attention(q, kv, table, ctx, d**-0.5, out),  # noqa: B023
            args.repeat,
        )
        flops = 4 * h * d * n * (ctx + (n + 1) / 2)  # QK^T and PV over the visible keys
        print(f"{ctx:>8}{n:>7}{base * 1e3:>9.2f}{ours * 1e3:>11.2f}{base / ours:>9.2f}x"
              f"{flops / ours / 1e9:>16.0f}")  # fmt: skip
