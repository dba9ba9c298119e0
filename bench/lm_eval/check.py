"""lm-eval's `local-completions` loglikelihood against `pdserve up`, checked against pdserve's
offline `LLM` (issue 34): the same scores to 1e-4?

Writes a small local multiple-choice task, starts `pdserve up` (a proxy, a prefill and a
decode node) on the default model, runs lm-eval (`bench/lm_eval/setup.sh` installs it in
bench/.venv-lm-eval) against the proxy with the model's tokenizer saved as a Hugging Face
tokenizer directory, then scores every (context, continuation) pair offline with
`LLM.generate(..., SamplingParams(max_tokens=0, prompt_logprobs=0))` from the same token
ids and prints the largest difference.

    bench/lm_eval/setup.sh
    .venv/bin/python bench/lm_eval/check.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.llm import LLM
from pdserve.model.files import load_tokenizer
from pdserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
LM_EVAL_PYTHON = ROOT / "bench" / ".venv-lm-eval" / "bin" / "python"
API_KEY = "lm-eval-check"

QUESTIONS = [  # lm-eval joins question and choice with its target delimiter, " "
    ("The capital of France is", ["Paris", "London", "Rome"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
    ("The largest planet in the solar system is", ["Jupiter", "Mars", "Venus"], 0),
    ("Two plus two equals", ["four", "five", "three"], 0),
    ("The opposite of hot is", ["cold", "warm", "green"], 0),
    ("A baby cat is called a", ["kitten", "puppy", "calf"], 0),
    ("The sun rises in the", ["east", "west", "north"], 0),
    ("Bees make", ["honey", "milk", "bread"], 0),
]

TASK = """task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""

ENCODE = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
pairs = json.load(sys.stdin)
out = []
for context, continuation in pairs:
    # lm-eval's _encode_pair: a context's trailing spaces move to the continuation
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    out.append([whole[: len(ctx)], whole[len(ctx) :]])
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if not LM_EVAL_PYTHON.exists():
        sys.exit("run bench/lm_eval/setup.sh first")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer_dir = _save_tokenizer(work / "tokenizer")
        data = work / "data.jsonl"
        data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                for q, c, a in QUESTIONS))  # fmt: skip
        (work / "task").mkdir()
        (work / "task" / "pdserve_mc.yaml").write_text(TASK.format(data=data))
        port = _free_port()
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--dtype",
             args.dtype, "--api-key", API_KEY, "--log-level", "warning"],
        )  # fmt: skip
        try:
            _wait_healthy(f"http://127.0.0.1:{port}")
            started = time.monotonic()
            samples = _run_lm_eval(port, tokenizer_dir, work)
            took = time.monotonic() - started
        finally:
            up.terminate()
            up.wait(60)
        # Per question, per choice: its (context, continuation) and (loglikelihood, greedy).
        pairs = [[a["arg_0"], a["arg_1"]] for s in samples for a in s["arguments"].values()]
        served = [float(r[0][0]) for s in samples for r in s["resps"]]
        encoded = json.loads(subprocess.run(
            [str(LM_EVAL_PYTHON), "-c", ENCODE, str(tokenizer_dir)],
            input=json.dumps(pairs), capture_output=True, text=True, check=True,
        ).stdout)  # fmt: skip
    llm = LLM("default", dtype=args.dtype)
    offline = []
    for context, continuation in encoded:
        [out] = llm.generate(
            context + continuation, SamplingParams(max_tokens=0, prompt_logprobs=0)
        )
        assert out.prompt_logprobs is not None
        offline.append(sum(e.logprob for e in out.prompt_logprobs[len(context) :] if e is not None))
    worst = max(abs(a - b) for a, b in zip(served, offline, strict=True))
    print(f"\nlm-eval local-completions loglikelihood, {len(served)} requests ({len(QUESTIONS)} "
          f"questions) against pdserve up ({args.dtype}) in {took:.1f} s")  # fmt: skip
    for (ctx, cont), a, b in zip(encoded, served, offline, strict=True):
        print(f"  {len(ctx):3d}+{len(cont)} tokens: served {a:.6f} offline {b:.6f}")
    print(f"largest difference: {worst:.2e} ({'within' if worst <= 1e-4 else 'OVER'} 1e-4)")


def _save_tokenizer(path: Path) -> Path:
    """The default model's tokenizer (from its GGUF) as a Hugging Face tokenizer directory."""
    tok = load_tokenizer("default")
    assert tok is not None
    path.mkdir()
    tok._tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _run_lm_eval(port: int, tokenizer_dir: Path, work: Path) -> list[dict]:
    model_args = (f"model=default,base_url=http://127.0.0.1:{port}/v1/completions,"
                  f"tokenizer={tokenizer_dir},tokenized_requests=True,num_concurrent=1,"
                  "max_retries=1")  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    subprocess.run(
        [str(LM_EVAL_PYTHON), "-m", "lm_eval", "--model", "local-completions", "--model_args",
         model_args, "--tasks", "pdserve_mc", "--include_path", str(work / "task"),
         "--output_path", str(work / "out"), "--log_samples"],
        env=env, check=True,
    )  # fmt: skip
    [found] = (work / "out").rglob("samples_pdserve_mc_*.jsonl")
    return [json.loads(line) for line in found.read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"pdserve up did not get healthy at {url}")


if __name__ == "__main__":
    main()
