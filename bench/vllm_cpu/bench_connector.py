"""vLLM's stock NixlConnector against pdserve's PdserveConnector, side by side in one run:
the same vLLM CPU prefill + decode pair, behind pdserve's proxy, default model, float32
(issue 32's acceptance; docs/vllm.md, docs/benchmarks.md).

    bench/vllm_cpu/setup.sh
    .venv/bin/python bench/vllm_cpu/bench_connector.py [--connectors NixlConnector,PdserveConnector]

Per connector, on a fresh pair:
1. throughput: 32 concurrent requests x 128 tokens through the proxy (3 runs);
2. S3: 20 clients gone between the legs (the proxy's seam holds each request there 4 s):
   each release's time until vLLM reported the blocks freed, and the time until the prefill
   node's KV usage was back to 0 after the clients left (the seam's remainder included);
3. S5: 20 clients gone while their decode legs wait in the decode node's queue (its 32
   sequences busy with long requests): the same two times;
4. S9: a decode leg sent after the prefill node's lease, its freed blocks reused by other
   prompts meanwhile: is the answer one node's?
5. S8 (PdserveConnector only: the seam is its worker's): every completion signal repeated
   and an unknown one added, during 16 requests: engines up, nothing held after;
6. S10: the decode node SIGKILLed with 5 decode legs in its queue, sent through the proxy
   (which sees them fail and releases), then on a new decode node sent directly (only the
   lease frees them): time until the prefill node's KV usage is 0.

Release times come from PdserveConnector's own record (`GET {control_url}/kv/handoffs`:
when each handoff ended, why, and when vLLM reported its blocks freed); KV usage is vLLM's
`vllm:kv_cache_usage_perc` on the prefill node.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pdserve.launch import Node, launch, stop, wait_healthy
from pdserve.vllm.signals import DUPLICATE_SIGNALS_SEAM
from pdserve_bench.vllm_nodes import (
    kill_node,
    kv_cache_usage,
    launch_vllm_node,
    stop_vllm_node,
    vllm_unavailable,
)

SECRET = "bench-cluster-secret"
ADMIN = {"Authorization": f"Bearer {SECRET}"}
NUM_TRIALS = 20
SEAM_S = 4.0
"""How long the S3 proxy holds each request between its legs (a test seam): its clients
leave 2 s after sending, once every prefill answer is in, and the proxy notices when the
seam ends (a real proxy checks as soon as the answer is in)."""
NUM_THROUGHPUT_RUNS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connectors", default="NixlConnector,PdserveConnector")
    parser.add_argument("--trials", type=int, default=NUM_TRIALS)
    parser.add_argument(
        "--throughput-ab",
        type=int,
        default=0,
        metavar="N",
        help="only throughput: both pairs up at once, N runs each, alternating",
    )
    args = parser.parse_args()
    if (why := vllm_unavailable()) is not None:
        raise SystemExit(why)
    if args.throughput_ab:
        throughput_ab(args.connectors.split(","), args.throughput_ab)
        return
    results = {c: run_connector(c, args.trials) for c in args.connectors.split(",")}
    print("\n" + report(results))


def throughput_ab(connectors: list[str], num_runs: int) -> None:
    """Every connector's pair up at once (idle nodes cost nothing), then the throughput
    runs alternate between them, so a drift of the shared machine falls on all alike."""
    pairs, proxies = [], []
    logs = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    try:
        for connector in connectors:
            extra = {"pdserve_cluster_secret": SECRET} if connector == "PdserveConnector" else {}
            pair = []
            for role in ("kv_producer", "kv_consumer"):
                with (logs / f"{connector}-{role}.log").open("wb") as out:
                    pair.append(
                        launch_vllm_node(role, connector, extra, max_num_seqs=32, output=out)
                    )
            pairs.append(pair)
        for pair in pairs:
            prefill, decode = (wait_healthy(n, 900) for n in pair)
            proxies.append(proxy_for(prefill, decode))
            ask(proxies[-1], "warm up", 8)
        runs: dict[str, list[float]] = {c: [] for c in connectors}
        for _ in range(num_runs):
            for connector, proxy in zip(connectors, proxies, strict=True):
                runs[connector].append(throughput(proxy))
                print(connector, f"{runs[connector][-1]:.1f} tok/s", flush=True)
        base = statistics.median(runs[connectors[0]])
        for connector in connectors:
            median = statistics.median(runs[connector])
            print(f"{connector}: median {median:.1f} tok/s over {num_runs} runs "
                  f"({median / base:.3f}x {connectors[0]}); runs "
                  + ", ".join(f"{t:.1f}" for t in runs[connector]))  # fmt: skip
    finally:
        for proxy in proxies:
            stop(proxy)
        for pair in pairs:
            for node in pair:
                stop_vllm_node(node)


def run_connector(connector: str, trials: int) -> dict[str, Any]:
    print(f"\n== {connector}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix=f"bench-{connector}-"))
    storm = logs / "storm"
    extra = {"pdserve_cluster_secret": SECRET} if connector == "PdserveConnector" else {}
    env = {DUPLICATE_SIGNALS_SEAM: str(storm)}

    def start(role: str) -> Node:
        with (logs / f"{role}.log").open("wb") as out:
            return launch_vllm_node(role, connector, extra, env, max_num_seqs=32, output=out)

    nodes = [start("kv_producer"), start("kv_consumer")]
    result: dict[str, Any] = {}
    try:
        prefill, decode = (wait_healthy(n, 900) for n in nodes)
        proxy = proxy_for(prefill, decode)
        held = proxy_for(prefill, decode, "--debug-delay-between-legs-s", str(SEAM_S))
        try:
            ask(proxy, "warm up", 8)  # NIXL handshake; the proxies learn the control endpoint
            ask(held, "warm up", 8)
            if connector == "PdserveConnector":
                learn_control_url(prefill)
            result["tok_s"] = [throughput(proxy) for _ in range(NUM_THROUGHPUT_RUNS)]
            result["s3"] = between_legs(held, prefill, trials)
            result["s5"] = decode_queue(proxy, prefill, decode, trials)
            result["s9"] = read_after_lease(prefill, decode, connector)
            if connector == "PdserveConnector":
                result["s8"] = storm_run(proxy, prefill, decode, storm, logs)
            result["s10_proxy"] = decode_killed(proxy, prefill, decode, via_proxy=True)
            decode = wait_healthy(start("kv_consumer"), 900)
            nodes.append(decode)
            result["s10_lease"] = decode_killed(proxy, prefill, decode, via_proxy=False)
        finally:
            stop(held)
            stop(proxy)
    finally:
        for node in nodes:
            stop_vllm_node(node)
    print(result, flush=True)
    return result


# -- phases ---------------------------------------------------------------------------------


def throughput(proxy: Node, num: int = 32, tokens: int = 128) -> float:
    body = {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    with ThreadPoolExecutor(num) as pool:
        list(pool.map(lambda i: ask(proxy, f"Story number {i}:", tokens, body), range(num)))
    return num * tokens / (time.monotonic() - started)


def between_legs(held: Node, prefill: Node, trials: int) -> dict[str, Any]:
    """Clients that leave while the proxy holds them between the legs."""
    before = len(releases(prefill))
    with ThreadPoolExecutor(trials) as pool:
        for i in range(trials):
            pool.submit(gone_after, held, f"Gone between legs {i}", 2.0)
    left_s = time.monotonic()
    back_s = wait_usage_zero(prefill, 120)
    ended = releases(prefill)[before:]
    return {
        "freed_after_release_s": [r["freed_after_s"] for r in ended],
        "reasons": sorted({r["reason"] for r in ended}),
        "usage_zero_after_clients_left_s": back_s,
        "usage_zero_after_release_s": left_s
        + back_s
        - max((r["at_s"] for r in ended), default=left_s),
    }


def decode_queue(proxy: Node, prefill: Node, decode: Node, trials: int) -> dict[str, Any]:
    """Decode legs that wait behind 32 long requests, their clients gone after 3 s."""
    before = len(releases(prefill))
    with busy(decode, 32):
        with ThreadPoolExecutor(trials) as pool:
            for i in range(trials):
                pool.submit(gone_after, proxy, f"Gone in the queue {i}", 3.0)
        left_s = time.monotonic()
        back_s = wait_usage_zero(prefill, 120)
    ended = releases(prefill)[before:]
    return {
        "freed_after_release_s": [r["freed_after_s"] for r in ended],
        "reasons": sorted({r["reason"] for r in ended}),
        "usage_zero_after_clients_left_s": back_s,
        "release_after_clients_left_s": [r["at_s"] - left_s for r in ended],
    }


def read_after_lease(prefill: Node, decode: Node, connector: str) -> dict[str, Any]:
    body = {"prompt": "The three most visited cities in Europe are", "max_tokens": 24,
            "temperature": 0}  # fmt: skip
    one_node = completion_text(httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120))
    leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    kv = httpx.post(f"{prefill.url}/v1/completions", json=leg, timeout=120).json()
    kv = kv["kv_transfer_params"]
    expired_s = wait_usage_zero(prefill, 120)
    for i in range(8):  # reuse the freed blocks
        other = {"prompt": f"Unrelated text number {i} " * 20, "max_tokens": 1}
        httpx.post(f"{prefill.url}/v1/completions", json=other, timeout=120)
    late = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": kv},
                      timeout=120)  # fmt: skip
    answer = completion_text(late)
    counters = handoffs(kv)["counters"] if "control_url" in kv else {}
    return {"lease_s": expired_s, "correct": answer == one_node, "answer": answer,
            "one_node": one_node, "claims_refused": counters.get("claim_late", 0)}  # fmt: skip


def storm_run(proxy: Node, prefill: Node, decode: Node, storm: Path, logs: Path) -> dict[str, Any]:
    storm.touch()
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: ask(proxy, f"Storm {i}:", 16), range(16)))
    finally:
        storm.unlink()
    up = all(httpx.get(f"{n.url}/health", timeout=5).status_code == 200 for n in (prefill, decode))
    leaks = [n.url for n in (prefill, decode) if not usage_zero_within(n, 5)]
    dropped = sum((logs / f).read_text(errors="replace").count("dropped a late or duplicate")
                  for f in ("kv_producer.log", "kv_consumer.log"))  # fmt: skip
    return {"answered": sum(bool(a) for a in answers), "engines_up": up, "leaks": leaks,
            "signals_dropped": dropped}  # fmt: skip


def decode_killed(proxy: Node, prefill: Node, decode: Node, via_proxy: bool) -> dict[str, Any]:
    """Decode legs queued on a decode node that is then SIGKILLed. Through the proxy, the
    proxy sees each leg fail and releases; sent directly, only the lease frees them."""
    kv = []
    with busy(decode, 32):
        for i in range(5):
            if via_proxy:
                args: tuple[Any, ...] = (proxy, f"Queued {i}", 60)
                threading.Thread(target=gone_after, args=args, daemon=True).start()
            else:
                kv.append(prefill_leg(prefill, f"Queued directly {i}"))
                threading.Thread(target=decode_leg, args=(decode, kv[-1]), daemon=True).start()
        time.sleep(3.0)
        held = kv_cache_usage(prefill.url)
        kill_node(decode)
        back_s = wait_usage_zero(prefill, 120)
    return {"usage_when_killed": held, "freed_after_kill_s": back_s}


def prefill_leg(prefill: Node, prompt: str) -> dict[str, Any]:
    leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{prefill.url}/v1/completions", json=leg, timeout=120).json()
    params: dict[str, Any] = answer["kv_transfer_params"]
    return params


def decode_leg(decode: Node, kv: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):
        body = {"prompt": "x", "max_tokens": 16, "kv_transfer_params": kv}
        httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)


# -- helpers --------------------------------------------------------------------------------


def proxy_for(prefill: Node, decode: Node, *extra: str) -> Node:
    args = ["--prefill", prefill.url, "--decode", decode.url, "--node-api-key", SECRET]
    node = launch([*args, *extra], env={"PDSERVE_LOG_LEVEL": "WARNING"}, command="proxy")
    return wait_healthy(node, 60)


def ask(node: Node, prompt: str, tokens: int, body: dict[str, Any] | None = None) -> str:
    request = {"temperature": 0, **(body or {}), "prompt": prompt, "max_tokens": tokens}
    response = httpx.post(f"{node.url}/v1/completions", json=request, timeout=600)
    return completion_text(response)


def completion_text(response: httpx.Response) -> str:
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def gone_after(node: Node, prompt: str, timeout_s: float) -> None:
    with contextlib.suppress(httpx.HTTPError):
        ask_body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        httpx.post(f"{node.url}/v1/completions", json=ask_body, timeout=timeout_s)


@contextlib.contextmanager
def busy(node: Node, num: int) -> Any:
    """`num` long local requests on `node` (its sequences full) until the block ends."""
    done = threading.Event()

    def run(i: int) -> None:
        body = {"prompt": f"Long story {i}:", "max_tokens": 900, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=600) as response,
        ):
            for _ in response.iter_lines():
                if done.is_set():
                    return

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)
    try:
        yield
    finally:
        done.set()


def wait_usage_zero(node: Node, within_s: float) -> float:
    started = time.monotonic()
    with httpx.Client() as http:
        while kv_cache_usage(node.url, http) > 0:
            if time.monotonic() - started > within_s:
                return float("inf")
            time.sleep(0.005)
    return time.monotonic() - started


def usage_zero_within(node: Node, within_s: float) -> bool:
    return wait_usage_zero(node, within_s) != float("inf")


def releases(prefill: Node) -> list[dict[str, Any]]:
    """PdserveConnector's record of each handoff's end: when, why, and how long until vLLM
    freed its blocks (none for the stock connector)."""
    url = _control_urls.get(prefill.url)
    if url is None:
        return []
    data = httpx.get(f"{url}/kv/handoffs", headers=ADMIN, timeout=5).json()
    return list(data["releases"])


def learn_control_url(prefill: Node) -> None:
    """A prefill leg's params name the endpoint; the leg is released at once."""
    leg = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    kv = httpx.post(f"{prefill.url}/v1/completions", json=leg, timeout=60).json()
    kv = kv["kv_transfer_params"]
    _control_urls[prefill.url] = kv["control_url"]
    body = {"request_ids": [kv["handoff_id"]]}
    httpx.post(f"{kv['control_url']}/v1/abort_requests", json=body, headers=ADMIN, timeout=5)


_control_urls: dict[str, str] = {}


def handoffs(kv: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{kv['control_url']}/kv/handoffs", headers=ADMIN).json()
    return data


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def report(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]

    def row(name: str, cell: Any) -> None:
        rows.append(f"| {name} | " + " | ".join(str(cell(r)) for r in results.values()) + " |")

    row("tokens/s, 32 x 128", lambda r: " / ".join(f"{t:.0f}" for t in r["tok_s"]))
    row("S3 client gone between the legs: release → freed, p50 / p99 / n", lambda r: _ms(r, "s3"))
    row("S3: prefill KV in use until (after the clients left)", lambda r: _s(r, "s3"))
    row("S5 client gone while its decode leg waits: release → freed", lambda r: _ms(r, "s5"))
    row("S5: prefill KV in use until (after the clients left)", lambda r: _s(r, "s5"))
    row("S9 read after the lease, blocks reused: answer correct (claims refused)", _s9)
    row("S8 storm: answered, engines up, leaks, signals dropped", _s8)
    row(
        "S10 decode node killed, legs via the proxy: prefill KV free after",
        lambda r: _kill(r, "s10_proxy"),
    )
    row(
        "S10 decode node killed, legs sent directly (the lease alone)",
        lambda r: _kill(r, "s10_lease"),
    )
    return "\n".join(rows)


def _ms(result: dict[str, Any], key: str) -> str:
    values = result[key]["freed_after_release_s"]
    if not values:
        return "no release"
    return f"{1e3 * statistics.median(values):.1f} / {1e3 * p99(values):.1f} ms / {len(values)}"


def _s(result: dict[str, Any], key: str) -> str:
    return f"{result[key]['usage_zero_after_clients_left_s']:.2f} s"


def _kill(result: dict[str, Any], key: str) -> str:
    return f"{result[key]['freed_after_kill_s']:.2f} s"


def _s9(result: dict[str, Any]) -> str:
    return f"{result['s9']['correct']} ({result['s9']['claims_refused']})"


def _s8(result: dict[str, Any]) -> str:
    if "s8" not in result:
        return "n/a (the seam is PdserveConnector's)"
    s8 = result["s8"]
    return f"{s8['answered']}/16, {s8['engines_up']}, {s8['leaks']}, {s8['signals_dropped']}"


if __name__ == "__main__":
    main()
