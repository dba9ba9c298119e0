"""llama.cpp (through llama-cpp-python) as a peer of `pdserve bench offline --compare
llamacpp`: loads the GGUF once, then runs the workloads it is sent, timing each, until its
stdin closes.

Run by bench/.venv-llamacpp's python (made by bench/llamacpp/setup.sh), never imported:
pdserve is not installed in that virtualenv and llama.cpp is not installed in pdserve's.

    bench/.venv-llamacpp/bin/python bench/llamacpp/run_llamacpp.py < LINES

The protocol is run_vllm.py's (bench/pdserve_bench/offline.py speaks both). The first line on
stdin is the configuration:
    model_path   the GGUF file, as it is (no conversion)
    n_threads    compute threads, for decode and for prompt batches
    n_ctx        the longest prompt + output of the planned workload
    repack       optional, default true: false turns llama.cpp's weight repacking off
                 (bench/pdserve_bench/llamacpp_amx.py says why and where)

Once loaded, the script prints {"version", "system_info", "load_s"}. Then each line on stdin
is a workload {"prompts": token id lists, "output_lens": tokens to generate per request
(greedy, EOS ignored, exactly this many)}, answered by {"seconds", "token_ids"}.

The binding runs one sequence at a time: requests are served one after another (the
prompt in one batch, then one token a step). So this peer is llama.cpp at batch 1;
concurrent requests are llama-server's business (`--parallel N`), which the binding does
not include.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    import llama_cpp

    config = json.loads(sys.stdin.readline())
    if not config.get("repack", True):
        turn_repacking_off()
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=config["model_path"],
        n_ctx=int(config["n_ctx"]),
        n_batch=512,
        n_threads=int(config["n_threads"]),
        n_threads_batch=int(config["n_threads"]),
        verbose=False,
    )
    answer(
        {
            "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(),
            "load_s": time.perf_counter() - start,
        }
    )
    for line in sys.stdin:
        workload = json.loads(line)
        start = time.perf_counter()
        token_ids = [
            generate(llm, prompt, n)
            for prompt, n in zip(workload["prompts"], workload["output_lens"], strict=True)
        ]
        answer({"seconds": time.perf_counter() - start, "token_ids": token_ids})
    return 0


def generate(llm: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy, exactly n tokens: the prompt evaluated in one batch, then a token a step."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < n:
        token = llm.sample(temp=0.0)
        out.append(int(token))
        if len(out) < n:
            llm.eval([token])
    return out


def turn_repacking_off() -> None:
    """Models load with `use_extra_bufts=False` (the binding has no argument for it)."""
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without_extra_buffers


def answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
