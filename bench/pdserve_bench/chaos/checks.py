"""What a chaos run must hold afterwards, and the node counters the checks read.

    every node's KV pool empty within the lease (plus the sweep's tick) after the load
    no engine died unless killed on purpose
    every completed greedy output equals the reference node's (skipped without one)
    no 5xx (or failed connection) except within FAULT_GRACE_S of a fault
    a partitioned link carried no KV, and KV moved again once it healed; netem slowed it

Each returns a list of violations (empty: it holds).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from pdserve_bench.chaos.cluster import Cluster, Slot

if TYPE_CHECKING:
    from pdserve_bench.chaos.run import Fault
    from pdserve_bench.chaos.workload import RequestRecord

FAULT_GRACE_S = 2.0
"""A client error this close to a fault is that fault's, not a defect."""
RELEASE_BUCKETS = "pdserve_handoff_release_seconds_bucket"
KV_BYTES = "pdserve_kv_transfer_bytes_total"


@dataclass
class NodeCounters:
    """Counters of nodes that restart (and start again from zero): the latest scrape of
    each incarnation of each node, so totals survive restarts and no scrape counts twice.
    Scrape before a node is killed or stopped, or its last counts are lost."""

    latest: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)

    def scrape(self, slots: list[Slot]) -> None:
        for slot in slots:
            if slot.down_since_s is not None:
                continue
            try:
                text = httpx.get(f"{slot.url}/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            values = {}
            for line in text.splitlines():
                if line.startswith((RELEASE_BUCKETS + "{", KV_BYTES)):
                    key, value = line.rsplit(" ", 1)
                    values[key] = float(value)
            self.latest[(slot.name, slot.restarts)] = values

    def total(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for values in self.latest.values():
            for key, value in values.items():
                if key.startswith(prefix):
                    out[key] = out.get(key, 0.0) + value
        return out

    def kv_bytes_read(self) -> float:
        return sum(self.total(KV_BYTES).values())

    def release_histograms(self) -> dict[str, dict[str, float]]:
        """Cumulative bucket counts by release reason, then bucket edge."""
        out: dict[str, dict[str, float]] = {}
        for key, value in self.total(RELEASE_BUCKETS + "{").items():
            labels = key[key.index("{") + 1 : -1].split(",")
            fields = dict(p.split("=", 1) for p in labels)
            reason, le = fields["reason"].strip('"'), fields["le"].strip('"')
            out.setdefault(reason, {})[le] = value
        return out


def check_idle(cluster: Cluster, lease_s: float) -> list[str]:
    """Every node's pool empty within the lease (plus the sweep's tick) after the load."""
    deadline = time.monotonic() + lease_s + 1.0
    pending = list(cluster.slots)
    last: dict[str, Any] = {}
    with httpx.Client(headers=cluster.node_headers, timeout=5) as http:
        while pending and time.monotonic() < deadline:
            for slot in list(pending):
                try:
                    kv = cluster.kv_state(http, slot.url)
                except (httpx.HTTPError, ValueError) as e:
                    last[slot.name] = str(e)
                    continue
                last[slot.name] = kv
                if kv["num_free_blocks"] == kv["num_blocks"] and kv["num_handoffs"] == 0:
                    pending.remove(slot)
            time.sleep(0.05)
    return [f"{s.name} still holds KV after the lease: {last.get(s.name)}" for s in pending]


def check_alive(cluster: Cluster) -> list[str]:
    out = []
    for slot in cluster.slots:
        if slot.node is not None and slot.node.process.poll() is not None:
            out.append(f"{slot.name} exited ({slot.node.process.returncode}) unasked")
            continue
        try:
            health = httpx.get(f"{slot.url}/health", timeout=5).status_code
        except httpx.HTTPError:
            health = 0
        if health != 200:
            out.append(f"{slot.name} is unhealthy ({health}): its engine died")
    return out


def is_greedy_checked(r: RequestRecord) -> bool:
    return r.plan == "complete" and r.greedy and r.status == 200 and r.token_ids is not None


def check_outputs(cluster: Cluster, records: list[RequestRecord]) -> list[str]:
    """Every completed greedy output equals the reference node's for the same request (the
    reference node answers them several at a time)."""
    assert cluster.reference_url is not None
    checked = list(filter(is_greedy_checked, records))
    with httpx.Client(headers=cluster.node_headers, timeout=120) as http:

        def reference(r: RequestRecord) -> list[int]:
            path = "/v1/chat/completions" if r.chat else "/v1/completions"
            expected = http.post(f"{cluster.reference_url}{path}", json={**r.body, "stream": False})
            return list(expected.json()["choices"][0]["token_ids"])

        with ThreadPoolExecutor(8) as pool:
            wanted = list(pool.map(reference, checked))
    out = []
    for r, want in zip(checked, wanted, strict=True):
        assert r.token_ids is not None
        if want == r.token_ids:
            continue
        if want[: len(r.token_ids)] == r.token_ids:
            out.append(f"request {r.index} cut short: 200 with {len(r.token_ids)} of the "
                       f"reference's {len(want)} tokens")  # fmt: skip
        else:
            out.append(f"request {r.index} corrupted: {r.token_ids} != reference {want}")
    return out


def check_errors(faults: list[Fault], records: list[RequestRecord]) -> list[str]:
    """A 5xx (or a failed connection) outside every fault's window is a defect."""
    windows = [(f.start_s - FAULT_GRACE_S, f.end_s + FAULT_GRACE_S) for f in faults]
    out = []
    for r in records:
        failed = r.status >= 500 or (r.status == 0 and r.error and r.plan == "complete")
        if not failed:
            continue
        if any(lo <= r.start_s <= hi or lo <= r.end_s <= hi for lo, hi in windows):
            continue
        out.append(f"request {r.index} ({r.plan}) failed outside any fault: {r.status} "
                   f"{r.error[:200]}")  # fmt: skip
    return out


def check_network_faults(faults: list[Fault], records: list[RequestRecord],
                         kv_bytes_at_end: float) -> list[str]:  # fmt: skip
    """S12 between hosts: nothing was read across the cut link (decode nodes fail closed
    and recompute), and once it was back, KV moved again. Under netem (slow and lossy, not
    cut), KV still moved. Each judged only where enough requests completed to tell."""
    out = []
    for f in faults:
        moved = f.kv_bytes_at_end - f.kv_bytes_at_start
        if f.kind == "netem" and not moved and len(_completed(records, f.start_s, f.end_s)) >= 3:
            out.append("no KV moved while netem degraded the link")
        if f.kind != "partition":
            continue
        if moved:
            out.append(f"{moved:.0f} KV bytes were read across the partitioned link")
        healed = _completed(records, f.end_s + 1.0, float("inf"))
        if len(healed) >= 3 and kv_bytes_at_end <= f.kv_bytes_at_end:
            out.append(f"no KV moved after the partition healed ({len(healed)} requests "
                       f"completed after it)")  # fmt: skip
    return out


def _completed(records: list[RequestRecord], from_s: float, to_s: float) -> list[RequestRecord]:
    """Completed requests that started within [from_s, to_s]."""
    return [r for r in records if r.plan == "complete" and r.status == 200
            and from_s <= r.start_s <= to_s]  # fmt: skip
