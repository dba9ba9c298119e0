"""Does a request's answer depend on its batch? Each prompt alone (one chunk, no prefix
cache) against all of them together (97-token steps, so chunks start anywhere, and the
prefix cache warm for the prompts that share a 150-token prefix), greedy, tokens and
logprobs compared exactly.

    .venv/bin/python bench/batch_invariance_probe.py --dtype bfloat16 [--batch-invariant]
    PDSERVE_CPU_ISA=avx2 .venv/bin/python bench/batch_invariance_probe.py --dtype float32

docs/benchmarks.md ("Under load") has the results by setting.
"""

from __future__ import annotations

import argparse
import random
import time

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    opts = {
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": args.batch_invariant,
        "max_model_len": 1024,
    }
    rng = random.Random(0)
    shared = [rng.randrange(100, 49000) for _ in range(150)]
    prompts = [
        (shared if i % 3 == 0 else [])
        + [rng.randrange(100, 49000) for _ in range(rng.randint(5, 300))]
        for i in range(args.num_prompts)
    ]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    started = time.perf_counter()
    quiet = LLM(args.model, enable_prefix_caching=False, **opts)
    print("ops:", quiet.engine.runner.ops.label)
    alone = [quiet.generate([prompt], sp)[0].outputs[0] for prompt in prompts]
    del quiet
    busy = LLM(args.model, max_num_batched_tokens=97, **opts)
    busy.generate(prompts[:1], sp)  # the shared prefix into the cache
    together = [r.outputs[0] for r in busy.generate(prompts, sp)]
    tokens = logprobs = 0
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        la, lb = [t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs]
        tokens += a.token_ids != b.token_ids
        logprobs += la != lb
        if la != lb:
            j = next(k for k in range(len(la)) if la[k] != lb[k])
            print(f"  prompt {i} ({len(prompts[i])} tokens): first differs at output {j}")
    n = len(prompts)
    print(f"tokens differ {tokens} of {n}, logprobs differ {logprobs} of {n} "
          f"({time.perf_counter() - started:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
