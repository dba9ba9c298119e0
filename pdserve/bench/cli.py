"""`pdserve bench ...` subcommands."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="offline throughput vs. HF transformers")
    off.add_argument("--model", default="default")
    off.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    off.add_argument("--workload", default="fixed", choices=["fixed", "mixed"])
    off.add_argument("--num-prompts", type=int, default=32)
    off.add_argument("--input-len", type=int, default=32)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--max-num-seqs", type=int, default=256)
    off.add_argument("--hf-batch-size", type=int, default=32)
    off.add_argument("--compare", default="", help="comma-separated peers: hf")
    off.add_argument("--threads", type=int, default=None)
    off.add_argument("--repeat", type=int, default=3, help="alternating runs per system")
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--json", action="store_true", help="also print results as JSON")
    off.set_defaults(func=_offline)


def _offline(args: argparse.Namespace) -> int:
    from pdserve.bench.offline import run

    return run(args)
