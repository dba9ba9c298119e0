"""Is pdserve's bf16 path only rounding away from a pure-bf16 reference, or is there a bug?

The default model's answer to "What is the capital of France?" flips between "The capital
of France is Paris." and "L'Étoile, ..." depending on how bf16 is computed: the first
token's two candidates are ~0.1 apart in logprob. This prints, for that first token, the
top logprobs of:
- HF transformers in float32 (the reference the tests use);
- HF transformers in pure bf16 (the GGUF's weights rounded to bf16, every op in bf16);
- pdserve in bf16 on PyTorch ops, and on its fused kernels where the CPU has them;
- pdserve in float32 (its default on CPUs without native bf16).

Run it twice to see what the CPU's bf16 support changes: as it is, and with oneDNN held to
AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`, which emulates bf16 as an AVX2-only CPU does):

    .venv/bin/python bench/bf16_reference_probe.py
    ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/bf16_reference_probe.py

Then, over the first token of PROMPTS (chat questions and plain text), each bf16
system's mean and worst distance from HF's float32 logprobs (the fp32 top 10): a bug in
pdserve's bf16 path would show as a distance well beyond HF's own bf16 one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pdserve import LLM, SamplingParams
from pdserve.model.files import default_model_path
from pdserve_bench.hf_reference import hf_model_from_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOP = 5
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "import numpy as np\n", "The quick brown fox",
    "In 1492, Columbus", "Water boils at", "The largest planet in the solar system is",
    "To be or not to be,", "SELECT * FROM", "My favourite food is", "The speed of light is",
    "Photosynthesis is the process", "Dear Sir or Madam,", "The mitochondria is",
]  # fmt: skip


def hf_top(model: Any, ids: list[int]) -> list[tuple[int, float]]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    values, indices = logprobs.topk(TOP)
    return list(zip(indices.tolist(), values.tolist(), strict=True))


def pdserve_top(llm: LLM, ids: list[int], top: int = TOP) -> list[tuple[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=top)
    entry = llm.generate([ids], params)[0].outputs[0].logprobs[0]
    return sorted(entry.top, key=lambda tv: -tv[1])[:top]


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def distances(reference: list[list[tuple[int, float]]], rows: list[dict[int, float]]) -> str:
    errors = [abs(v - row[t]) for ref, row in zip(reference, rows, strict=True)
              for t, v in ref if t in row]  # fmt: skip
    return f"mean {sum(errors) / len(errors):.4f}, worst {max(errors):.4f} ({len(errors)} logprobs)"


def main() -> None:
    torch.set_num_threads(2)
    fp32 = LLM("default", dtype="float32", num_blocks=16, max_model_len=256)
    tokenizer = fp32.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode(tokenizer.apply_chat_template(QUESTION))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows: dict[str, list[tuple[int, float]]] = {}
    firsts: dict[str, list[dict[int, float]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = hf_model_from_gguf(default_model_path(), dtype)
        rows[f"HF {dtype}"] = hf_top(model, ids)
        logprobs = [hf_logprobs(model, p) for p in prompts]
        firsts[f"HF {dtype}"] = [dict(enumerate(lp.tolist())) for lp in logprobs]
    rows["pdserve float32"] = pdserve_top(fp32, ids)
    for kernels in ("torch", "auto"):
        llm = LLM("default", dtype="bfloat16", kernels=kernels, num_blocks=16, max_model_len=256)
        name = f"pdserve bf16 ({llm.engine.runner.ops.label})"
        rows[name] = pdserve_top(llm, ids)
        firsts[name] = [dict(pdserve_top(llm, p, 20)) for p in prompts]
    print(f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}")
    for name, top in rows.items():
        cells = "  ".join(f"{tokenizer.decode([t])!r:>8} {v:6.3f}" for t, v in top)
        print(f"{name:<40} {cells}")
    reference = [sorted(d.items(), key=lambda tv: -tv[1])[:10] for d in firsts["HF torch.float32"]]
    print(f"first token of {len(PROMPTS)} prompts, distance from HF float32's top 10:")
    for name, got in firsts.items():
        if name != "HF torch.float32":
            print(f"  {name:<40} {distances(reference, got)}")


if __name__ == "__main__":
    main()
