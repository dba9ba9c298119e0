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
import time
from dataclasses import asdict, dataclass

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


def run_pdserve(args: argparse.Namespace, workload: Workload) -> Result:
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    llm.generate(workload.prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(
            f"pdserve produced {produced} tokens, expected {workload.num_output_tokens}"
        )
    return _result("pdserve", seconds, workload)


def run_hf(args: argparse.Namespace, workload: Workload) -> Result:
    from pdserve.bench.hf_reference import hf_model_from_gguf
    from pdserve.model.loader import default_model_path

    if args.model != "default":
        raise SystemExit("--compare hf supports --model default (a GGUF) for now")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model, arch = hf_model_from_gguf(default_model_path(), dtype)
    pad = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    _hf_batch(model, workload.prompts[:2], 4, pad)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), args.hf_batch_size):
        batch = workload.prompts[i : i + args.hf_batch_size]
        _hf_batch(model, batch, max(workload.output_lens[i : i + args.hf_batch_size]), pad)
    return _result("hf-transformers", time.perf_counter() - start, workload)


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
    from pdserve.model.gguf_file import open_gguf
    from pdserve.model.loader import default_model_path

    vocab = open_gguf(default_model_path()).arch().vocab_size if args.model == "default" else 32000
    workload = make_workload(args, vocab)
    results = [run_pdserve(args, workload)]
    for peer in filter(None, (args.compare or "").split(",")):
        if peer != "hf":
            raise SystemExit(f"unknown --compare peer {peer!r} (supported: hf)")
        results.append(run_hf(args, workload))
    _report(args, workload, results)
    return 0


def _report(args: argparse.Namespace, w: Workload, results: list[Result]) -> None:
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
    print("ratio = pdserve throughput / that system's throughput")
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
