"""Two builds of a kernel library timed against each other on the linear over blocks
(`pd_linear_quant`, AMX tiles flagged where the CPU has them), alternating call by call in
one process, the order swapped every pass, weights from memory (256 MB of copies, as a
step streams them), outputs compared to the bit.

`--dtype float32` takes the float32 library (the one `PDSERVE_CPU_ISA` picks: `avx2` forces
its AVX2 build) and adds its dense linear (`pd_linear_small` on float32 weights) as a case.
A change to a kernel that keeps its results should print "same" everywhere, one that sums
in another order the largest difference relative to the output's largest; an unchanged
format is the control (its ratio is this machine's noise: 0.99-1.00x on the AMX class).
Separate runs of one build drift 1.5x on the shared 2-core VMs, and a C++ harness linking
both versions into one binary measured identical code up to 1.66x apart (code placement),
so builds are loaded as the engine loads them (`--path` builds the checkout's and prints it):

    NEW=$(.venv/bin/python bench/linear_builds_ab.py --path)
    git stash; OLD=$(.venv/bin/python bench/linear_builds_ab.py --path); git stash pop
    .venv/bin/python bench/linear_builds_ab.py $OLD $NEW
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import torch

from pdserve.model import cpu_kernels, kernel_build
from pdserve.model.quant import QuantType
from pdserve_bench.synthetic_gguf import random_blocks

AMX_TILES = 1 << 8  # cpu_kernels.AMX_TILES_FLAG
CASES = [  # (format, N, K): the default model's and the Llama-3.2-1B shape's layers
    (QuantType.Q4_1, 1536, 576),
    (QuantType.Q4_1, 576, 1536),
    (QuantType.Q4_K, 2048, 8192),
    (QuantType.Q4_K, 8192, 2048),
    (QuantType.Q5_K, 2048, 8192),
    (QuantType.Q5_0, 2048, 8192),
    (QuantType.Q6_K, 2048, 8192),
]


def library_path(dtype: torch.dtype) -> str:
    """The library of this checkout's sources for `dtype`, built if it is not yet."""
    from pdserve.model.cpu_isa import effective

    if cpu_kernels.load(dtype) is None:
        raise SystemExit(f"no {dtype} kernels: {cpu_kernels.unavailable_reason(dtype)}")
    build = cpu_kernels.build_for(dtype, effective())
    assert build is not None
    return str(kernel_build.library_path(build))


def linear(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, qtype: QuantType | None,
           flag: int, y: torch.Tensor) -> None:  # fmt: skip
    """y = x w^T by `lib`: dense float32 weights where `qtype` is None."""
    (rows, k), n = x.shape, y.shape[1]
    if qtype is None:
        lib.pd_linear_small(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), rows, n, k)
    else:
        lib.pd_linear_quant(x.data_ptr(), w.data_ptr(), int(qtype) | flag, None, y.data_ptr(),
                            rows, n, k)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", nargs="?")
    p.add_argument("new", nargs="?")
    p.add_argument("--path", action="store_true", help="print this checkout's library path")
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.path:
        print(library_path(dtype))
        return
    if not (args.old and args.new):
        p.error("give OLD and NEW library paths (or --path)")
    libs = [ctypes.CDLL(path) for path in (args.old, args.new)]
    for lib in libs:  # the signatures and return types the engine declares
        for name in ("pd_linear_quant", "pd_linear_small"):
            getattr(lib, name).argtypes = cpu_kernels._SIGNATURES[name]
            getattr(lib, name).restype = ctypes.c_int if name in cpu_kernels._RETURNS_INT else None
    bf16 = dtype == torch.bfloat16
    amx = bf16 and all(lib.pd_amx_available() and lib.pd_amx_init() == 0 for lib in libs)
    flag = AMX_TILES if amx else 0
    rng = np.random.default_rng(0)
    cases: list[tuple[QuantType | None, int, int]] = list(CASES)
    if not bf16:
        cases += [(None, 2048, 8192), (None, 8192, 2048)]  # dense float32 weights
    for rows in (int(v) for v in args.rows.split(",")):
        for qtype, n, k in cases:
            if qtype is None:
                w = torch.randn(n, k)
            else:
                w = torch.from_numpy(random_blocks(qtype.name, n, k, rng, random_scales=True))
            copies = [w.clone() for _ in range(max(1, 256 * 2**20 // w.nbytes))]
            x = torch.randn(rows, k).to(dtype)
            ys = [torch.empty(rows, n, dtype=dtype) for _ in libs]

            best = [float("inf")] * 2
            for rep in range(args.repeat):
                for i in (0, 1) if rep % 2 == 0 else (1, 0):
                    start = time.perf_counter()
                    for c in copies:
                        linear(libs[i], x, c, qtype, flag, ys[i])
                    best[i] = min(best[i], (time.perf_counter() - start) / len(copies))
            if torch.equal(ys[0], ys[1]):
                same = "same"
            else:
                a, b = ys[0].float(), ys[1].float()
                same = f"differ by {((a - b).abs().max() / a.abs().max()).item():.1e} of the most"
            label = qtype.label if qtype is not None else "dense"
            print(f"rows {rows:3d} {label} {n}x{k}: old {best[0] * 1e3:.3f} ms, "
                  f"new {best[1] * 1e3:.3f} ms, new/old {best[0] / best[1]:.2f}x, "
                  f"{same}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
