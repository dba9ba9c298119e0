"""`pdserve up`: a whole local P/D cluster in one command.

hold --port → launch the prefill and decode nodes (subprocesses, loopback, free ports)
→ wait until every node is healthy → serve the proxy on --port (this process)
→ Ctrl-C / SIGTERM: the proxy stops, then every node gets SIGTERM and drains (SIGKILL
of this process: each node notices its parent gone, `--parent-pid`, and drains too)
With --ask PROMPT: once up, send one chat request through the proxy, print the answer,
and stop (what `make run` does). With --tls: a throwaway cluster CA and certificate (in a
temporary folder, removed at exit) and every hop over HTTPS (`pdserve/tls.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn

from pdserve import logs, tracing
from pdserve.config import ProxyConfig
from pdserve.launch import (
    Node,
    launch,
    sigterm_as_interrupt,
    stop_all,
    wait_healthy,
    was_terminated,
)
from pdserve.node_flags import add_node_args, node_argv
from pdserve.proxy.app import proxy_uvicorn_config
from pdserve.proxy.routing import add_routing_args, routing_options
from pdserve.proxy.state import ProxyState
from pdserve.tls import TLSConfig, make_cluster_certs

logger = logging.getLogger(__name__)

LOCAL_UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}
"""One machine: UCX on loopback only; no InfiniBand module (it can crash at exit where
verbs providers are installed without hardware). Explicit settings in the environment win."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start a local proxy + prefill + decode cluster")
    add_cluster_args(up)
    up.add_argument(
        "--tls",
        action="store_true",
        help="every hop over HTTPS, with a throwaway cluster CA (needs pdserve[tls])",
    )
    up.set_defaults(func=run)


def add_cluster_args(up: argparse.ArgumentParser) -> None:
    """The flags `pdserve up` and `pdserve ray up` share: the proxy's, the nodes', --ask."""
    up.add_argument("--host", default=ProxyConfig.host)
    up.add_argument("--port", type=int, default=ProxyConfig.port)
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    up.add_argument("--api-key", default=None, help="required from clients and between nodes")
    up.add_argument("--config", default=None, help="YAML file of flag values; flags override it")
    up.add_argument("--ask", default=None, help="send this chat message, print the answer, stop")
    up.add_argument("--max-tokens", type=int, default=64, help="for --ask")
    add_routing_args(up)
    up.add_argument(
        "--log-level",
        default=None,
        choices=logs.LEVELS,
        help="this process's and the nodes' (default: PDSERVE_LOG_LEVEL, else "
        "info); debug adds every HTTP client request",
    )
    tracing.add_otlp_arg(up)
    add_node_args(up, launched=True)  # every node flag `serve` takes, from one definition


def node_args(args: argparse.Namespace, role: str) -> list[str]:
    """A node's flags: the node flags given to `up` (`node_argv`), its role, and what the
    cluster shares. Its log level is `--log-level` when given, else warning: the console
    is `up`'s (ready, a node down or back), and a node speaks up only when something is
    wrong."""
    argv = ["--role", role, *node_argv(args)]
    for flag, value in (
        ("--api-key", args.api_key),
        ("--log-level", args.log_level or "warning"),
        ("--otlp-endpoint", args.otlp_endpoint),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    if args.num_prefill < 1 or args.num_decode < 1:
        print("pdserve up: --num-prefill and --num-decode must be >= 1", file=sys.stderr)
        return 2
    env = {**LOCAL_UCX_ENV, **{k: v for k, v in os.environ.items() if k in LOCAL_UCX_ENV}}
    roles = ["prefill"] * args.num_prefill + ["decode"] * args.num_decode
    nodes: list[Node] = []
    try:
        listener = listen(args.host, args.port)
    except OSError as e:
        where = f"{args.host}:{args.port}"
        print(f"pdserve up: cannot listen on {where}: {e.strerror}", file=sys.stderr)
        return 1
    with (
        listener,
        sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="pdserve-tls-") as certs,
    ):
        tls = make_cluster_certs(Path(certs)).config() if args.tls else TLSConfig()
        try:
            for role in roles:
                nodes.append(launch(node_args(args, role), {**env, **node_env()}, tls=tls))
            started_s = time.monotonic()
            header = (
                f"starting {args.num_prefill} prefill + {args.num_decode} decode node(s) "
                f"with model {args.model}"
            )
            progress = Progress(header, len(nodes))
            for i, node in enumerate(nodes):
                wait_healthy(node)
                progress.show(i + 1)
            progress.done(f"ready in {time.monotonic() - started_s:.1f} s")
            listing = ", ".join(f"{r} {n.url}" for r, n in zip(roles, nodes, strict=True))
            print(f"nodes: {listing}", flush=True)
            prefill = [n.url for n, r in zip(nodes, roles, strict=True) if r == "prefill"]
            decode = [n.url for n, r in zip(nodes, roles, strict=True) if r == "decode"]
            code = asyncio.run(serve_proxy(args, prefill, decode, tls, listener))
        except KeyboardInterrupt:
            code = 130
        finally:
            stop_all(nodes)
        # SIGTERM is a stop asked for (systemd, `kill`): 0 once everything stopped; Ctrl-C 130.
        return 0 if code == 130 and was_terminated() else code


def listen(host: str, port: int) -> socket.socket:
    """The proxy's socket, bound before any node starts. A node picks its own ports as free
    ones (`launch.free_port`), and --port is free until the proxy binds it: CI lost a run
    to a node that picked it. Bound first, a busy --port also fails at once, not after the
    nodes have loaded their models."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def node_env() -> dict[str, str]:
    """No loading bars from the nodes (two would share one line): `up` draws one."""
    return {} if logs.debugging() else {"TQDM_DISABLE": "1"}


class Progress:
    """One console line for the cluster's start: rewritten in place on a terminal, written
    once when done otherwise (a log file gets no carriage returns)."""

    def __init__(self, header: str, total: int) -> None:
        self.header, self.total = header, total
        self.tty = sys.stdout.isatty()
        self.show(0)

    def show(self, num_ready: int) -> None:
        if self.tty:
            print(f"\r{self.header}: {num_ready}/{self.total} ready", end="", flush=True)

    def done(self, message: str) -> None:
        print(
            f"\r{self.header}: {message}" if self.tty else f"{self.header}: {message}", flush=True
        )


def proxy_config(
    args: argparse.Namespace, prefill: list[str], decode: list[str], tls: TLSConfig
) -> ProxyConfig:
    """The proxy of a cluster `add_cluster_args` describes, in front of these nodes."""
    return ProxyConfig(
        prefill_urls=tuple(prefill),
        decode_urls=tuple(decode),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        node_api_key=args.api_key,
        model=args.model,
        response_store=args.response_store,
        tls=tls,
        **routing_options(args),
    )


async def serve_proxy(
    args: argparse.Namespace,
    prefill: list[str],
    decode: list[str],
    tls: TLSConfig,
    listener: socket.socket,
) -> int:
    """The proxy in front of the nodes, on `listener` (`listen`), until stopped, or for one
    `--ask`."""
    config = proxy_config(args, prefill, decode, tls)
    server = uvicorn.Server(proxy_uvicorn_config(ProxyState(config)))
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    url = f"{tls.scheme}://{args.host}:{args.port}"
    while not server.started:
        if serving.done():
            return 1  # uvicorn could not start: it said why
        await asyncio.sleep(0.05)
    if args.ask is None:
        print_banner(url, args.api_key, tls.ca_certs)
        await serving
        # Only SIGINT/SIGTERM stop it. uvicorn re-raises the signal once it has stopped,
        # but asyncio.run turns that into KeyboardInterrupt only if this task is still
        # running when the signal lands: say 130 here, whichever comes first.
        return 130 if server.should_exit else 0
    try:
        print(await ask(url, args.api_key, args.ask, args.max_tokens, tls))
        return 0
    finally:
        server.should_exit = True
        await serving


async def ask(url: str, api_key: str | None, message: str, max_tokens: int, tls: TLSConfig) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=300, verify=tls.client_context()) as client:
        response = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def print_banner(url: str, api_key: str | None, ca_certs: str | None) -> None:
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    auth += f" --cacert {ca_certs}" if ca_certs else ""
    question = '{"role": "user", "content": "What is the capital of France?"}'
    print(
        f"\npdserve cluster ready: {url}  (Ctrl-C stops everything)\n\n"
        f"  curl {url}/v1/chat/completions{auth} -H 'content-type: application/json' \\\n"
        f'    -d \'{{"messages": [{question}], "max_tokens": 32}}\'\n',
        flush=True,
    )
