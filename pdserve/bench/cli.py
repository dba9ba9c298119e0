"""`pdserve bench ...`: `serve` (load on a running OpenAI-compatible server, like `vllm
bench serve`) ships with pdserve; the harnesses (offline, pd, proxy, chaos, kernels,
accuracy, routing, serve --compare) and their peers' drivers are the `pdserve-bench`
distribution in the repository's `bench/` folder (`pip install -e bench`; `make setup`
does), added here when it is installed.

A distribution adds commands through the entry point group `pdserve.bench` (a module with
`add_parsers(bench_subparsers)` and `serve_compare(args)`): pdserve never names it, so the
benchmarks import pdserve and never the reverse (tests/test_layers.py)."""

from __future__ import annotations

import argparse
from functools import cache
from importlib.metadata import entry_points
from typing import Any

DTYPES = ["auto", "bfloat16", "float32"]
HARNESSES = ("offline", "pd", "proxy", "chaos", "kernels", "accuracy", "routing")
NOT_INSTALLED = (
    "pdserve bench {name}: needs the pdserve-bench distribution, the repository's bench/ "
    "folder: pip install -e bench (make setup installs it)"
)


@cache
def harnesses() -> Any | None:
    """The installed harnesses' module (entry point group `pdserve.bench`), or None."""
    found = entry_points(group="pdserve.bench", name="harnesses")
    return next(iter(found)).load() if found else None


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    srv = bench_sub.add_parser("serve", help="online load on an OpenAI-compatible server")
    srv.add_argument("--url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    srv.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    srv.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    srv.add_argument(
        "--endpoint", default="completions", choices=["completions", "chat", "responses"]
    )
    srv.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests end at EOS (needed for --endpoint responses, which has no "
        "ignore_eos; pass it to the chat run compared with it too)",
    )
    srv.add_argument("--concurrency", type=int, required=True, help="requests in flight")
    srv.add_argument("--num-prompts", type=int, required=True)
    srv.add_argument("--input-len", type=int, required=True, help="prompt tokens")
    srv.add_argument("--output-len", type=int, required=True, help="max_tokens (ignore_eos)")
    srv.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson req/s")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--timeout-s", type=float, default=600.0, help="per connect/read")
    srv.add_argument("--json", action="store_true", help="also print results as JSON")
    cmp = srv.add_argument_group(
        "--compare: start each system here in turn, instead of --url (needs pdserve-bench)"
    )
    cmp.add_argument("--compare", default=None, help="systems to start and load: pdserve,vllm")
    cmp.add_argument("--compare-model", default="default", help="the model both systems load")
    cmp.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: pdserve's pick here")
    cmp.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="for each system")
    cmp.add_argument("--vllm-threads-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    srv.set_defaults(func=_serve)

    plugin = harnesses()
    if plugin is not None:
        plugin.add_parsers(bench_sub)
        return
    for name in HARNESSES:  # named, so a user learns what to install instead of "invalid choice"
        harness = bench_sub.add_parser(
            name,
            help="(needs pdserve-bench: pip install -e bench)",
            add_help=False,
            prefix_chars="\0",  # no options: whatever follows, the answer is what to install
        )
        harness.add_argument("args", nargs="*")
        harness.set_defaults(func=_not_installed(name))


def _not_installed(name: str) -> Any:
    def refuse(args: argparse.Namespace) -> int:
        raise SystemExit(NOT_INSTALLED.format(name=name))

    return refuse


def _serve(args: argparse.Namespace) -> int:
    if (args.url is None) == (args.compare is None):
        raise SystemExit("pdserve bench serve: give --url (a running server) or --compare")
    if args.compare:
        plugin = harnesses()
        if plugin is None:
            raise SystemExit(NOT_INSTALLED.format(name="serve --compare"))
        return int(plugin.serve_compare(args))
    from pdserve.bench.serve_report import run

    return run(args)
