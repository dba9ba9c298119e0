"""How fast each GGUF block format's linear runs at a few rows of x, against dense weights.

A decode step at batch 1 reads every weight once; this times `CpuKernels.linear_quant` on
8 distinct matrices of each `--shapes` N x K (default 8192 x 2048; out of cache, on huge
pages, as a step streams the model's weights), best of `--repeat` passes, for every format
with kernels, on the bf16 library (where the CPU has AVX512-BF16) and the float32 library's
AVX2 build, and the dense small-M linear beside them: Gweights/s says whether a format is
bound by arithmetic (widening blocks) or by memory (GB/s near the dense one's).

    .venv/bin/python bench/quant_linear_probe.py [--rows 4] [--shapes 8192x2048,2048x8192]
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
from pdserve.model.huge_pages import Arena
from pdserve.model.quant import QuantLinear, QuantType
from pdserve_bench.synthetic_gguf import random_blocks

MATRICES = 8


def seconds_per_matrix(run: Callable[[Any], object], matrices: list[Any], repeat: int) -> float:
    """Best of `repeat` passes of `run` over every matrix, per matrix."""
    times = []
    for _ in range(repeat + 1):  # the first pass warms up
        start = time.perf_counter()
        for m in matrices:
            run(m)
        times.append(time.perf_counter() - start)
    return min(times[1:]) / len(matrices)


def _rates(s: float, nbytes: int, rows: int, n: int, k: int) -> str:
    """A matrix's time, bytes read, weights and multiply-adds a second."""
    weights = n * k / s / 1e9
    gbs, macs = nbytes / s / 1e9, rows * weights
    return f"{s * 1e3:6.2f} ms  {gbs:5.1f} GB/s  {weights:5.1f} Gweights/s  {macs:6.1f} GMAC/s"


def _on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies in one huge-page arena, where the model's weights live."""
    arena = Arena(sum(t.nbytes + 64 for t in tensors) + (4 << 20))
    return [arena.copy_of(t) for t in tensors]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rows", type=int, default=1, help="rows of x (a step's batch)")
    p.add_argument("--formats", default="", help="comma-separated labels (default: all)")
    p.add_argument("--shapes", default="8192x2048", help="comma-separated NxK (out x in)")
    p.add_argument(
        "--levels", default="amx,avx512_bf16,avx2", help="CPU levels to time (bf16 on AMX and "
        "AVX512-BF16, float32 on AVX2), those this CPU has"
    )  # fmt: skip
    args = p.parse_args()
    rng = np.random.default_rng(0)
    levels = {
        "amx": (torch.bfloat16, CpuIsa.AMX),
        "avx512_bf16": (torch.bfloat16, CpuIsa.AVX512_BF16),
        "avx2": (torch.float32, CpuIsa.AVX2),
    }
    for dtype, isa in [levels[name] for name in args.levels.split(",")]:
        k = cpu_kernels.load(dtype, isa)
        if k is None or k.isa != isa:
            print(f"{isa.label}: {cpu_kernels.unavailable_reason(dtype, isa) or 'not here'}")
            continue
        wanted = args.formats.split(",") if args.formats else [q.label for q in QuantType]
        for shape in args.shapes.split(","):
            n, kk = (int(d) for d in shape.split("x"))
            x = torch.randn(args.rows, kk).to(dtype)
            for qtype in [q for q in QuantType if q.label in wanted]:
                layers = [QuantLinear(kk, n, qtype, None) for _ in range(MATRICES)]
                blocks = [
                    torch.from_numpy(random_blocks(qtype.name, n, kk, rng, True)) for _ in layers
                ]
                for layer, b in zip(layers, _on_huge_pages(blocks), strict=True):
                    layer.qweight = b
                s = seconds_per_matrix(partial(k.linear_quant, x), layers, args.repeat)
                rates = _rates(s, layers[0].qweight.nbytes, args.rows, n, kk)
                print(f"{isa.label:12s} {n}x{kk} {qtype.label:5s} {rates}")
            dense = _on_huge_pages([torch.randn(n, kk).to(dtype) for _ in range(MATRICES)])
            if k.route(x, dense[0]) == "amx":  # the dense model's kernel at these rows
                dense = _on_huge_pages([k.pack_amx(w) for w in dense])
                s = seconds_per_matrix(partial(k.linear_amx, x, bias=None), dense, args.repeat)
            else:
                s = seconds_per_matrix(partial(k.linear, x, bias=None), dense, args.repeat)
            print(f"{isa.label:12s} {n}x{kk} dense {_rates(s, dense[0].nbytes, args.rows, n, kk)}")


if __name__ == "__main__":
    main()
