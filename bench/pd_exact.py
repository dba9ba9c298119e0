"""P/D against one node, request by request: the same tokens and logprobs? (issue 33)

Starts a prefill, a decode and a single node on one model and dtype, sends each prompt of
`pdserve bench offline`'s mixed workload (32..1024 random tokens) once to the single node and
once through the two legs, one request at a time (so both see the same batch: one request),
greedy, and counts the prompts whose tokens, or whose logprobs, differ.

    .venv/bin/python bench/pd_exact.py --dtype bfloat16 --num-prompts 200 --max-tokens 64
    PDSERVE_CPU_ISA=avx2 .venv/bin/python bench/pd_exact.py ...     # the AVX2 path forced
    ... --without-first-token   # the decode leg recomputes the last prompt position (vLLM's way)
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import httpx

from pdserve.launch import launch, stop_all, wait_healthy

API_KEY = "bench-key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-first-token", action="store_true")
    args = parser.parse_args()

    common = ["--model", args.model, "--dtype", args.dtype, "--api-key", API_KEY,
              "--max-model-len", "2048", "--num-kv-blocks", "128"]  # fmt: skip
    nodes = [
        launch([*common, "--role", "prefill"]),
        launch([*common, "--role", "decode"]),
        launch(common),
    ]
    try:
        prefill, decode, single = (wait_healthy(n, 300) for n in nodes)
        http = httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600)
        compute = http.get(f"{single.url}/v1/models").json()["data"][0].get("compute", {})
        rng = random.Random(args.seed)
        vocab = 49_000 if args.model == "default" else 300
        num_tokens_differ = num_logprobs_differ = 0
        started = time.monotonic()
        for i in range(args.num_prompts):
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(32, 1024))]
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "logprobs": args.logprobs}  # fmt: skip
            whole = _answer(http.post(f"{single.url}/v1/completions", json=body))
            leg_body = {**body, "kv_transfer_params": {"do_remote_decode": True}}
            kv = http.post(f"{prefill.url}/v1/completions", json=leg_body).json()[
                "kv_transfer_params"
            ]
            if args.without_first_token:
                kv = {k: v for k, v in kv.items() if not k.startswith("first_token")}
            split = _answer(http.post(f"{decode.url}/v1/completions",
                                      json={**body, "kv_transfer_params": kv}))  # fmt: skip
            num_tokens_differ += split[0] != whole[0]
            num_logprobs_differ += split != whole
            print(f"{i + 1}/{args.num_prompts} ({len(prompt)} tokens): tokens "
                  f"{'equal' if split[0] == whole[0] else 'DIFFER'}, logprobs "
                  f"{'equal' if split == whole else 'DIFFER'}", flush=True)  # fmt: skip
        print(
            f"\n{args.model}, {compute.get('dtype')} ({compute.get('ops')}), "
            f"{'without' if args.without_first_token else 'with'} the first token: "
            f"{args.num_prompts} prompts x {args.max_tokens} greedy tokens in "
            f"{time.monotonic() - started:.0f} s; tokens differ in {num_tokens_differ}, "
            f"tokens or logprobs in {num_logprobs_differ}"
        )
    finally:
        stop_all(nodes)


def _answer(response: httpx.Response) -> tuple[list[str], list[Any]]:
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]


if __name__ == "__main__":
    main()
