"""Does torch.compile pay off on pdserve's CPU path? Eager vs compiled, same process order.

The fused CPU kernels (bf16) already do in C++ what inductor would fuse, so the candidate
is the plain-PyTorch path (`kernels="torch"`): fp32, or machines without AVX512-BF16.
This compiles its element-wise pieces (residual add + RMSNorm, SiLU·mul, the whole MLP)
with dynamic shapes, since every step has a different token count, and times greedy
generation of 64 tokens at batch 1 and 32 (best of 3) against an eager engine.

    .venv/bin/python bench/torch_compile_probe.py --dtype float32

Result on the 2-core dev machine (2026-11-30, docs/benchmarks.md): it does not pay off,
so pdserve has no compile flag.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve import LLM, SamplingParams


def engine(dtype: str, compiled: bool) -> LLM:
    llm = LLM("default", dtype=dtype, kv_cache_memory_bytes=1 << 30, kernels="torch")
    if compiled:
        ops = llm.engine.runner.ops
        for name in ("add_rms_norm", "silu_mul"):
            setattr(ops, name, torch.compile(getattr(ops, name), dynamic=True))
        for layer in llm.engine.runner.model.layers:
            layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [list(range(100 + i, 132 + i)) for i in range(max(batches))]
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        llm = engine(args.dtype, compiled)
        start = time.perf_counter()
        llm.generate(prompts, params)  # warm-up; compiles
        print(f"{name}: first generation {time.perf_counter() - start:.1f} s")
        for batch in batches:
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                llm.generate(prompts[:batch], params)
                best = max(best, batch * 64 / (time.perf_counter() - start))
            print(f"{name}: batch {batch}: {best:.1f} tok/s")


if __name__ == "__main__":
    main()
