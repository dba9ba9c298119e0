"""`pdserve bench chaos`: a cluster under a seeded storm of requests and faults, then the
checks that make pdserve's promise measurable.

    start a local cluster (P prefill, D decode, a reference node, a proxy; with --netns the
    prefill and decode nodes in two network namespaces), or the same on Ray (--ray: node
    and proxy actors, `pdserve ray up`'s), or target one by URL (--proxy)
    → load for --duration-s, faults at seeded times: SIGKILL a decode node and a prefill
      node (each restarted), SIGTERM a node (restarted after it drained), a burst that
      exhausts KV blocks, with --netns a partition of the node-to-node link (S12) and
      netem latency and loss on it, with --ray a decode node added and later removed
      (drained) while serving. A fault that cannot apply is skipped and reported:
      process faults on a cluster the harness did not start, network faults without
      --netns, scaling without --ray, netem where the kernel lacks it
    → stop the load; checks (`checks.py`); each cancel labelled with the stage it hit
    → report (report.json, report.md, plots) in --report; exit status 1 on any violation,
      77 when --netns cannot create namespaces here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pdserve.launch import NodeError, sigterm_as_interrupt
from pdserve_bench.chaos import checks
from pdserve_bench.chaos.cluster import Cluster, LocalCluster, Slot, bearer
from pdserve_bench.chaos.netns import NamespaceBed, NamespaceUnavailable
from pdserve_bench.chaos.report import headline, summary, write_report
from pdserve_bench.chaos.workload import ReleaseWatcher, RequestRecord, Workload, generate_load

if TYPE_CHECKING:
    from pdserve_bench.chaos.ray_cluster import RayCluster

logger = logging.getLogger(__name__)

API_KEY = "chaos-key"
FAULT_KINDS = ("kill", "burst", "sigterm", "partition", "netem", "scale")
NETEM_SPEC = ("delay", "20ms", "5ms", "loss", "1%")
RELEASE_WATCH_S = 15.0
"""How long a departed request's handoff is watched (past the lease: a leak)."""
EXIT_SKIPPED = 77


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("chaos", help="faults and cancellations against a cluster")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="directory for report.json/.md and plots")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--max-inflight", type=int, default=16)
    p.add_argument("--long-prompt-tokens", type=int, default=300)
    p.add_argument("--faults", default=",".join(FAULT_KINDS),
                   help="comma-separated subset of " + ", ".join(FAULT_KINDS))  # fmt: skip
    p.add_argument("--lease-s", type=float, default=None,
                   help="prefill nodes' lease: set on a local cluster (default 3); for one "
                        "by URL, the lease its nodes use (default 5, serve's)")  # fmt: skip
    local = p.add_argument_group("a local cluster (the default)")
    local.add_argument("--num-prefill", type=int, default=2)
    local.add_argument("--num-decode", type=int, default=2)
    local.add_argument("--model", default="default")
    local.add_argument("--dtype", default="auto",
                       help="auto: the machine's (bf16 where native); the nodes run "
                            "--batch-invariant: greedy outputs compare exactly in any")  # fmt: skip
    local.add_argument("--num-kv-blocks", type=int, default=128)
    local.add_argument("--netns", action="store_true",
                       help="prefill and decode nodes in two network namespaces (needs root): "
                            "KV over UCX TCP, link partitions and netem")  # fmt: skip
    on_ray = p.add_argument_group("the nodes on Ray instead (pip install pdserve[ray])")
    on_ray.add_argument(
        "--ray",
        action="store_true",
        help="node actors placed and restarted by Ray, the proxy an actor too",
    )
    on_ray.add_argument(
        "--ray-address", default=None, help="a running Ray cluster (default: start a local one)"
    )
    on_ray.add_argument(
        "--ray-node-cpus", type=float, default=1.0, help="Ray CPUs each node reserves"
    )
    target = p.add_argument_group("a running cluster, by URL")
    target.add_argument("--proxy", default=None, metavar="URL", help="its proxy (the clients')")
    target.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a prefill node behind it (repeat for each): pdserve's, or "
                             "vLLM's running PdserveConnector")  # fmt: skip
    target.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode node behind it (repeat for each)")  # fmt: skip
    target.add_argument("--reference", default=None, metavar="URL",
                        help="a single node on the same model, to compare greedy outputs "
                             "with (the comparison is skipped without one)")  # fmt: skip
    target.add_argument("--api-key", default=None, help="the proxy's key")
    target.add_argument(
        "--unseeded",
        action="store_true",
        help="sampled requests without a seed (vLLM CPU 0.32's engine dies on a seeded "
        "request whose prompt is prefilled in chunks)",
    )
    target.add_argument(
        "--node-api-key",
        default=None,
        help="the nodes' key (admin views, aborts; on vLLM nodes the connector's cluster "
        "secret); default: --api-key",
    )
    p.set_defaults(func=run)


@dataclass
class Fault:
    kind: str
    node: str
    start_s: float
    end_s: float = 0.0
    detail: str = ""
    kv_bytes_at_start: float = 0.0
    """Network faults: KV bytes read by decode nodes, cumulative, once the fault held."""
    kv_bytes_at_end: float = 0.0


@dataclass
class ChaosRun:
    args: argparse.Namespace
    cluster: Cluster
    lease_s: float = 3.0
    faults: list[Fault] = field(default_factory=list)
    faulting: dict[str, str] = field(default_factory=dict)
    """What is down or changing for a fault (a node's name, a role's scaling) → its role."""
    enabled: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)
    """Fault kinds and checks that did not run, and why."""
    counters: checks.NodeCounters = field(default_factory=checks.NodeCounters)
    departure_stages: dict[str, str] = field(default_factory=dict)
    """X-Request-Id → the proxy's stage when its client left."""


def run(args: argparse.Namespace) -> int:
    with sigterm_as_interrupt():  # SIGTERM stops the local cluster as Ctrl-C does
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per sample otherwise
    problem = _usage_problem(args)
    if problem:
        print(f"bench chaos: {problem}")
        return 2
    started_s = time.monotonic()
    bed = None
    if args.netns:
        try:
            bed = NamespaceBed.create()
        except NamespaceUnavailable as e:
            print(f"bench chaos --netns: skipped: {e}")
            return EXIT_SKIPPED
    try:
        try:
            chaos = _prepare(args, bed)
        except (httpx.HTTPError, NodeError) as e:  # a cluster targeted by URL: not there,
            print(f"bench chaos: cannot use the cluster: {e}")  # or not one it can judge
            return 2
        logger.info("cluster ready after %.1f s", time.monotonic() - started_s)
        return _load_check_report(chaos, bed)
    finally:
        if bed is not None:
            bed.remove()


def run_on(args: argparse.Namespace, cluster: Cluster) -> int:
    """The chaos run against a cluster started by someone else and handed over running
    (`bench/vllm_cpu/chaos_pair.py`'s vLLM nodes): process faults apply where it owns its
    processes. `args` is `bench chaos`'s (its defaults for what the caller leaves out);
    the cluster is stopped at the end."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        chaos = _decide(ChaosRun(args, cluster, lease_s=args.lease_s or 5.0), None)
    except BaseException:
        cluster.stop()
        raise
    return _load_check_report(chaos, None)


def _load_check_report(chaos: ChaosRun, bed: NamespaceBed | None) -> int:
    """Load and faults, then the checks (the cluster stopped after them), then the report;
    the exit status: 1 on any violation."""
    args, started_s = chaos.args, time.monotonic()
    try:
        records, workload = asyncio.run(_load_and_faults(chaos, bed))
        logger.info("load and faults done after %.1f s", time.monotonic() - started_s)
        violations = _check(chaos, records, workload)
        logger.info("checks done after %.1f s", time.monotonic() - started_s)
    finally:
        chaos.cluster.stop()
    report = summary(chaos, records, workload, violations)
    print(headline(report))
    if args.report:
        write_report(Path(args.report), report, chaos.cluster.samples)
        print(f"report: {args.report}/report.md")
    return 1 if violations else 0


def _usage_problem(args: argparse.Namespace) -> str:
    unknown = set(args.faults.split(",")) - set(FAULT_KINDS) - {""}
    if unknown:
        return f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}"
    if args.proxy and (not args.prefill or not args.decode):
        return "--proxy needs the nodes behind it: --prefill URL and --decode URL (each repeatable)"
    if args.proxy and args.netns:
        return "--netns starts a local cluster in namespaces; it does not apply with --proxy"
    if args.ray and (args.proxy or args.netns):
        return "--ray starts the cluster on Ray; it does not apply with --proxy or --netns"
    if not args.proxy and (args.prefill or args.decode or args.reference):
        return "--prefill, --decode and --reference target a running cluster: add --proxy URL"
    return ""


def _own_cluster(
    args: argparse.Namespace, node_args: list[str], env: dict[str, str], bed: NamespaceBed | None
) -> LocalCluster | RayCluster:
    """The cluster the harness starts: processes here, or actors on Ray."""
    if not args.ray:
        return LocalCluster(node_args, args.num_prefill, args.num_decode, API_KEY, env, bed)
    from pdserve_bench.chaos.ray_cluster import RayCluster  # the ray extra

    if args.ray_address:  # nodes on other hosts: KV over their real interfaces
        env = {k: v for k, v in env.items() if k != "UCX_NET_DEVICES"}
    return RayCluster(
        node_args,
        args.num_prefill,
        args.num_decode,
        API_KEY,
        env,
        args.ray_address,
        args.ray_node_cpus,
    )


def _prepare(args: argparse.Namespace, bed: NamespaceBed | None) -> ChaosRun:
    """Start or reach the cluster; decide which faults and checks apply."""
    if args.proxy:
        api_key = args.api_key or ""
        cluster = Cluster.targeted(args.proxy, args.prefill, args.decode, args.reference,
                                   api_key, args.node_api_key or api_key)  # fmt: skip
        chaos = ChaosRun(args, cluster, lease_s=args.lease_s or 5.0)
    else:
        from pdserve_bench.cli import resolve_dtype_name

        args.dtype = resolve_dtype_name(args.dtype)  # the report names what ran
        # --batch-invariant: a request's greedy output then equals the reference node's
        # whatever else the nodes run with it (bf16 included), so a difference is the
        # handoff's fault, not the batch's.
        node_args = ["--model", args.model, "--dtype", args.dtype, "--batch-invariant",
                     "--api-key", API_KEY,
                     "--num-kv-blocks", str(args.num_kv_blocks),
                     "--max-model-len", "512"]  # fmt: skip
        env = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "PDSERVE_LOG_LEVEL": "WARNING"}
        local = _own_cluster(args, node_args, env, bed)
        chaos = ChaosRun(args, local, lease_s=args.lease_s or 3.0)
        try:
            local.start(chaos.lease_s)
        except BaseException:
            local.stop()
            raise
    return _decide(chaos, bed)


def _decide(chaos: ChaosRun, bed: NamespaceBed | None) -> ChaosRun:
    """Which of the faults asked for apply to the cluster, and which checks; the others
    are skipped with the reason."""
    args = chaos.args
    wanted = {k for k in args.faults.split(",") if k}
    if not chaos.cluster.owns_processes:
        reason = "the cluster was targeted by URL: the harness cannot kill or restart its nodes"
        chaos.skipped.update({k: reason for k in ("kill", "sigterm") if k in wanted})
    if bed is None:
        reason = "a network fault needs --netns (prefill and decode nodes in two namespaces)"
        chaos.skipped.update({k: reason for k in ("partition", "netem") if k in wanted})
    elif "netem" in wanted:
        try:
            bed.set_netem(*NETEM_SPEC)
            bed.clear_netem()
        except NamespaceUnavailable as e:
            chaos.skipped["netem"] = str(e)
    if not args.ray and "scale" in wanted:
        chaos.skipped["scale"] = "scaling needs --ray (the controller adds and removes nodes)"
    if chaos.cluster.reference_url is None:
        chaos.skipped["greedy check"] = "no --reference node to compare with"
    chaos.enabled = wanted - set(chaos.skipped)
    return chaos


# -- load and faults ------------------------------------------------------------------------


async def _load_and_faults(
    chaos: ChaosRun, bed: NamespaceBed | None
) -> tuple[list[RequestRecord], Workload]:
    args, cluster = chaos.args, chaos.cluster
    prefill_urls = cluster.prefill_urls  # a live list: Ray restarts change the URLs
    watcher = ReleaseWatcher(prefill_urls, cluster.node_headers, RELEASE_WATCH_S, cluster.now_s,
                             cluster.handoffs_url)  # fmt: skip
    workload = Workload(cluster.proxy_url, cluster.api_key, cluster.node_headers, args.seed,
                        _has_chat(cluster), args.long_prompt_tokens, cluster.now_s,
                        watcher, cluster.admin_url, not args.unseeded)  # fmt: skip
    rng = random.Random(args.seed)
    plan = _plan(chaos, rng)
    bursts = [t for t, kind, _ in plan if kind == "burst"]
    chaos.counters.scrape(cluster.slots)
    load = asyncio.create_task(generate_load(workload, args.duration_s, args.rate,
                                             args.max_inflight, prefill_urls, bursts))  # fmt: skip
    restarts: list[asyncio.Future[None]] = []
    for at_s, kind, role in plan:
        await asyncio.sleep(max(0.0, at_s - cluster.now_s()))
        if kind == "burst":
            chaos.faults.append(Fault("burst", "all", cluster.now_s(), cluster.now_s() + 1))
        elif kind in ("partition", "netem"):
            assert bed is not None
            while chaos.faulting:  # see `_network_fault`
                await asyncio.sleep(0.1)
            await _network_fault(chaos, bed, kind)
        elif kind == "scale":  # takes a while, like a restart
            while role in chaos.faulting.values():
                await asyncio.sleep(0.1)
            chaos.faulting[f"{role} scaling"] = role
            restarts.append(asyncio.ensure_future(asyncio.to_thread(_scale, chaos, role)))
        else:  # a restart takes a while: the next fault does not wait for it
            slot = await _healthy_slot(chaos, role, rng)
            chaos.faulting[slot.name] = role
            restarts.append(asyncio.ensure_future(asyncio.to_thread(_inject, chaos, slot, kind)))
    await load
    await asyncio.gather(*restarts)
    return workload.records, workload


async def _healthy_slot(chaos: ChaosRun, role: str, rng: random.Random) -> Slot:
    """A node of `role`, once none of that role is down for another fault: one node at a
    time per role (the others carry the load meanwhile)."""
    while role in chaos.faulting.values():
        await asyncio.sleep(0.1)
    return rng.choice([s for s in chaos.cluster.slots if s.role == role])


def _plan(chaos: ChaosRun, rng: random.Random) -> list[tuple[float, str, str]]:
    """(time, kind, role) of each enabled fault, drawn from the seed."""
    d = chaos.args.duration_s
    plan = [
        (rng.uniform(0.15, 0.25) * d, "kill", "decode"),
        (rng.uniform(0.35, 0.45) * d, "burst", ""),
        (rng.uniform(0.5, 0.6) * d, "kill", "prefill"),
        (rng.uniform(0.7, 0.8) * d, "sigterm", rng.choice(["prefill", "decode"])),
        (rng.uniform(0.27, 0.33) * d, "partition", ""),
        (rng.uniform(0.62, 0.68) * d, "netem", ""),
        (rng.uniform(0.27, 0.33) * d, "scale", "decode"),  # up one node...
        (rng.uniform(0.85, 0.9) * d, "scale", "decode"),  # ...and back down
    ]  # fmt: skip
    return sorted(p for p in plan if p[1] in chaos.enabled)


def _inject(chaos: ChaosRun, slot: Slot, kind: str) -> None:
    cluster = chaos.cluster
    chaos.counters.scrape(cluster.slots)  # its counts, before they are lost
    fault = Fault(kind, slot.name, cluster.now_s())
    if kind == "kill":
        cluster.kill(slot)
        time.sleep(1.0)  # down for a while: the proxy must route around it
    else:
        status = cluster.terminate(slot)
        fault.detail = f"exit status {status}"
    cluster.restart(slot)
    fault.end_s = cluster.now_s()
    chaos.faults.append(fault)
    del chaos.faulting[slot.name]
    logger.info("%s of %s: %.1f-%.1f s %s", kind, slot.name, fault.start_s, fault.end_s,
                fault.detail)  # fmt: skip


def _scale(chaos: ChaosRun, role: str) -> None:
    """The first scale fault adds a node of `role`, the next takes the cluster back to its
    starting count (the newest node leaves the proxy's pools, then drains)."""
    cluster = chaos.cluster
    start = getattr(chaos.args, f"num_{role}")
    now = sum(s.role == role for s in cluster.slots)
    target = start + 1 if now == start else start
    chaos.counters.scrape(cluster.slots)  # a removed node's counts, before they are lost
    fault = Fault("scale", role, cluster.now_s(), detail=f"{role} {now} -> {target}")
    cluster.scale(role, target)
    fault.end_s = cluster.now_s()
    chaos.faults.append(fault)
    del chaos.faulting[f"{role} scaling"]
    logger.info("scaled %s: %.1f-%.1f s", fault.detail, fault.start_s, fault.end_s)


async def _network_fault(chaos: ChaosRun, bed: NamespaceBed, kind: str) -> None:
    """The node-to-node link cut (partition) or degraded (netem) for a lease and a second:
    long enough that unrenewed handoffs expire. Only while every node is up: a node that
    restarts while its link is down cannot open its NIXL (UCX) context on the down device,
    and its engine never starts (a slow restart on a loaded machine ran into the cut)."""
    cluster = chaos.cluster
    fault = Fault(kind, "prefill-decode link", cluster.now_s())
    if kind == "partition":
        await asyncio.to_thread(bed.set_link, False)
    else:
        await asyncio.to_thread(bed.set_netem, *NETEM_SPEC)
        fault.detail = " ".join(NETEM_SPEC)
    await asyncio.sleep(0.5)  # reads that had ended before the cut reach the counters
    fault.kv_bytes_at_start = await _kv_bytes_read(chaos)
    await asyncio.sleep(chaos.lease_s + 0.5)
    fault.kv_bytes_at_end = await _kv_bytes_read(chaos)
    if kind == "partition":
        await asyncio.to_thread(bed.set_link, True)
    else:
        await asyncio.to_thread(bed.clear_netem)
    fault.end_s = cluster.now_s()
    read_mib = (fault.kv_bytes_at_end - fault.kv_bytes_at_start) / 2**20
    fault.detail = f"{fault.detail}; KV read meanwhile: {read_mib:.2f} MiB".lstrip("; ")
    chaos.faults.append(fault)


async def _kv_bytes_read(chaos: ChaosRun) -> float:
    decode = [s for s in chaos.cluster.slots if s.role == "decode"]
    await asyncio.to_thread(chaos.counters.scrape, decode)
    return chaos.counters.kv_bytes_read()


def _has_chat(cluster: Cluster) -> bool:
    url, key = cluster.reference_url, cluster.node_api_key
    if url is None:
        url, key = cluster.proxy_url, cluster.api_key
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = bearer(key)
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    return response.status_code == 200


# -- after the load -----------------------------------------------------------------------


def _check(chaos: ChaosRun, records: list[RequestRecord], workload: Workload) -> list[str]:
    cluster = chaos.cluster
    violations = checks.check_idle(cluster, chaos.lease_s) + checks.check_alive(cluster)
    chaos.counters.scrape(cluster.slots)
    if cluster.reference_url is not None:
        violations += checks.check_outputs(cluster, records)
    violations += checks.check_errors(chaos.faults, records)
    violations += checks.check_network_faults(chaos.faults, records, chaos.counters.kv_bytes_read())
    if workload.accepted_unauthenticated:
        violations.append(f"{workload.accepted_unauthenticated} unauthenticated aborts accepted")
    chaos.departure_stages = _departure_stages(chaos)
    return violations


def _departure_stages(chaos: ChaosRun) -> dict[str, str]:
    """X-Request-Id → stage, from the proxy's record of the clients that left."""
    cluster = chaos.cluster
    headers = bearer(cluster.api_key)
    try:
        response = httpx.get(f"{cluster.proxy_url}/admin/departures", headers=headers, timeout=10)
        response.raise_for_status()
        rows = response.json()["departures"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        chaos.skipped["cancel stages"] = f"the proxy has no record of departures ({e})"
        return {}
    return {row["request_id"]: row["stage"] for row in rows if row.get("request_id")}
