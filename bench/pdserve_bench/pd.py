"""`pdserve bench pd`: what disaggregation costs and how fast it lets go.

Starts a prefill node, a decode node and a single node (same model and flags) on loopback,
then measures, each in the same run:
1. TTFT for prompts of each `--prompt-lens`: single node (streaming, first chunk) against
   P/D (prefill leg, then the decode leg streamed to its first chunk), alternating;
2. the KV read of each P/D request (bytes and seconds from the decode node's metrics);
3. release latency per scenario class: from the trigger (a cancel, an abort, a rejected
   decode leg) until `/admin/kv` on the node that held the blocks shows them free again.
   Measured from outside, so each sample includes one `/admin/kv` round trip or so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from pdserve.launch import Node, launch, sigterm_as_interrupt, stop_all, wait_healthy

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
HTTP = httpx.Client(headers=HEADERS)
"""One pooled client: a new one per call costs ~30 ms here, more than what is measured."""


def add_parser(bench_sub: Any) -> None:
    pd = bench_sub.add_parser("pd", help="P/D: TTFT vs one node, KV read speed, release latency")
    pd.add_argument("--model", default="default")
    pd.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    pd.add_argument("--prompt-lens", default="1024,4096", help="comma-separated token counts")
    pd.add_argument("--repeat", type=int, default=3, help="TTFT samples per length and system")
    pd.add_argument("--release-samples", type=int, default=20, help="per scenario class")
    pd.add_argument("--ucx-tls", default=None, help="e.g. tcp (the cross-host path)")
    pd.add_argument("--json", action="store_true")
    pd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    common = ["--model", args.model, "--dtype", args.dtype, "--api-key", KEY,
              "--max-num-batched-tokens", "4096", "--kv-cache-memory-gib", "2"]  # fmt: skip
    env = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
    nodes: list[Node] = []
    with sigterm_as_interrupt():  # SIGTERM stops the nodes as Ctrl-C does
        try:
            for role in (["--role", "prefill"], ["--role", "decode"], []):
                nodes.append(launch([*common, *role], env))
            prefill, decode, single = (wait_healthy(n) for n in nodes)
            results: dict[str, Any] = {"ttft": {}, "release_ms": {}}
            for length in (int(x) for x in args.prompt_lens.split(",")):
                results["ttft"][length] = _ttft(prefill, decode, single, length, args.repeat)
            results["release_ms"] = _releases(prefill, decode, args.release_samples)
            _print(results)
            if args.json:
                print(json.dumps(results))
        finally:
            stop_all(nodes)
    return 0


# -- TTFT and transfers ----------------------------------------------------------------


def _prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 10_000) for _ in range(length)]


def _first_chunk_s(node: Node, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    with HTTP.stream("POST", f"{node.url}/v1/completions", json={**body, "stream": True},
                      headers=HEADERS, timeout=600) as response:  # fmt: skip
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no chunk")


def _transfer(decode: Node) -> tuple[float, float]:
    text = HTTP.get(f"{decode.url}/metrics", timeout=10).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("pdserve_kv_transfer_")}  # fmt: skip
    return values.get("pdserve_kv_transfer_bytes_total", 0.0), values.get(
        "pdserve_kv_transfer_seconds_sum", 0.0
    )


def _ttft(prefill: Node, decode: Node, single: Node, length: int, repeat: int) -> dict[str, Any]:
    rng = random.Random(length)
    single_s, pd_s, prefill_leg_s, reads = [], [], [], []
    for _ in range(repeat + 1):  # the first round warms both paths up and is dropped
        body = {"prompt": _prompt(length, rng), "max_tokens": 4, "temperature": 0}
        single_sample = _first_chunk_s(single, body)
        body = {**body, "prompt": _prompt(length, rng)}
        before = _transfer(decode)
        start = time.perf_counter()
        first_leg = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        leg = HTTP.post(
            f"{prefill.url}/v1/completions", json=first_leg, headers=HEADERS, timeout=600
        )
        leg.raise_for_status()
        leg_s = time.perf_counter() - start
        kv = leg.json()["kv_transfer_params"]
        decode_first = _first_chunk_s(decode, {**body, "kv_transfer_params": kv})
        after = _transfer(decode)
        single_s.append(single_sample)
        pd_s.append(leg_s + decode_first)
        prefill_leg_s.append(leg_s)
        reads.append((after[0] - before[0], after[1] - before[1]))
    del single_s[0], pd_s[0], prefill_leg_s[0], reads[0]
    read_bytes = float(np.median([b for b, _ in reads]))
    read_s = float(np.median([s for _, s in reads]))
    return {
        "single_ttft_ms": 1000 * float(np.median(single_s)),
        "pd_ttft_ms": 1000 * float(np.median(pd_s)),
        "prefill_leg_ms": 1000 * float(np.median(prefill_leg_s)),
        "kv_read_mb": read_bytes / 1e6,
        "kv_read_ms": 1000 * read_s,
        "kv_read_gb_s": read_bytes / read_s / 1e9 if read_s else 0.0,
    }


# -- release latency ---------------------------------------------------------------------


def _idle(node: Node) -> bool:
    s = HTTP.get(f"{node.url}/admin/kv", timeout=10).json()
    return bool(s["num_free_blocks"] == s["num_blocks"] and s["num_handoffs"] == 0)


def _until_idle_ms(node: Node, trigger_s: float, limit_s: float = 30.0) -> float:
    while not _idle(node):
        if time.perf_counter() - trigger_s > limit_s:
            raise RuntimeError(f"{node.url} still holds blocks after {limit_s} s")
    return 1000 * (time.perf_counter() - trigger_s)


def _releases(prefill: Node, decode: Node, samples: int) -> dict[str, dict[str, float]]:
    rng = random.Random(7)

    def leg(length: int) -> tuple[dict[str, Any], dict[str, Any]]:
        body = {"prompt": _prompt(length, rng), "max_tokens": 64, "temperature": 0}
        first_leg = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        url = f"{prefill.url}/v1/completions"
        response = HTTP.post(url, json=first_leg, headers=HEADERS, timeout=600)
        return body, response.json()["kv_transfer_params"]

    def released_between_legs() -> float:  # S3/S15: the proxy's release-token abort
        _, kv = leg(256)
        trigger = time.perf_counter()
        HTTP.post(
            f"{prefill.url}/v1/abort_requests",
            timeout=10,
            json={"request_ids": [kv["remote_request_id"]], "release_token": kv["release_token"]},
        )
        return _until_idle_ms(prefill, trigger)

    def cancelled_during_prefill() -> float:  # S1: the client leaves mid-prefill
        body = {"prompt": _prompt(1024, rng), "max_tokens": 4,
                "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        with contextlib.suppress(httpx.TimeoutException):
            HTTP.post(f"{prefill.url}/v1/completions", json=body, headers=HEADERS, timeout=0.2)
        return _until_idle_ms(prefill, time.perf_counter())

    def rejected_by_decode() -> float:  # S4: the decode node refuses the leg
        body, kv = leg(256)
        bad = {**body, "temperature": -1, "kv_transfer_params": kv}
        trigger = time.perf_counter()
        HTTP.post(f"{decode.url}/v1/completions", json=bad, timeout=60)
        return _until_idle_ms(prefill, trigger)

    def cancelled_mid_decode() -> float:  # S7: the decode node frees its own blocks
        body, kv = leg(256)
        stream = {**body, "stream": True, "ignore_eos": True, "kv_transfer_params": kv}
        with HTTP.stream("POST", f"{decode.url}/v1/completions", json=stream,
                          headers=HEADERS, timeout=60) as response:  # fmt: skip
            lines = response.iter_lines()
            for _ in range(8):
                next(lines)
            trigger = time.perf_counter()
        return _until_idle_ms(decode, trigger)

    classes: dict[str, Callable[[], float]] = {
        "release between legs (S3/S15)": released_between_legs,
        "cancel during prefill (S1)": cancelled_during_prefill,
        "decode leg rejected (S4)": rejected_by_decode,
        "cancel mid-generation on decode (S7)": cancelled_mid_decode,
    }
    out = {}
    for name, sample in classes.items():
        values = [sample() for _ in range(samples)]
        out[name] = {"p50": float(np.percentile(values, 50)),
                     "p99": float(np.percentile(values, 99)), "max": max(values)}  # fmt: skip
    return out


def _print(results: dict[str, Any]) -> None:
    print("| prompt tokens | single-node TTFT | P/D TTFT (prefill leg) | ratio | KV read |")
    print("|---|---|---|---|---|")
    for length, r in results["ttft"].items():
        print(f"| {length} | {r['single_ttft_ms']:.0f} ms | {r['pd_ttft_ms']:.0f} ms "
              f"({r['prefill_leg_ms']:.0f} ms) | {r['pd_ttft_ms'] / r['single_ttft_ms']:.2f}x | "
              f"{r['kv_read_mb']:.1f} MB in {r['kv_read_ms']:.1f} ms "
              f"({r['kv_read_gb_s']:.2f} GB/s) |")  # fmt: skip
    print()
    print("| release after | p50 | p99 | max |")
    print("|---|---|---|---|")
    for name, r in results["release_ms"].items():
        print(f"| {name} | {r['p50']:.1f} ms | {r['p99']:.1f} ms | {r['max']:.1f} ms |")
