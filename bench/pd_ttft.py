"""P/D time to first token with and without the prefill leg's first token (issue 33).

Since issue 33 the prefill leg's sampled token rides in `kv_transfer_params`: the decode
node reads every prompt position's KV and continues from that token, where before it
recomputed the last prompt position in a step of its own. That must not cost time to the
first token. This times both ways on the same nodes, alternating prompt by prompt: the
prefill leg, then the decode leg streamed until its first token (what the proxy does),
one request at a time.

    .venv/bin/python bench/pd_ttft.py --prompt-tokens 1024 --num-prompts 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import httpx

from pdserve.launch import launch, stop_all, wait_healthy

API_KEY = "bench-key"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    common = ["--model", args.model, "--dtype", args.dtype, "--api-key", API_KEY,
              "--max-model-len", str(args.prompt_tokens + 64), "--num-kv-blocks", "256",
              "--no-prefix-caching"]  # fmt: skip
    nodes = [launch([*common, "--role", "prefill"]), launch([*common, "--role", "decode"])]
    try:
        prefill, decode = (wait_healthy(n, 300) for n in nodes)
        http = httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600)
        rng = random.Random(args.seed)
        vocab = 49_000 if args.model == "default" else 300
        ttft: dict[bool, list[float]] = {True: [], False: []}
        for i in range(-1, args.num_prompts):  # the first round warms both nodes up
            for with_token in (i % 2 == 0, i % 2 != 0):
                prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
                seconds = _ttft(http, prefill.url, decode.url, prompt, with_token)
                if i >= 0:
                    ttft[with_token].append(seconds)
        for with_token in (True, False):
            times = sorted(ttft[with_token])
            print(f"{'with' if with_token else 'without'} the first token: TTFT p50 "
                  f"{statistics.median(times) * 1e3:.1f} ms, mean "
                  f"{statistics.mean(times) * 1e3:.1f} ms, min {times[0] * 1e3:.1f} ms "
                  f"over {len(times)} prompts of {args.prompt_tokens} tokens")  # fmt: skip
        ratio = statistics.median(ttft[True]) / statistics.median(ttft[False])
        print(f"p50 with / without: {ratio:.3f}")
    finally:
        stop_all(nodes)


def _ttft(http: httpx.Client, prefill: str, decode: str, prompt: list[int],
          with_token: bool) -> float:  # fmt: skip
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    kv = http.post(f"{prefill}/v1/completions", json=leg).json()["kv_transfer_params"]
    if not with_token:
        kv = {k: v for k, v in kv.items() if not k.startswith("first_token")}
    stream = {**body, "stream": True, "kv_transfer_params": kv}
    with http.stream("POST", f"{decode}/v1/completions", json=stream) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("the decode leg streamed no token")


if __name__ == "__main__":
    main()
