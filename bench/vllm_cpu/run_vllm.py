"""vLLM's CPU build as a peer of `pdserve bench offline --compare vllm`: loads the model
once, then runs the workloads it is sent, timing each, until its stdin closes.

Run by bench/.venv-vllm's python (made by bench/vllm_cpu/setup.sh), never imported:
pdserve is not installed in that virtualenv and vLLM is not installed in pdserve's.

    bench/.venv-vllm/bin/python bench/vllm_cpu/run_vllm.py < LINES

Protocol, one JSON object a line (bench/pdserve_bench/offline.py's VllmRunner speaks it). The
first line on stdin is the configuration:
    model_dir              a Hugging Face directory (config.json + model.safetensors)
    dtype                  "bfloat16" or "float32"
    max_num_seqs           vLLM's batch limit
    max_model_len          the longest prompt + output of the planned workload
    kv_cache_memory_bytes  the KV budget (pdserve's, so neither preempts where the other
                           would not)

Once loaded, the script prints {"vllm_version", "threads_bind", "ld_preload", "load_s"} on
stdout. Then each line on stdin is a workload {"prompts": token id lists (no tokenizer is
loaded), "output_lens": tokens to generate per request (greedy, ignore_eos, exactly this
many)}, answered by {"seconds": the run's wall time, "token_ids": what each request
produced}. So the caller can alternate vLLM's runs with its own, and both see the machine
in the same state. The script ends when its stdin closes. vLLM's logs go to stderr.

The environment comes set (offline.py's vllm_env): VLLM_CPU_OMP_THREADS_BIND ("auto": vLLM
keeps one core for its scheduler process; "0-1": compute threads on cores 0 and 1; ...),
and the virtualenv's Intel OpenMP in LD_PRELOAD.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {argv[0]} < LINES (see the docstring)", file=sys.stderr)
        return 2
    spec = json.loads(sys.stdin.readline())
    # stdout carries the protocol: vLLM's logs go to stderr (read when vLLM is imported).
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        enforce_eager=True,  # no torch.compile: it would add its compile time to start-up
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        # Explicit, because vLLM's default on CPU reserves 92% of the machine's memory and
        # refuses to start when less than that is free.
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        # The caller repeats the same prompts: without this, later runs reuse the earlier
        # ones' KV and skip their prefill (pdserve's side does the same; see offline.py).
        enable_prefix_caching=False,
        seed=0,
    )
    ready = {
        "vllm_version": vllm.__version__,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "load_s": time.perf_counter() - start,
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        workload = json.loads(line)
        start = time.perf_counter()
        token_ids = _generate(llm, workload["prompts"], workload["output_lens"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "token_ids": token_ids}), flush=True)
    return 0


def _generate(llm: Any, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
        for n in output_lens
    ]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    produced = [len(t) for t in token_ids]
    if produced != output_lens:
        raise RuntimeError(f"vLLM produced {sum(produced)} tokens, not {sum(output_lens)}")
    return token_ids


if __name__ == "__main__":
    sys.exit(main(sys.argv))
