"""The offline mixed workload through pdserve with several KV block sizes, alternating in
one process (every engine loaded once, then each run in turn), with the ratio of each
run to its partner on the first block size and whether the outputs are identical. Each
engine is `bench offline`'s pdserve runner (same KV budget, prefix caching off, token
counts checked), built with a different `block_size`.

The measurement behind `CacheConfig.block_size` (docs/benchmarks.md):

    .venv/bin/python bench/block_size_probe.py --block-sizes 16,64 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pdserve.model.loader import read_arch
from pdserve_bench.offline import Workload, make_workload, pdserve_runner


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-sizes", default="16,64")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    sizes = [int(s) for s in args.block_sizes.split(",")]
    bench_args = argparse.Namespace(  # what `pdserve bench offline --workload mixed` uses
        model="default", dtype="bfloat16", workload="mixed", num_prompts=args.num_prompts,
        seed=0, max_num_seqs=256,
    )  # fmt: skip
    workload = make_workload(bench_args, read_arch("default").vocab_size)
    runners = {size: pdserve_runner(bench_args, workload, block_size=size) for size in sizes}
    warmup = Workload("warm-up", workload.prompts[:2], [4, 4])
    for runner in runners.values():
        runner(warmup)
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.repeat):
        for size, runner in runners.items():
            seconds[size].append(runner(workload))
            print(f"block size {size:>3}: {seconds[size][-1]:.1f} s", flush=True)
    base = sizes[0]
    for size in sizes[1:]:
        ratios = [a / b for a, b in zip(seconds[base], seconds[size], strict=True)]
        tokens = [runners[s].last_token_ids for s in (base, size)]  # type: ignore[attr-defined]
        same = sum(a == b for a, b in zip(*tokens, strict=True))
        print(
            f"block size {size} against {base}: {' '.join(f'{r:.3f}x' for r in ratios)}, "
            f"median {statistics.median(ratios):.3f}x; identical outputs {same}/{len(tokens[0])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
