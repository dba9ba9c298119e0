"""Greedy answers of the default model on its blocks in a dtype, one request at a time (every
decode step one row of x: the fused block kernels), saved for comparison with another run:

    .venv/bin/python bench/greedy_agreement.py float32 f32
    .venv/bin/python bench/greedy_agreement.py bfloat16 bf16
    .venv/bin/python bench/greedy_agreement.py --compare f32 bf16

`pdserve bench accuracy` scores whole windows (prefill-sized linears), which never take the
one-row kernels; this is their accuracy check.
"""

import json
import sys
from pathlib import Path

from pdserve import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "What is 17 times 23?",
    "Name three primary colors.", "Who wrote Romeo and Juliet?",
    "Give me a tip for learning Python.", "What is the boiling point of water in Fahrenheit?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "List the planets of the solar system.", "What does a CPU do?",
    "Describe a cat in ten words.", "What is the largest ocean?",
    "How many legs does a spider have?", "Suggest a name for a bakery.",
]  # fmt: skip


def saved(name: str) -> Path:
    return Path(f"/tmp/pdserve-greedy-{name}.json")


def main() -> None:
    if sys.argv[1] == "--compare":
        a, b = (json.loads(saved(n).read_text()) for n in sys.argv[2:4])
        equal = sum(x == y for x, y in zip(a, b, strict=True))
        prefix = sum(
            next(
                (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                min(len(x), len(y)),
            )
            for x, y in zip(a, b, strict=True)
        )
        print(f"answers equal: {equal}/{len(a)}; tokens before the first difference: "
              f"{prefix}/{sum(len(x) for x in a)}")  # fmt: skip
        return
    dtype, name = sys.argv[1:3]
    llm = LLM(dtype=dtype, max_num_seqs=1)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(chats, SamplingParams(max_tokens=64, temperature=0.0))
    saved(name).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    print(outs[0].outputs[0].text)


if __name__ == "__main__":
    main()
