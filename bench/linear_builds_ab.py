"""Two builds of the bf16 library timed against each other on the linear over blocks
(`pd_linear_quant`, AMX tiles flagged where the CPU has them), alternating call by call in
one process, the order swapped every pass, weights from memory (256 MB of copies, as a
step streams them), outputs compared to the bit.

A change to a kernel that keeps its results should print "same" everywhere; an unchanged
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


def library_path() -> str:
    """The bf16 library of this checkout's sources, built if it is not yet."""
    from pdserve.model import cpu_kernels
    from pdserve.model.cpu_isa import effective

    if cpu_kernels.load(torch.bfloat16) is None:
        raise SystemExit(f"no bf16 kernels: {cpu_kernels.unavailable_reason(torch.bfloat16)}")
    build = cpu_kernels.build_for(torch.bfloat16, effective())
    assert build is not None
    return str(cpu_kernels._library_path(build))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", nargs="?")
    p.add_argument("new", nargs="?")
    p.add_argument("--path", action="store_true", help="print this checkout's library path")
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--repeat", type=int, default=8)
    args = p.parse_args()
    if args.path:
        print(library_path())
        return
    if not (args.old and args.new):
        p.error("give OLD and NEW library paths (or --path)")
    libs = [ctypes.CDLL(path) for path in (args.old, args.new)]
    for lib in libs:
        fn = lib.pd_linear_quant
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # fmt: skip
        fn.restype = ctypes.c_int
    amx = all(lib.pd_amx_available() and lib.pd_amx_init() == 0 for lib in libs)
    flag = AMX_TILES if amx else 0
    rng = np.random.default_rng(0)
    for rows in (int(v) for v in args.rows.split(",")):
        for qtype, n, k in CASES:
            w = torch.from_numpy(random_blocks(qtype.name, n, k, rng, random_scales=True))
            copies = [w.clone() for _ in range(max(1, 256 * 2**20 // w.numel()))]
            x = torch.randn(rows, k).to(torch.bfloat16)
            ys = [torch.empty(rows, n, dtype=torch.bfloat16) for _ in libs]
            best = [float("inf")] * 2
            for rep in range(args.repeat):
                for i in (0, 1) if rep % 2 == 0 else (1, 0):
                    start = time.perf_counter()
                    for c in copies:
                        libs[i].pd_linear_quant(x.data_ptr(), c.data_ptr(), int(qtype) | flag, None,
                                                ys[i].data_ptr(), rows, n, k)  # fmt: skip
                    best[i] = min(best[i], (time.perf_counter() - start) / len(copies))
            same = torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
            print(f"rows {rows:3d} {qtype.label} {n}x{k}: old {best[0] * 1e3:.3f} ms, "
                  f"new {best[1] * 1e3:.3f} ms, new/old {best[0] / best[1]:.2f}x, "
                  f"{'same' if same else 'DIFFERENT'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
