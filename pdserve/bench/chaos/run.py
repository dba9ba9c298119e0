"""`pdserve bench chaos`: a local cluster under a seeded storm of requests and faults, then
the checks that make pdserve's promise measurable.

    start the cluster (P prefill, D decode, a reference node, a proxy)
    → load for --duration-s, faults at seeded times: SIGKILL a decode node and a prefill
      node (each restarted), SIGTERM a node (restarted after it drained), a burst that
      exhausts KV blocks
    → stop the load; checks: every node's KV pool empty within the lease; no engine died
      unless killed on purpose; every completed greedy output equals the reference node's;
      no 5xx except around a killed or stopping node; every unauthenticated abort refused
    → report (report.json, report.md, plots) in --report; exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.chaos.cluster import LocalCluster, Slot
from pdserve.bench.chaos.report import write_report
from pdserve.bench.chaos.workload import RequestRecord, Workload, generate_load

logger = logging.getLogger(__name__)

API_KEY = "chaos-key"
FAULT_GRACE_S = 2.0
"""A client error this close to a fault on a node is that fault's, not a defect."""


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("chaos", help="faults and cancellations against a local cluster")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--num-prefill", type=int, default=2)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="directory for report.json/.md and plots")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", help="float32: greedy outputs compare exactly")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument("--lease-s", type=float, default=3.0)
    p.add_argument("--num-kv-blocks", type=int, default=128)
    p.add_argument("--long-prompt-tokens", type=int, default=300)
    p.set_defaults(func=run)


@dataclass
class Fault:
    kind: str
    node: str
    start_s: float
    end_s: float = 0.0
    detail: str = ""


@dataclass
class ChaosRun:
    args: argparse.Namespace
    cluster: LocalCluster
    faults: list[Fault] = field(default_factory=list)
    killed: set[str] = field(default_factory=set)
    release_histograms: dict[str, dict[str, float]] = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per sample otherwise
    node_args = ["--model", args.model, "--dtype", args.dtype, "--api-key", API_KEY,
                 "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "512"]  # fmt: skip
    env = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "PDSERVE_LOG_LEVEL": "WARNING"}
    cluster = LocalCluster(node_args, args.num_prefill, args.num_decode, API_KEY, env)
    chaos = ChaosRun(args, cluster)
    try:
        cluster.start(args.lease_s)
        records, workload = asyncio.run(_load_and_faults(chaos))
        violations = _check(chaos, records, workload)
    finally:
        cluster.stop()
    report = _summary(chaos, records, workload, violations)
    print(_headline(report))
    if args.report:
        write_report(Path(args.report), report, cluster.samples, chaos.faults)
        print(f"report: {args.report}/report.md")
    return 1 if violations else 0


# -- load and faults ------------------------------------------------------------------------


async def _load_and_faults(chaos: ChaosRun) -> tuple[list[RequestRecord], Workload]:
    args, cluster = chaos.args, chaos.cluster
    assert cluster.proxy is not None and cluster.reference is not None
    workload = Workload(cluster.proxy.url, API_KEY, args.seed, _has_chat(cluster.reference.url),
                        args.long_prompt_tokens, cluster.now_s)  # fmt: skip
    rng = random.Random(args.seed)
    d = args.duration_s
    plan = sorted([
        (rng.uniform(0.15, 0.25) * d, "kill", "decode"),
        (rng.uniform(0.35, 0.45) * d, "burst", ""),
        (rng.uniform(0.5, 0.6) * d, "kill", "prefill"),
        (rng.uniform(0.7, 0.8) * d, "sigterm", rng.choice(["prefill", "decode"])),
    ])  # fmt: skip
    prefill_urls = [s.url for s in cluster.slots if s.role == "prefill"]
    bursts = [t for t, kind, _ in plan if kind == "burst"]
    load = asyncio.create_task(generate_load(workload, d, args.rate, args.max_inflight,
                                             prefill_urls, bursts))  # fmt: skip
    for at_s, kind, role in plan:
        await asyncio.sleep(max(0.0, at_s - cluster.now_s()))
        if kind == "burst":
            chaos.faults.append(Fault("burst", "all", cluster.now_s(), cluster.now_s() + 1))
            continue
        slot = rng.choice([s for s in cluster.slots if s.role == role])
        await asyncio.to_thread(_inject, chaos, slot, kind)
    await load
    return workload.records, workload


def _inject(chaos: ChaosRun, slot: Slot, kind: str) -> None:
    cluster = chaos.cluster
    _scrape_releases(chaos)  # a restarted node starts its metrics from zero
    fault = Fault(kind, slot.name, cluster.now_s())
    if kind == "kill":
        cluster.kill(slot)
        chaos.killed.add(slot.name)
        time.sleep(1.0)  # down for a while: the proxy must route around it
    else:
        status = cluster.terminate(slot)
        fault.detail = f"exit status {status}"
    cluster.restart(slot)
    fault.end_s = cluster.now_s()
    chaos.faults.append(fault)
    logger.info("%s of %s: %.1f-%.1f s %s", kind, slot.name, fault.start_s, fault.end_s,
                fault.detail)  # fmt: skip


def _has_chat(url: str) -> bool:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    return response.status_code == 200


def _scrape_releases(chaos: ChaosRun) -> None:
    """Add the prefill nodes' release-latency histograms (bucket counts by reason)."""
    for slot in chaos.cluster.slots:
        if slot.role != "prefill" or slot.down_since_s is not None:
            continue
        try:
            text = httpx.get(f"{slot.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if not line.startswith("pdserve_handoff_release_seconds_bucket{"):
                continue
            labels, value = line.rsplit(" ", 1)
            fields = dict(p.split("=", 1) for p in labels[labels.index("{") + 1 : -1].split(","))
            reason, le = fields["reason"].strip('"'), fields["le"].strip('"')
            hist = chaos.release_histograms.setdefault(reason, {})
            hist[le] = hist.get(le, 0.0) + float(value)


# -- checks -------------------------------------------------------------------------------


def _check(chaos: ChaosRun, records: list[RequestRecord], workload: Workload) -> list[str]:
    violations = _check_idle(chaos) + _check_alive(chaos)
    _scrape_releases(chaos)
    violations += _check_outputs(chaos, records)
    violations += _check_errors(chaos, records)
    if workload.accepted_unauthenticated:
        violations.append(f"{workload.accepted_unauthenticated} unauthenticated aborts accepted")
    return violations


def _check_idle(chaos: ChaosRun) -> list[str]:
    """Every node's pool empty within the lease (plus the sweep's tick) after the load."""
    deadline = time.monotonic() + chaos.args.lease_s + 1.0
    headers = {"Authorization": f"Bearer {API_KEY}"}
    pending = list(chaos.cluster.slots)
    last: dict[str, Any] = {}
    while pending and time.monotonic() < deadline:
        for slot in list(pending):
            try:
                kv = httpx.get(f"{slot.url}/admin/kv", headers=headers, timeout=5).json()
            except httpx.HTTPError as e:
                last[slot.name] = str(e)
                continue
            last[slot.name] = kv
            if kv["num_free_blocks"] == kv["num_blocks"] and kv["num_handoffs"] == 0:
                pending.remove(slot)
        time.sleep(0.05)
    return [f"{s.name} still holds KV after the lease: {last.get(s.name)}" for s in pending]


def _check_alive(chaos: ChaosRun) -> list[str]:
    out = []
    for slot in chaos.cluster.slots:
        assert slot.node is not None
        if slot.node.process.poll() is not None:
            out.append(f"{slot.name} exited ({slot.node.process.returncode}) unasked")
            continue
        try:
            health = httpx.get(f"{slot.url}/health", timeout=5).status_code
        except httpx.HTTPError:
            health = 0
        if health != 200:
            out.append(f"{slot.name} is unhealthy ({health}): its engine died")
    return out


def _check_outputs(chaos: ChaosRun, records: list[RequestRecord]) -> list[str]:
    """Every completed greedy output equals the reference node's for the same request."""
    reference = chaos.cluster.reference
    assert reference is not None
    out = []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(headers=headers, timeout=120) as http:
        for r in records:
            if r.plan != "complete" or not r.greedy or r.status != 200 or r.token_ids is None:
                continue
            path = "/v1/chat/completions" if r.chat else "/v1/completions"
            expected = http.post(f"{reference.url}{path}", json={**r.body, "stream": False})
            want = expected.json()["choices"][0]["token_ids"]
            if want != r.token_ids:
                out.append(f"request {r.index} corrupted: {r.token_ids} != reference {want}")
    return out


def _check_errors(chaos: ChaosRun, records: list[RequestRecord]) -> list[str]:
    """A 5xx (or a failed connection) outside every fault's window is a defect."""
    windows = [(f.start_s - FAULT_GRACE_S, f.end_s + FAULT_GRACE_S) for f in chaos.faults]
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


# -- summary ------------------------------------------------------------------------------


def _summary(chaos: ChaosRun, records: list[RequestRecord], workload: Workload,
             violations: list[str]) -> dict[str, Any]:  # fmt: skip
    outcomes: dict[str, dict[str, int]] = {}
    for r in records:
        outcome = "ok" if r.status == 200 else ("client_left" if r.status == 0 else str(r.status))
        plan = outcomes.setdefault(r.plan, {})
        plan[outcome] = plan.get(outcome, 0) + 1
    greedy_checked = sum(1 for r in records if r.plan == "complete" and r.greedy
                         and r.status == 200 and r.token_ids is not None)  # fmt: skip
    config = {k: v for k, v in vars(chaos.args).items() if k != "func"}
    return {
        "config": config,
        "num_requests": len(records),
        "outcomes": outcomes,
        "faults": [asdict(f) for f in chaos.faults],
        "greedy_outputs_checked": greedy_checked,
        "unauthenticated_aborts_refused": workload.refused_unauthenticated,
        "release_histograms": chaos.release_histograms,
        "violations": violations,
    }


def _headline(report: dict[str, Any]) -> str:
    faults = ", ".join(f"{f['kind']} {f['node']}" for f in report["faults"])
    status = "OK" if not report["violations"] else f"{len(report['violations'])} VIOLATIONS"
    lines = [f"chaos: {report['num_requests']} requests, faults: {faults}; "
             f"{report['greedy_outputs_checked']} greedy outputs checked; "
             f"{report['unauthenticated_aborts_refused']} unauthenticated aborts refused: "
             f"{status}"]  # fmt: skip
    lines += [f"  - {v}" for v in report["violations"][:20]]
    return "\n".join(lines)
