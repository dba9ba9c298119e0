"""What rounding the activations costs: the accuracy side of 8-bit activations (issue 35).

The non-AMX classes' many-row linears are bound by multiply-adds; llama.cpp doubles its
products an instruction by taking x (each linear's input) as one byte a block of 32. Whether
pdserve should do the same is a precision decision, and this measures it without a kernel:
the default model in float32 on its GGUF blocks (`bench accuracy`'s f32-gguf), every
linear's x first rounded the way a kernel would take it, scored on `bench accuracy`'s text:

- exact: x as it is (the float32 kernels);
- split: two bytes a block of 32 (the bf16 library's `split_x`: 13-14 bits below the
  block's largest), what pdserve's integer kernels take now;
- q8: one byte a block of 32 and an fp16 scale (llama.cpp's Q8_0 activations);
- q8-body: q8 everywhere but the LM head (its input exact).

Per variant: perplexity, its change against exact, top-1 agreement with exact, and how many
greedy answers (32 tokens each) of a few prompts change.

    .venv/bin/python bench/activation_precision.py [--window 512 --stride 256]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from pdserve.model.cpu_ops import CpuKernelOps
from pdserve_bench.accuracy import FORMATS, plan_windows, score_pdserve, text_tokens

BLOCK = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "What is 17 times 23?",
    "Who wrote Pride and Prejudice?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
]


def q8(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's quantize_row_q8_0 leaves it: per 32, d = max|x| / 127 kept in
    fp16, q = round(x / d)."""
    blocks = x.float().reshape(-1, BLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def split(x: torch.Tensor) -> torch.Tensor:
    """x as quant_linear.h's split_x leaves it: s = 2^(e - 5) for the block's largest
    2^e <= m < 2^(e+1), x1 = round(x / s), x2 = round(256 (x / s - x1)); blocks whose
    largest is below 2^-121 as zeros."""
    blocks = x.float().reshape(-1, BLOCK)
    largest = blocks.abs().amax(dim=1, keepdim=True)
    live = largest >= 2.0**-121
    s = torch.exp2(
        torch.floor(torch.log2(torch.where(live, largest, torch.ones_like(largest)))) - 5
    )
    x1 = torch.round(blocks / s)
    x2 = torch.round(256 * (blocks / s - x1))
    out = torch.where(live, s * (x1 + x2 / 256), torch.zeros_like(blocks))
    return out.reshape(x.shape).to(x.dtype)


VARIANTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor] | None, bool]] = {
    "exact": (None, False),
    "split": (split, True),
    "q8": (q8, True),
    "q8-body": (q8, False),
}
"""name: (how x is rounded, whether the LM head's input is rounded too)."""


def patched(
    round_x: Callable[[torch.Tensor], torch.Tensor] | None, head: bool
) -> Callable[[], None]:
    """Route CpuKernelOps' linears through `round_x`; returns the undo. Decode steps then
    take the per-op path (`pd_decode_layers` runs every linear in C, past the rounding),
    in every variant alike."""
    linear, logits, table = CpuKernelOps.linear, CpuKernelOps.logits, CpuKernelOps._layer_table

    def undo() -> None:
        CpuKernelOps.linear, CpuKernelOps.logits = linear, logits  # type: ignore[method-assign]
        CpuKernelOps._layer_table = table  # type: ignore[method-assign]

    CpuKernelOps._layer_table = lambda *a: None  # type: ignore[method-assign]
    if round_x is None:
        return undo

    def rounded_linear(self: CpuKernelOps, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        return linear(self, round_x(x), layer)

    def head_logits(self: CpuKernelOps, h: torch.Tensor, out: torch.nn.Linear) -> torch.Tensor:
        return linear(self, round_x(h) if head else h, out)

    CpuKernelOps.linear = rounded_linear  # type: ignore[method-assign]
    CpuKernelOps.logits = head_logits  # type: ignore[method-assign]
    return undo


def greedy_answers(model: str) -> list[list[int]]:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N")
    args = p.parse_args()
    [fmt] = [f for f in FORMATS if f.name == "f32-gguf"]
    tokens = text_tokens(args.model, args.max_tokens)
    windows = plan_windows(len(tokens), args.window, args.stride)
    print(
        f"{len(tokens)} tokens, windows of {args.window} every {args.stride}; "
        "float32 on the GGUF's blocks"
    )
    header = f"{'x as':>8}{'perplexity':>12}{'change':>9}{'top-1 = exact':>15}"
    print(f"{header}{'answers changed':>17}")
    exact = None
    for name, (round_x, head) in VARIANTS.items():
        undo = patched(round_x, head)
        try:
            scores, _ = score_pdserve(args, fmt, "auto", tokens, windows)
            answers = greedy_answers(args.model)
        finally:
            undo()
        if exact is None:
            exact = (scores, answers)
        change = scores.perplexity / exact[0].perplexity - 1
        agree = float((scores.top1 == exact[0].top1).float().mean())
        changed = sum(a != b for a, b in zip(answers, exact[1], strict=True))
        print(
            f"{name:>8}{scores.perplexity:>12.4f}{change:>+9.2%}{agree:>15.4f}"
            f"{changed:>11d} of {len(PROMPTS)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
