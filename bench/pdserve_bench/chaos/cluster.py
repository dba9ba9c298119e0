"""The chaos harness's cluster: prefill and decode nodes, a reference node and a proxy, and
a sampler of the nodes' KV pools.

Three kinds. A `LocalCluster` is launched by the harness, so it can kill, stop and restart
nodes; with a `NamespaceBed` its prefill and decode nodes run in two network namespaces
(two hosts on one machine) and the link between them can be cut or degraded. A
`RayCluster` (`ray_cluster.py`) is placed and restarted by Ray, and can also be scaled. A
cluster targeted by URL (`Cluster.targeted`) belongs to someone else: the harness only
sends requests and reads `/admin/kv`. Its nodes may be vLLM nodes running pdserve's
`PdserveConnector` (docs/vllm.md): their KV pool is read from vLLM's metrics and their
handoffs from the connector's control endpoint, which also takes their aborts.

Life of a local node slot: launched → healthy → (SIGKILL: the whole node, API and engine
processes, as when a machine dies | SIGTERM: it drains and exits) → restarted on the same
port with the same flags → healthy again. The proxy keeps the slot's URL throughout.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.launch import Node, NodeError, kill, launch, stop, stop_all, wait_healthy
from pdserve_bench.chaos.netns import NamespaceBed


def bearer(key: str) -> dict[str, str]:
    """The Authorization header for `key`; none for no key (a node or proxy without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class Slot:
    name: str
    role: str
    args: list[str]
    url: str = ""
    node: Node | None = None
    """The process, when the harness launched it."""
    restarts: int = 0
    down_since_s: float | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass
class Sample:
    t_s: float
    node: str
    num_used: int
    num_held: int
    num_blocks: int


class Cluster:
    """Nodes the harness observes: their URLs, the keys, a clock, KV samples."""

    mode = "cluster targeted by URL"
    """What the report calls it."""
    launched_here = False
    """Started by `bench chaos` from its own flags (`--num-prefill`, `--model`, ...)."""

    def __init__(self, api_key: str, node_api_key: str) -> None:
        self.api_key = api_key
        """What clients send to the proxy."""
        self.node_api_key = node_api_key
        """The nodes' key: admin views, aborts, legs sent straight to a node."""
        self.slots: list[Slot] = []
        self.proxy_url = ""
        self.reference_url: str | None = None
        """A single node on the same model, for the greedy comparison."""
        self.prefill_urls: list[str] = []
        """Where the workload sends its direct prefill legs (updated in place when a
        node's URL changes)."""
        self.samples: list[Sample] = []
        self.vllm_urls: set[str] = set()
        """Nodes that are vLLM's OpenAI servers, not pdserve nodes."""
        self.control_urls: dict[str, str] = {}
        """A vLLM prefill node's URL → its connector's control endpoint."""
        self._stop_sampling = threading.Event()
        self._started_s = time.monotonic()

    @property
    def owns_processes(self) -> bool:
        return False

    @property
    def node_headers(self) -> dict[str, str]:
        return bearer(self.node_api_key)

    def admin_url(self, url: str) -> str:
        """Where the node at `url` takes aborts: itself, or its connector's endpoint."""
        return self.control_urls.get(url, url)

    def handoffs_url(self, url: str) -> str:
        """The node's list of live handoffs (`handoffs`, each with `client_request_id`)."""
        control = self.control_urls.get(url)
        return f"{control}/kv/handoffs" if control else f"{url}/admin/kv"

    def kv_state(self, http: httpx.Client, url: str) -> dict[str, Any]:
        """The node's KV pool and handoffs in `/admin/kv`'s shape."""
        if url not in self.vllm_urls:
            return dict(http.get(f"{url}/admin/kv").json())
        has_handoffs = url in self.control_urls  # a prefill node: its connector lists them
        handoffs = http.get(self.handoffs_url(url)).json() if has_handoffs else {}
        num_blocks, usage = vllm_kv_pool(http.get(f"{url}/metrics").text)
        return {
            "num_blocks": num_blocks,
            "num_free_blocks": num_blocks - round(usage * num_blocks),
            "num_held_blocks": handoffs.get("num_held_blocks", 0),
            "num_handoffs": handoffs.get("num_handoffs", 0),
            "handoffs": handoffs.get("handoffs", []),
        }

    @classmethod
    def targeted(
        cls, proxy_url: str, prefill_urls: list[str], decode_urls: list[str],
        reference_url: str | None, api_key: str, node_api_key: str,
    ) -> Cluster:  # fmt: skip
        """A running cluster, by URL; raises `httpx.HTTPError` if a node cannot be reached."""
        cluster = cls(api_key, node_api_key)
        for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
            for i, url in enumerate(urls, 1):
                cluster.slots.append(Slot(f"{role}-{i}", role, [], url.rstrip("/")))
        cluster.proxy_url = proxy_url.rstrip("/")
        cluster.prefill_urls = [s.url for s in cluster.slots if s.role == "prefill"]
        cluster.reference_url = reference_url.rstrip("/") if reference_url else None
        for url in [s.url for s in cluster.slots] + [cluster.proxy_url]:
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
        for slot in cluster.slots:
            # pdserve's nodes serve vLLM's metric names too; only vLLM lacks /admin/kv.
            admin = httpx.get(f"{slot.url}/admin/kv", headers=cluster.node_headers, timeout=10)
            if admin.status_code == 404:
                cluster.vllm_urls.add(slot.url)
                if slot.role == "prefill":
                    cluster.control_urls[slot.url] = control_url_of(slot.url, cluster.node_headers)
        cluster.start_sampling()
        return cluster

    def start_sampling(self) -> None:
        self._started_s = time.monotonic()
        threading.Thread(target=self._sample_loop, daemon=True).start()

    def now_s(self) -> float:
        return time.monotonic() - self._started_s

    def _sample_loop(self) -> None:
        with httpx.Client(headers=self.node_headers, timeout=2.0) as http:
            while not self._stop_sampling.wait(0.1):
                for slot in list(self.slots):  # a list another thread may replace
                    try:
                        kv = self.kv_state(http, slot.url)
                    except (httpx.HTTPError, ValueError):
                        continue  # down or restarting
                    total, held = kv["num_blocks"], kv["num_held_blocks"]
                    used = total - kv["num_free_blocks"]
                    self.samples.append(Sample(self.now_s(), slot.name, used, held, total))

    # -- faults: on a cluster the harness runs (`owns_processes`) --------------------------

    def kill(self, slot: Slot) -> None:
        """SIGKILL the whole node, as when its machine dies."""
        raise NotImplementedError("the cluster was targeted by URL")

    def terminate(self, slot: Slot, timeout_s: float = 60.0) -> int:
        """SIGTERM: the node drains and exits; returns its exit status."""
        raise NotImplementedError("the cluster was targeted by URL")

    def restart(self, slot: Slot) -> None:
        """Returns once the slot's node serves again."""
        raise NotImplementedError("the cluster was targeted by URL")

    def scale(self, role: str, count: int) -> None:
        """`count` nodes of `role` from now on; returns once they serve."""
        raise NotImplementedError("only a cluster on Ray scales (--ray)")

    def stop(self) -> None:
        self._stop_sampling.set()


def vllm_kv_pool(metrics: str) -> tuple[int, float]:
    """A vLLM node's KV blocks and the share in use, from its Prometheus text: the blocks
    from `vllm:cache_config_info` (less the null block, never free), the share from
    `vllm:kv_cache_usage_perc` (0 exactly when nothing is held or running)."""
    num_blocks = usage = None
    for line in metrics.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            usage = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:cache_config_info{"):
            found = re.search(r'num_gpu_blocks="(\d+)"', line)
            num_blocks = int(found.group(1)) - 1 if found else None
    if num_blocks is None or usage is None:
        raise ValueError("no vllm:kv_cache_usage_perc or num_gpu_blocks in vLLM's metrics")
    return num_blocks, usage


def control_url_of(url: str, headers: dict[str, str]) -> str:
    """A vLLM prefill node's control endpoint, as the proxy learns it: from a prefill
    answer's `kv_transfer_params` (a one-token leg, released at once)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    answer.raise_for_status()
    kv = answer.json().get("kv_transfer_params") or {}
    if not isinstance(kv.get("control_url"), str):
        raise NodeError(
            f"{url} is a vLLM node without pdserve's PdserveConnector (docs/vllm.md): nothing "
            "there releases a handoff or lists the held ones, so the chaos checks cannot run"
        )
    control = str(kv["control_url"])
    release = {
        "request_ids": [kv.get("remote_request_id")],
        "release_token": kv.get("release_token"),
    }
    httpx.post(f"{control}/v1/abort_requests", json=release, timeout=10)
    return control


class LocalCluster(Cluster):
    """P prefill and D decode nodes, a reference node and a proxy, launched here (in
    `bed`'s namespaces when given; the proxy and the reference node stay in this one)."""

    mode = "local cluster"
    launched_here = True

    def __init__(
        self, node_args: list[str], num_prefill: int, num_decode: int, api_key: str,
        env: dict[str, str] | None = None, bed: NamespaceBed | None = None,
    ) -> None:  # fmt: skip
        super().__init__(api_key, api_key)
        self.node_args = node_args
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.env = env or {}
        self.bed = bed
        self._processes: list[Node] = []
        """The proxy and the reference node."""

    @property
    def owns_processes(self) -> bool:
        return True

    def start(self, lease_s: float) -> None:
        """Everything launched at once (starting is mostly imports and loading); ready when
        every node is healthy and the proxy sees them all up."""
        roles = ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        counts = {"prefill": 0, "decode": 0}
        for role in roles:
            counts[role] += 1
            extra = ["--lease-s", str(lease_s)] if role == "prefill" else []
            self.slots.append(Slot(f"{role}-{counts[role]}", role, ["--role", role, *extra]))
        for slot in self.slots:
            slot.node = self._launch(slot)
            slot.url = slot.node.url
        self.prefill_urls = [s.url for s in self.slots if s.role == "prefill"]
        reference = launch(self.node_args, self.env)
        model = self.node_args[self.node_args.index("--model") + 1]  # the proxy's tokenizer
        proxy_args = ["--api-key", self.api_key, "--health-interval-s", "0.2", "--model", model]
        for slot in self.slots:
            proxy_args += [f"--{slot.role}", slot.url]
        proxy = launch(proxy_args, self.env, command="proxy")
        self._processes += [reference, proxy]
        for node in [s.node for s in self.slots] + self._processes:
            assert node is not None
            wait_healthy(node)
        self.reference_url, self.proxy_url = reference.url, proxy.url
        self._wait_proxy_sees_all(60.0)
        self.start_sampling()

    def _wait_proxy_sees_all(self, timeout_s: float) -> None:
        want = {"num_prefill_up": self.num_prefill, "num_decode_up": self.num_decode}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = httpx.get(f"{self.proxy_url}/health", timeout=5).json()
            if all(health.get(k) == v for k, v in want.items()):
                return
            time.sleep(0.1)
        raise NodeError(f"the proxy does not see every node up: {health}")

    def _launch(self, slot: Slot, port: int | None = None) -> Node:
        args = [*self.node_args, *slot.args]
        if self.bed is not None:
            return self.bed.launch_in(slot.role, args, self.env, port)
        return launch(args, self.env, port=port)

    # -- faults --------------------------------------------------------------------------

    def kill(self, slot: Slot) -> None:
        """SIGKILL the whole node: its API process and its engine process."""
        assert slot.node is not None
        kill(slot.node)
        slot.down_since_s = self.now_s()

    def terminate(self, slot: Slot, timeout_s: float = 60.0) -> int:
        """SIGTERM: the node drains and exits; returns its exit status."""
        assert slot.node is not None
        slot.down_since_s = self.now_s()
        return stop(slot.node, timeout_s)

    def restart(self, slot: Slot) -> None:
        slot.node = wait_healthy(self._launch(slot, slot.port))
        slot.restarts += 1
        slot.down_since_s = None

    def stop(self) -> None:
        """SIGTERM to every process at once (each drains), then wait for all."""
        super().stop()
        stop_all(self._processes + [s.node for s in self.slots if s.node is not None], 30)
