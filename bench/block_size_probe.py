"""The offline mixed workload through pdserve with several KV block sizes, alternating in
one process (every engine loaded once, then each run in turn), with the ratio of each
run to its partner on the first block size and whether the outputs are identical.

The measurement behind `CacheConfig.block_size` (docs/benchmarks.md):

    .venv/bin/python bench/block_size_probe.py --block-sizes 16,64 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pdserve import LLM, SamplingParams
from pdserve.bench.offline import kv_cache_bytes, make_workload
from pdserve.model.loader import read_arch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-sizes", default="16,64")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    sizes = [int(s) for s in args.block_sizes.split(",")]
    wargs = argparse.Namespace(
        model="default", dtype="bfloat16", workload="mixed", num_prompts=args.num_prompts,
        input_len=0, output_len=0, seed=0,
    )  # fmt: skip
    workload = make_workload(wargs, read_arch("default").vocab_size)
    llms = {
        size: LLM(
            "default",
            dtype="bfloat16",
            block_size=size,
            kv_cache_memory_bytes=kv_cache_bytes(wargs, workload),
            enable_prefix_caching=False,  # repeats send the same prompts (see bench offline)
        )
        for size in sizes
    }
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    for llm in llms.values():
        llm.generate(workload.prompts[:2], params[:2])  # warm-up
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(args.repeat):
        for size, llm in llms.items():
            start = time.perf_counter()
            outputs = llm.generate(workload.prompts, params)
            seconds[size].append(time.perf_counter() - start)
            tokens[size] = [list(o.outputs[0].token_ids) for o in outputs]
            print(f"block size {size:>3}: {seconds[size][-1]:.1f} s", flush=True)
    base = sizes[0]
    for size in sizes[1:]:
        ratios = [a / b for a, b in zip(seconds[base], seconds[size], strict=True)]
        same = sum(a == b for a, b in zip(tokens[base], tokens[size], strict=True))
        print(
            f"block size {size} against {base}: {' '.join(f'{r:.3f}x' for r in ratios)}, "
            f"median {statistics.median(ratios):.3f}x; identical outputs {same}/{len(tokens[base])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
