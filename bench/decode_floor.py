"""How close a batch-1 decode step comes to the weight-read floor: the time it takes this
machine to read the bytes a step reads, once.

A decode step at one sequence reads every weight once (the token embedding excepted: one row
of it), so it cannot take less than (bytes read) / (memory bandwidth). This loads the model
as `pdserve` would (quantization auto), counts those bytes, and in each of `--repeat` rounds
times, one after the other:

- the floor: reading a 2 GiB buffer (`torch.sum` on float32, as fast as a plain AVX-512 read
  loop here; 2 GiB is past any L3 these machines have), scaled to the step's bytes;
- a step: `--output-len` tokens against one, after the same prompt (greedy, ignore_eos),
  the difference divided by the extra tokens.

It prints each round and the median of step / floor. The machines are shared and drift, so a
round's two figures are taken within seconds of each other.

    .venv/bin/python bench/decode_floor.py PATH.gguf [--repeat 3] [--output-len 33]

The issue-35 line "8B Q4_K_M batch 1 at >= 90% of the floor" is this script's figure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from pdserve import LLM, SamplingParams
from pdserve.model.quant import QuantEmbedding, QuantLinear


def step_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every weight but the token embedding's (a tied LM head
    reads the table through its QuantLinear, which shares it)."""
    seen: set[int] = set()
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes

    for module in model.modules():
        if isinstance(module, (QuantEmbedding, nn.Embedding)):
            continue
        if isinstance(module, QuantLinear):
            count(module.qweight)
        for p in module.parameters(recurse=False):
            count(p)
    return total


def read_seconds(buffer: torch.Tensor, nbytes: int) -> float:
    """Seconds to read `nbytes` at the rate `buffer` reads (best of 3)."""
    best = min(_timed(buffer.sum) for _ in range(3))
    return best * nbytes / buffer.nbytes


def _timed(f: Callable[[], object]) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=33)
    p.add_argument("--kv-cache-memory-mib", type=int, default=512)
    args = p.parse_args()
    llm = LLM(args.model, kv_cache_memory_bytes=args.kv_cache_memory_mib << 20)
    nbytes = step_bytes(llm.engine.runner.model)
    print(f"weights: {llm.engine.loaded.quantization}")
    print(f"a step reads {nbytes / 1e9:.3f} GB; threads {torch.get_num_threads()}")
    prompt = list(range(100, 100 + args.input_len))  # token ids

    def generate(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        return _timed(lambda: llm.generate(prompt, params))

    generate(2)  # warm up
    buffer = torch.ones(2**29, dtype=torch.float32)
    ratios = []
    for r in range(args.repeat):
        floor = read_seconds(buffer, nbytes)
        step = (generate(args.output_len) - generate(1)) / (args.output_len - 1)
        ratios.append(floor / step)
        print(
            f"round {r + 1}: step {step * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms "
            f"({nbytes / floor / 1e9:.1f} GB/s), floor / step {floor / step:.0%}"
        )
    print(f"median floor / step: {statistics.median(ratios):.0%}")


if __name__ == "__main__":
    main()
