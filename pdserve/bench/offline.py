"""Offline throughput: the same prompts through pdserve and HF transformers in one run.

Workloads (token ids drawn from a seeded RNG, every request runs to its output length):
- `fixed`: N prompts of `input_len` tokens, `output_len` tokens each;
- `mixed`: N prompts of 32..1024 tokens and 16..512 output tokens (continuous batching).

HF transformers cannot batch requests of different lengths without padding: it runs them
in arrival-order batches of `--hf-batch-size`, left-padded to the batch's longest prompt,
for the batch's longest output. Only requested tokens are counted for either system.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class Result:
    system: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    low_id = 100  # skip special and control tokens at the start of the vocabulary
    if args.workload == "fixed":
        in_lens = [args.input_len] * args.num_prompts
        out_lens = [args.output_len] * args.num_prompts
    else:
        in_lens = [rng.randint(32, 1024) for _ in range(args.num_prompts)]
        out_lens = [rng.randint(16, 512) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(low_id, vocab_size) for _ in range(n)] for n in in_lens]
    return Workload(args.workload, prompts, out_lens)


class Runner(Protocol):
    name: str

    def __call__(self, workload: Workload) -> None: ...


def pdserve_runner(args: argparse.Namespace) -> Runner:
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)

    def run(workload: Workload) -> None:
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            for n in workload.output_lens
        ]
        outputs = llm.generate(workload.prompts, params)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        if produced != workload.num_output_tokens:
            raise RuntimeError(
                f"pdserve produced {produced} tokens, not {workload.num_output_tokens}"
            )

    run.name = "pdserve"  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def hf_runner(args: argparse.Namespace) -> Runner:
    from pdserve.bench.hf_reference import hf_model_from_gguf
    from pdserve.model.loader import default_model_path

    if args.model != "default":
        raise SystemExit("--compare hf supports --model default (a GGUF) for now")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model, arch = hf_model_from_gguf(default_model_path(), dtype)
    pad = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    size = args.hf_batch_size

    def run(workload: Workload) -> None:
        for i in range(0, len(workload.prompts), size):
            out_len = max(workload.output_lens[i : i + size])
            _hf_batch(model, workload.prompts[i : i + size], out_len, pad)

    run.name = "hf-transformers"  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


PEERS = {"hf": hf_runner}


def _hf_batch(model: object, prompts: list[list[int]], max_new: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        model.generate(  # type: ignore[attr-defined]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )


def _result(system: str, seconds: float, w: Workload) -> Result:
    return Result(
        system,
        seconds,
        w.num_output_tokens / seconds,
        (w.num_output_tokens + w.num_prompt_tokens) / seconds,
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from pdserve.model.loader import read_arch

    workload = make_workload(args, read_arch(args.model).vocab_size)
    peers = [p for p in (args.compare or "").split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown --compare peer {unknown[0]!r} (supported: {', '.join(PEERS)})")
    warmup = Workload("warm-up", workload.prompts[:2], [4, 4][: len(workload.prompts)])
    runners = [pdserve_runner(args)] + [PEERS[p](args) for p in peers]
    for runner in runners:
        runner(warmup)
    # Alternate the systems and keep each one's median: the shared machines are noisy, and
    # alternating spreads slow phases over both sides instead of penalising one.
    seconds: dict[str, list[float]] = {r.name: [] for r in runners}
    for _ in range(args.repeat):
        for runner in runners:
            start = time.perf_counter()
            runner(workload)
            seconds[runner.name].append(time.perf_counter() - start)
    results = [_result(name, statistics.median(ts), workload) for name, ts in seconds.items()]
    _report(args, workload, results, seconds)
    return 0


def _report(
    args: argparse.Namespace,
    w: Workload,
    results: list[Result],
    seconds: dict[str, list[float]],
) -> None:
    print(
        f"workload {w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt + "
        f"{w.num_output_tokens} output tokens, dtype {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'system':<18}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>14}{'ratio':>8}")
    base = results[0]
    for r in results:
        ratio = base.output_tokens_per_s / r.output_tokens_per_s
        print(
            f"{r.system:<18}{r.seconds:>10.2f}{r.output_tokens_per_s:>12.1f}"
            f"{r.total_tokens_per_s:>14.1f}{ratio:>7.2f}x"
        )
    print("ratio = pdserve throughput / that system's throughput (medians)")
    for name, ts in seconds.items():
        print(f"  {name} runs (s): " + ", ".join(f"{t:.2f}" for t in ts))
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
