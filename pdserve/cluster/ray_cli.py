"""`pdserve ray up | scale | status`: the cluster of `pdserve up`, placed by Ray.

pdserve ray up [--address ADDR] [--num-prefill N] [--num-decode M] [--prefill-cpus C]
               [--decode-gpus G] … [--ask MSG]
    join the Ray cluster at ADDR (default: start a local one), start the controller and
    the node actors (`ray_nodes.py`), wait until every node is healthy, then serve the
    proxy here, its pools following the controller's membership. Ctrl-C / SIGTERM:
    the proxy stops, the controller and every node actor with it (they are owned by
    this driver), and each node drains.
pdserve ray scale --prefill N --decode M [--address auto]
    change a running cluster's counts; a removed node leaves the proxy's pools, then
    drains.
pdserve ray status [--address auto]
    the nodes: name (role-k), URL, Ray node, alive, restarted, KV use and handoffs held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.cluster.autoscale import AutoscaleConfig
from pdserve.launch import sigterm_as_interrupt
from pdserve.proxy.up import add_cluster_args, ask, node_args, print_banner, proxy_config
from pdserve.tls import TLSConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    ray_parser = sub.add_parser("ray", help="a P/D cluster on Ray (pip install pdserve[ray])")
    ray_sub = ray_parser.add_subparsers(dest="ray_command", required=True)

    up = ray_sub.add_parser("up", help="start the cluster on Ray and serve its proxy here")
    up.add_argument("--address", default=None, help="a Ray cluster (default: start one)")
    add_name_arg(up)
    add_cluster_args(up)
    for role in ("prefill", "decode"):
        up.add_argument(f"--{role}-cpus", type=float, default=1.0, help="Ray CPUs per node")
        up.add_argument(f"--{role}-gpus", type=float, default=0.0, help="Ray GPUs per node")
    up.add_argument(
        "--tls",
        action="store_true",
        help="every HTTP hop over TLS: the controller keeps a cluster CA and issues each node "
        "a certificate for its Ray node's IP (needs pdserve[tls])",
    )
    scaling = up.add_argument_group("autoscaling (pdserve/cluster/autoscale.py)")
    scaling.add_argument(
        "--autoscale", action="store_true", help="each role's count follows its nodes' metrics"
    )
    defaults = AutoscaleConfig()
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            scaling.add_argument(
                f"--{bound}-{role}", type=int, default=getattr(defaults, f"{bound}_{role}")
            )
    scaling.add_argument("--autoscale-interval-s", type=float, default=defaults.interval_s)
    scaling.add_argument("--autoscale-cooldown-s", type=float, default=defaults.cooldown_s)
    up.set_defaults(func=run_up)

    scale = ray_sub.add_parser("scale", help="change a running cluster's node counts")
    scale.add_argument("--address", default="auto")
    add_name_arg(scale)
    scale.add_argument("--prefill", type=int, default=None)
    scale.add_argument("--decode", type=int, default=None)
    scale.set_defaults(func=run_scale)

    status = ray_sub.add_parser("status", help="the nodes of a running cluster")
    status.add_argument("--address", default="auto")
    add_name_arg(status)
    status.add_argument("--api-key", default=None, help="the nodes' key, for KV use")
    status.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    status.set_defaults(func=run_status)


def add_name_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster-name",
        default="pdserve",
        help="which pdserve cluster on the Ray cluster (its Ray namespace)",
    )


def run_up(args: argparse.Namespace) -> int:
    from pdserve.cluster import ray_nodes

    if args.num_prefill < 1 or args.num_decode < 1:
        print("pdserve ray up: --num-prefill and --num-decode must be >= 1", file=sys.stderr)
        return 2
    autoscale = autoscale_options(args) if args.autoscale else None  # bad bounds: refused now
    with sigterm_as_interrupt():
        try:
            ray_nodes.connect(args.address, args.cluster_name)
            specs = {
                role: ray_nodes.RoleSpec(
                    tuple(node_args(args, role)),
                    num_cpus=getattr(args, f"{role}_cpus"),
                    num_gpus=getattr(args, f"{role}_gpus"),
                    tls=args.tls,
                )
                for role in ("prefill", "decode")
            }
            controller = ray_nodes.start_controller(specs, args.tls)
            counts = {"prefill": args.num_prefill, "decode": args.num_decode}
            print(f"starting {counts} node(s) on Ray with model {args.model} ...", flush=True)
            for role, n in counts.items():
                controller.scale.remote(role, n)
            ray_nodes.wait_members(controller, counts)
            if autoscale is not None:
                controller.start_autoscaling.remote(autoscale)
            import ray

            members = ray.get(controller.members.remote())
            print(f"nodes: prefill {members['prefill']}, decode {members['decode']}", flush=True)
            config = proxy_config(args, members["prefill"], members["decode"], TLSConfig())
            proxy = ray_nodes.start_proxy(config, controller, args.tls)
            url = ray.get(proxy.info.remote())["url"]  # serving
            client = _client_tls(controller) if args.tls else TLSConfig()
            if args.ask is not None:
                print(asyncio.run(ask(url, args.api_key, args.ask, args.max_tokens, client)))
                return 0
            print_banner(url, args.api_key, client.ca_certs)
            while True:  # the actors serve; Ctrl-C / SIGTERM ends them with this driver
                time.sleep(3600)
        except KeyboardInterrupt:
            return 130
        finally:
            _shutdown()


def _client_tls(controller: Any) -> TLSConfig:
    """A client's side of `ray up --tls`: the cluster CA's certificate, in a file."""
    import ray

    path = Path(tempfile.mkdtemp(prefix="pdserve-ca-")) / "ca.pem"
    path.write_bytes(ray.get(controller.ca_pem.remote()))
    return TLSConfig(ca_certs=str(path))


def autoscale_options(args: argparse.Namespace) -> AutoscaleConfig:
    return AutoscaleConfig(
        min_prefill=args.min_prefill,
        max_prefill=args.max_prefill,
        min_decode=args.min_decode,
        max_decode=args.max_decode,
        interval_s=args.autoscale_interval_s,
        cooldown_s=args.autoscale_cooldown_s,
    )


def _shutdown() -> None:
    """Ray ends the controller and the node actors this driver owns; each node process
    sees its actor gone and drains (`--parent-pid`)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def run_scale(args: argparse.Namespace) -> int:
    import ray

    from pdserve.cluster import ray_nodes

    ray_nodes.connect(args.address, args.cluster_name)
    controller = ray_nodes.find_controller()
    counts: dict[str, int] = {}
    for role in ("prefill", "decode"):
        n = getattr(args, role)
        if n is not None:
            counts = ray.get(controller.scale.remote(role, n))
    print(f"nodes: {counts}" if counts else "nothing to change (--prefill N / --decode M)")
    return 0


def run_status(args: argparse.Namespace) -> int:
    import ray

    from pdserve.cluster import ray_nodes

    ray_nodes.connect(args.address, args.cluster_name)
    rows = ray_nodes.status_rows()
    tls = any(str(row.get("url")).startswith("https") for row in rows)
    verify: ssl.SSLContext | bool = True
    if tls:  # the cluster CA in memory: nothing left on disk by a status call
        ca_pem = ray.get(ray_nodes.find_controller().ca_pem.remote()).decode()
        verify = ssl.create_default_context(cadata=ca_pem)
    for row in rows:
        if row.get("alive") and row["role"] != "proxy":
            row.update(_kv(row.get("url"), args.api_key, verify))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'node':10} {'url':28} {'ray node':14} {'alive':6} {'restarted':10} "
          f"{'kv use':7} {'held':5}")  # fmt: skip
    for row in rows:
        name = row.get("name", row["role"])
        print(f"{name:10} {row.get('url') or '-':28} {str(row.get('ray_node'))[:12]:14} "
              f"{row.get('alive')!s:6} {row.get('restarted')!s:10} "
              f"{row.get('kv_use', '-')!s:7} {row.get('num_held_blocks', '-')!s:5}")  # fmt: skip
    return 0


def _kv(url: str | None, api_key: str | None, verify: ssl.SSLContext | bool) -> dict[str, Any]:
    """A node's KV use and held blocks (`/admin/kv`), or {} when it does not answer."""
    if url is None:
        return {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(f"{url}/admin/kv", headers=headers, timeout=2, verify=verify).json()
        used = 1 - data["num_free_blocks"] / max(data["num_blocks"], 1)
        return {"kv_use": f"{used:.0%}", "num_held_blocks": data["num_held_blocks"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
