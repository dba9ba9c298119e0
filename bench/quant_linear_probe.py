"""How fast each GGUF block format's linear runs at one row of x, against dense weights.

A decode step at batch 1 reads every weight once; this times `CpuKernels.linear_quant` on
8 distinct 8192 x 2048 matrices (out of cache, as a step streams them), best of `--repeat`
passes, for every format with kernels, on the bf16 library (where the CPU has AVX512-BF16)
and the float32 library's AVX2 build, and the dense small-M linear beside them: Gweights/s
says whether a format is bound by arithmetic (widening blocks) or by memory (GB/s near the
dense one's).

    .venv/bin/python bench/quant_linear_probe.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from pdserve.model import cpu_kernels
from pdserve.model.cpu_isa import CpuIsa
from pdserve.model.quant import QuantLinear, QuantType
from pdserve_bench.synthetic_gguf import random_blocks

N, K, MATRICES = 8192, 2048, 8  # one Llama-1B MLP matrix's shape


def seconds_per_matrix(run: Callable[[Any], object], matrices: list[Any], repeat: int) -> float:
    """Best of `repeat` passes of `run` over every matrix, per matrix."""
    times = []
    for _ in range(repeat + 1):  # the first pass warms up
        start = time.perf_counter()
        for m in matrices:
            run(m)
        times.append(time.perf_counter() - start)
    return min(times[1:]) / len(matrices)


def _rates(s: float, nbytes: int, rows: int) -> str:
    """A matrix's time, bytes read, weights and multiply-adds a second."""
    weights = N * K / s / 1e9
    gbs, macs = nbytes / s / 1e9, rows * weights
    return f"{s * 1e3:6.2f} ms  {gbs:5.1f} GB/s  {weights:5.1f} Gweights/s  {macs:6.1f} GMAC/s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rows", type=int, default=1, help="rows of x (a step's batch)")
    p.add_argument("--formats", default="", help="comma-separated labels (default: all)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    for dtype, isa in [(torch.bfloat16, CpuIsa.AVX512_BF16), (torch.float32, CpuIsa.AVX2)]:
        k = cpu_kernels.load(dtype, isa)
        if k is None:
            print(f"{isa.label}: {cpu_kernels.unavailable_reason(dtype, isa)}")
            continue
        x = torch.randn(args.rows, K).to(dtype)
        wanted = args.formats.split(",") if args.formats else [q.label for q in QuantType]
        for qtype in [q for q in QuantType if q.label in wanted]:
            layers = []
            for _ in range(MATRICES):
                layer = QuantLinear(K, N, qtype, None)
                layer.qweight = torch.from_numpy(random_blocks(qtype.name, N, K, rng, True))
                layers.append(layer)
            s = seconds_per_matrix(partial(k.linear_quant, x), layers, args.repeat)
            print(
                f"{isa.label:12s} {qtype.label:5s} {_rates(s, layers[0].qweight.nbytes, args.rows)}"
            )
        dense = [torch.randn(N, K).to(dtype) for _ in range(MATRICES)]
        s = seconds_per_matrix(partial(k.linear, x, bias=None), dense, args.repeat)
        print(f"{isa.label:12s} dense {_rates(s, dense[0].nbytes, args.rows)}")


if __name__ == "__main__":
    main()
