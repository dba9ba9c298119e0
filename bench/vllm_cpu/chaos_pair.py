"""`pdserve bench chaos` against a vLLM CPU pair running pdserve's PdserveConnector (issues
32 and 55): starts a vLLM prefill node and a vLLM decode node with the connector, a single
stock vLLM node as the greedy reference, and pdserve's proxy in front of the pair, then runs
the chaos harness at them. It started the nodes, so the harness's process faults apply
inside vLLM too: a vLLM node SIGKILLed with handoffs held or mid-read (S10), a prefill node
restarted while decode legs hold its old incarnation's params (S11), a node SIGTERMed while
serving (S22); each is restarted on its port. Everything is stopped afterwards.

    bench/vllm_cpu/setup.sh
    .venv/bin/python bench/vllm_cpu/chaos_pair.py [--duration-s 300] [--rate 2] [--lease-s 5]

A vLLM node takes a minute or more to start here, so the run is longer than a pdserve
cluster's: the harness's faults come at fixed shares of the duration, one node of a role
down at a time. `--faults burst` alone is the by-URL run of before (no restarts).

Sampled requests go unseeded (`--unseeded`): vLLM CPU 0.32's engine dies on a seeded
request prefilled in chunks, connector or not (docs/vllm.md, Limits). The exit status is
the chaos run's (0: no violation).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdserve.launch import Node, free_port, launch, stop, wait_healthy
from pdserve_bench.chaos.cluster import Cluster, Slot, control_url_of
from pdserve_bench.chaos.run import add_parser, run_on
from pdserve_bench.vllm_nodes import (
    VllmNode,
    kill_node,
    launch_vllm_node,
    stop_vllm_node,
    vllm_unavailable,
)

SECRET = "bench-cluster-secret"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
START_TIMEOUT_S = 600.0


class VllmPair(Cluster):
    """Two vLLM nodes with the connector, a reference node and pdserve's proxy, launched
    here: the harness can kill, stop and restart the two vLLM nodes (the proxy keeps their
    URLs; the prefill node keeps its control endpoint's port)."""

    mode = "a vLLM pair (PdserveConnector) started by bench/vllm_cpu/chaos_pair.py"

    def __init__(self, lease_s: float, logs: Path) -> None:
        super().__init__("", SECRET)
        self.logs = logs
        self.extra: dict[str, Any] = {
            "pdserve_lease_s": lease_s, "pdserve_cluster_secret": SECRET,
            "pdserve_control_port": free_port(),
        }  # fmt: skip
        self.reference: VllmNode | None = None
        self.proxy: Node | None = None

    @property
    def owns_processes(self) -> bool:
        return True

    def start(self) -> None:
        for name, role in (("prefill-1", "prefill"), ("decode-1", "decode")):
            self.slots.append(Slot(name, role, []))
        for slot in self.slots:
            slot.node = self._launch(slot)
            slot.url = slot.node.url
        reference = self.reference = self._launch_logged("reference", None)
        for node in [s.node for s in self.slots] + [reference]:
            assert node is not None
            wait_healthy(node, START_TIMEOUT_S)
        prefill, decode = self.slots
        self.vllm_urls = {prefill.url, decode.url}
        self.control_urls[prefill.url] = control_url_of(prefill.url, self.node_headers)
        self.prefill_urls = [prefill.url]
        self.reference_url = reference.url
        args = ["--prefill", prefill.url, "--decode", decode.url, "--node-api-key", SECRET,
                "--health-interval-s", "0.5"]  # fmt: skip
        self.proxy = launch(args, env={"PDSERVE_LOG_LEVEL": "WARNING"}, command="proxy")
        self.proxy_url = wait_healthy(self.proxy, 60).url
        self.start_sampling()

    def _launch_logged(self, name: str, connector: str | None, port: int | None = None) -> VllmNode:
        with (self.logs / f"{name}.log").open("ab") as output:
            role = ROLES.get(name.split("-")[0], name)
            return launch_vllm_node(role, connector, self.extra, output=output, port=port)

    def _launch(self, slot: Slot) -> VllmNode:
        return self._launch_logged(slot.name, "PdserveConnector", slot.port if slot.url else None)

    # -- faults ------------------------------------------------------------------------

    def kill(self, slot: Slot) -> None:
        """SIGKILL the API server, EngineCore and worker at once, as when the host dies."""
        assert slot.node is not None
        kill_node(slot.node)
        slot.down_since_s = self.now_s()

    def terminate(self, slot: Slot, timeout_s: float = 60.0) -> int:
        """SIGTERM: vLLM shuts down (its in-flight requests end); its exit status (-9:
        it had not exited within `timeout_s` and was killed)."""
        assert slot.node is not None
        slot.down_since_s = self.now_s()
        status = stop_vllm_node(slot.node, timeout_s)
        return -9 if status is None else status

    def restart(self, slot: Slot) -> None:
        slot.node = wait_healthy(self._launch(slot), START_TIMEOUT_S)
        slot.restarts += 1
        slot.down_since_s = None

    def stop(self) -> None:
        super().stop()
        if self.proxy is not None:
            stop(self.proxy)
        for node in [s.node for s in self.slots] + [self.reference]:
            if node is not None:
                stop_vllm_node(node)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--max-inflight", type=int, default=8)
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default="kill,burst,sigterm",
                        help="the harness's fault kinds that apply here")  # fmt: skip
    parser.add_argument("--report", default=None, help="directory for the chaos report")
    args = parser.parse_args()
    missing = vllm_unavailable()
    if missing:
        print(f"chaos_pair: {missing}")
        return 2
    chaos_parser = argparse.ArgumentParser()
    add_parser(chaos_parser.add_subparsers())
    chaos_args = chaos_parser.parse_args([
        "chaos", "--unseeded", "--node-api-key", SECRET, "--lease-s", str(args.lease_s),
        "--duration-s", str(args.duration_s), "--rate", str(args.rate),
        "--max-inflight", str(args.max_inflight), "--seed", str(args.seed),
        "--faults", args.faults, *(["--report", args.report] if args.report else []),
    ])  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="vllm-chaos-"))
    pair = VllmPair(args.lease_s, logs)
    try:
        pair.start()
    except BaseException:
        pair.stop()
        raise
    print(f"vLLM nodes' logs: {logs}")
    return run_on(chaos_args, pair)


if __name__ == "__main__":
    sys.exit(main())
