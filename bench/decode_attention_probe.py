"""How fast decode attention reads the paged KV cache, bf16 against the 8-bit cache.

Times `CpuKernels.decode_attention` (one layer, one query token a sequence) for the default
model's heads (9 query, 3 kv, head size 64, blocks of 64) at a few context lengths and
batch sizes, keys in shuffled blocks as a long-running cache holds them; each call on the
next of enough layers' caches (256 MB of bf16) that they come from memory, as in a step,
not from the last call's L3, and on huge pages as the engine's cache is (4 KiB pages cost
~5% here); best of `--repeat` passes. GB/s is the cache bytes a call
reads over its time: the 8-bit cache reads half the bytes, so it is faster only if its
kernel keeps up.

    .venv/bin/python bench/decode_attention_probe.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from pdserve.model import cpu_kernels, huge_pages, kv_format

H, HKV, D, BLOCK = 9, 3, 64, 64


def best_seconds(
    run: Callable[[torch.Tensor], object], layers: list[torch.Tensor], repeat: int
) -> float:
    """Seconds a call, best of `repeat` passes over every layer's cache."""
    times = []
    for _ in range(repeat + 1):  # the first pass warms up
        start = time.perf_counter()
        for kv in layers:
            run(kv)
        times.append((time.perf_counter() - start) / len(layers))
    return min(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,4096,8192")
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    k = cpu_kernels.load(torch.bfloat16)
    if k is None:
        raise SystemExit(f"no bf16 kernels: {cpu_kernels.unavailable_reason(torch.bfloat16)}")
    torch.manual_seed(0)
    print("context batch   bf16 ms  GB/s   int8 ms  GB/s   int8 speed")
    for length in (int(v) for v in args.contexts.split(",")):
        for batch in (int(v) for v in args.batches.split(",")):
            blocks = batch * length // BLOCK
            cache = torch.randn(blocks, 2, BLOCK, HKV, D).to(torch.bfloat16)
            copies = max(2, 256 * 2**20 // cache.nbytes)
            tables = torch.randperm(blocks).reshape(batch, -1).contiguous()
            q = torch.randn(batch, H, D).to(torch.bfloat16)
            lens = torch.full((batch,), length)
            row = []
            for one in (cache, kv_format.quantize(cache)):
                layers = [huge_pages.Arena(chunk_bytes=0).copy_of(one) for _ in range(copies)]
                attend = partial(_attend, k, q, tables=tables, lens=lens)
                s = best_seconds(attend, layers, args.repeat)
                row.append((s, one.nbytes / s / 1e9))
                del layers
            (sb, gb), (si, gi) = row
            ms = f"{sb * 1e3:8.3f} {gb:5.1f}  {si * 1e3:8.3f} {gi:5.1f}"
            print(f"{length:7d} {batch:5d}  {ms}   {sb / si:5.2f}x")


def _attend(
    k: cpu_kernels.CpuKernels,
    q: torch.Tensor,
    kv: torch.Tensor,
    *,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    return k.decode_attention(q, kv, tables, lens, D**-0.5)


if __name__ == "__main__":
    main()
