"""What a model costs in memory: load it as `pdserve` would (quantization auto), generate
32 tokens, print the weights' bytes, VmRSS (anonymous and file-backed) and the peak RSS.

    .venv/bin/python bench/memory_probe.py PATH.gguf [--kv-cache-memory-gib 1]

The issue-35 figure for the Llama-3.1-8B shape's Q4_K_M file (pdserve_bench.synthetic_gguf)
comes from this.
"""

from __future__ import annotations

import argparse
import resource
import time

from pdserve import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30),
    )
    print("weights:", llm.engine.loaded.quantization)
    start = time.perf_counter()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    out = llm.generate(["The capital of France is"], params)[0].outputs[0]
    seconds = time.perf_counter() - start
    print(f"answer: {out.text[:60]!r} ({len(out.token_ids)} tokens in {seconds:.1f} s)")
    with open("/proc/self/status") as f:
        keep = ("VmRSS", "RssAnon", "RssFile")
        status = dict(line.split(":", 1) for line in f if line.startswith(keep))
    print({k: v.strip() for k, v in status.items()})
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
