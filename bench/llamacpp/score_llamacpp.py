"""llama.cpp (through llama-cpp-python) scoring a text for `pdserve bench accuracy`: the
reference perplexity on the same GGUF file, the same token ids and the same windows.

Run by bench/.venv-llamacpp's python (made by bench/llamacpp/setup.sh), never imported:

    bench/.venv-llamacpp/bin/python bench/llamacpp/score_llamacpp.py < REQUEST

REQUEST is one JSON object:
    model_path   the GGUF file, as it is
    n_threads    compute threads
    n_ctx        the window length (tokens)
    n_batch      tokens per evaluation batch: pdserve's prefill chunk (the stride), so the
                 second half of a window reads the first from llama.cpp's KV cache
    token_ids    the whole text, as pdserve tokenized it
    windows      [start, end, first_target]: evaluate token_ids[start:end] as a fresh
                 sequence; score targets first_target..end-1, each from the logits of the
                 position before it
    repack       optional, default true: false turns llama.cpp's weight repacking off
                 (bench/pdserve_bench/llamacpp_amx.py says why and where)

The answer, one JSON line: {"version", "system_info", "seconds", "nll", "top1"}, per scored
target in order: its negative log-likelihood (float64 log-softmax of llama.cpp's logits)
and the position's most likely token.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
from run_llamacpp import turn_repacking_off  # this script's folder is on sys.path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    import llama_cpp

    request = json.loads(sys.stdin.read())
    if not request.get("repack", True):
        turn_repacking_off()
    llm = llama_cpp.Llama(
        model_path=request["model_path"],
        n_ctx=int(request["n_ctx"]),
        n_batch=int(request["n_batch"]),
        n_ubatch=int(request["n_batch"]),
        n_threads=int(request["n_threads"]),
        n_threads_batch=int(request["n_threads"]),
        logits_all=True,
        verbose=False,
    )
    ids = request["token_ids"]
    nll: list[float] = []
    top1: list[int] = []
    start = time.perf_counter()
    for first, end, first_target in request["windows"]:
        llm.reset()
        llm.eval(ids[first:end])
        rows = np.asarray(llm.scores[first_target - 1 - first : end - 1 - first], np.float64)
        score(rows, ids[first_target:end], nll, top1)
    answer: dict[str, Any] = {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "seconds": time.perf_counter() - start,
        "nll": nll,
        "top1": top1,
    }
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


def score(rows: np.ndarray, targets: list[int], nll: list[float], top1: list[int]) -> None:
    peak = rows.max(axis=1, keepdims=True)
    log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
    picked = rows[np.arange(len(targets)), targets]
    nll.extend((log_z - picked).tolist())
    top1.extend(rows.argmax(axis=1).tolist())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
