"""One layer's four GEMMs (default model's shapes, weights hot in cache): oneDNN
(`F.linear`) against pdserve's AMX linear, in one process, best of `--repeat`.

The measurement behind `AMX_MAX_M` in pdserve/model/cpu_kernels.py, beside the
whole-step sweep of `pdserve bench kernels` (weights streamed from memory):

    .venv/bin/python bench/amx_linear_probe.py --rows 64,128,256,512,2048
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from pdserve.model import cpu_kernels
from pdserve_bench.kernels import best_of

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,128,256,512,1024,2048")
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.amx:
        print("no AMX on this machine (or no kernel build)", file=sys.stderr)
        return 1
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in SHAPES]
    packed = [kernels.pack_amx(w) for w in weights]
    print(f"{torch.get_num_threads()} threads; one layer's 4 GEMMs, best of {args.repeat}")
    print(f"{'rows':>5}{'oneDNN ms':>11}{'AMX ms':>9}{'ratio':>7}{'GFLOP/s oneDNN / AMX':>24}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (576, 1536)}
        flops = sum(2 * m * n * k for n, k in SHAPES)
        base = best_of(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], args.repeat)
        ours = best_of(
            lambda xs=xs: [
                kernels.linear_amx(xs[w.shape[1]], p, None)
                for w, p in zip(weights, packed, strict=True)
            ],
            args.repeat,
        )
        rates = f"{flops / base / 1e9:.0f} / {flops / ours / 1e9:.0f}"
        print(f"{m:>5}{base * 1e3:>11.3f}{ours * 1e3:>9.3f}{base / ours:>7.2f}{rates:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
