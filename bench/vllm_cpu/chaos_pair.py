"""`pdserve bench chaos` against a vLLM CPU pair running pdserve's PdserveConnector (issue
32's acceptance): starts a vLLM prefill node and a vLLM decode node with the connector, a
single stock vLLM node as the greedy reference, and pdserve's proxy in front of the pair,
then runs the chaos harness at them by URL; everything is stopped afterwards.

    bench/vllm_cpu/setup.sh
    .venv/bin/python bench/vllm_cpu/chaos_pair.py [--duration-s 60] [--rate 4] [--lease-s 5]

Sampled requests go unseeded (`--unseeded`): vLLM CPU 0.32's engine dies on a seeded
request prefilled in chunks, connector or not (docs/vllm.md, Limits). The exit status is
the chaos run's (0: no violation).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.launch import launch, stop, wait_healthy
from pdserve_bench.vllm_nodes import launch_vllm_node, stop_vllm_node, vllm_unavailable

SECRET = "bench-cluster-secret"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--max-inflight", type=int, default=8)
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", default=None, help="directory for the chaos report")
    args = parser.parse_args()
    missing = vllm_unavailable()
    if missing:
        print(f"chaos_pair: {missing}")
        return 2
    logs = Path(tempfile.mkdtemp(prefix="vllm-chaos-"))
    extra = {"pdserve_lease_s": args.lease_s, "pdserve_cluster_secret": SECRET}
    nodes = []
    for role, connector in (("kv_producer", "PdserveConnector"),
                            ("kv_consumer", "PdserveConnector"), ("reference", None)):  # fmt: skip
        with (logs / f"{role}.log").open("wb") as output:
            nodes.append(launch_vllm_node(role, connector, extra, output=output))
    proxy = None
    try:
        prefill, decode, reference = (wait_healthy(n, 600) for n in nodes)
        proxy_args = ["--prefill", prefill.url, "--decode", decode.url, "--node-api-key", SECRET]
        proxy = launch(proxy_args, env={"PDSERVE_LOG_LEVEL": "WARNING"}, command="proxy")
        wait_healthy(proxy, 60)
        command = [
            sys.executable, "-m", "pdserve.cli", "bench", "chaos", "--proxy", proxy.url,
            "--prefill", prefill.url, "--decode", decode.url, "--reference", reference.url,
            "--node-api-key", SECRET, "--lease-s", str(args.lease_s), "--unseeded",
            "--duration-s", str(args.duration_s), "--rate", str(args.rate),
            "--max-inflight", str(args.max_inflight), "--seed", str(args.seed),
            *(["--report", args.report] if args.report else []),
        ]  # fmt: skip
        status = subprocess.run(command).returncode
        print(f"vLLM nodes' logs: {logs}")
        return status
    finally:
        if proxy is not None:
            stop(proxy)
        for node in nodes:
            stop_vllm_node(node)


if __name__ == "__main__":
    sys.exit(main())
