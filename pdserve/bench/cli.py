"""`pdserve bench ...` subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.config import KV_CACHE_DTYPES, QUANTIZATIONS

DTYPES = ["auto", "bfloat16", "float32"]


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="offline throughput vs. HF transformers")
    off.add_argument("--model", default="default")
    off.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="auto: what pdserve picks on this CPU"
    )
    off.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="how pdserve keeps the weights (auto: a GGUF's blocks in float32 on the kernels)",
    )
    off.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="pdserve's KV cache (auto: the model's dtype; int8: 8-bit with scales)",
    )
    off.add_argument("--workload", default="fixed", choices=["fixed", "mixed"])
    off.add_argument("--num-prompts", type=int, default=32)
    off.add_argument("--input-len", type=int, default=32)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--max-num-seqs", type=int, default=256)
    off.add_argument(
        "--kv-cache-memory-mib",
        type=int,
        default=None,
        help="the KV cache's bytes for each system (pdserve, vLLM), the same whatever its "
        "dtype: where memory bounds the batch (default: room for every request at once)",
    )
    off.add_argument("--hf-batch-size", type=int, default=32)
    off.add_argument(
        "--compare",
        default="",
        help="comma-separated peers: hf, vllm, llamacpp (the same GGUF: llama-server "
        "--parallel N for N prompts, where bench/llamacpp/setup_server.sh built it, else one "
        "request at a time), torch (pdserve on plain PyTorch ops), dense (pdserve, weights "
        "dequantized), kv-int8 (pdserve with the 8-bit KV cache)",
    )
    off.add_argument("--threads", type=int, default=None)
    off.add_argument(
        "--vllm-threads-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND for --compare vllm (auto: one core left to its scheduler)",
    )
    off.add_argument("--repeat", type=int, default=3, help="alternating runs per system")
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--json", action="store_true", help="also print results as JSON")
    off.set_defaults(func=_offline)

    srv = bench_sub.add_parser("serve", help="online load on an OpenAI-compatible server")
    srv.add_argument("--url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    srv.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    srv.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    srv.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    srv.add_argument("--concurrency", type=int, required=True, help="requests in flight")
    srv.add_argument("--num-prompts", type=int, required=True)
    srv.add_argument("--input-len", type=int, required=True, help="prompt tokens")
    srv.add_argument("--output-len", type=int, required=True, help="max_tokens (ignore_eos)")
    srv.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson req/s")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--timeout-s", type=float, default=600.0, help="per connect/read")
    srv.add_argument("--json", action="store_true", help="also print results as JSON")
    cmp = srv.add_argument_group("--compare: start each system here in turn, instead of --url")
    cmp.add_argument("--compare", default=None, help="systems to start and load: pdserve,vllm")
    cmp.add_argument("--compare-model", default="default", help="the model both systems load")
    cmp.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: pdserve's pick here")
    cmp.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="for each system")
    cmp.add_argument("--vllm-threads-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    srv.set_defaults(func=_serve)

    from pdserve.bench.accuracy import add_parser as add_accuracy_parser
    from pdserve.bench.chaos.run import add_parser as add_chaos_parser
    from pdserve.bench.kernels import add_parser as add_kernels_parser
    from pdserve.bench.pd import add_parser as add_pd_parser
    from pdserve.bench.proxy import add_parser as add_proxy_parser
    from pdserve.bench.routing import add_parser as add_routing_parser

    add_pd_parser(bench_sub)
    add_proxy_parser(bench_sub)
    add_chaos_parser(bench_sub)
    add_kernels_parser(bench_sub)
    add_accuracy_parser(bench_sub)
    add_routing_parser(bench_sub)


def resolve_dtype_name(name: str) -> str:
    """`auto` -> the dtype pdserve picks on this machine's CPU (bfloat16 or float32), so
    every system in a comparison runs in the same one."""
    import torch

    from pdserve.model.loader import resolve_dtype

    return str(resolve_dtype(name, torch.device("cpu"))).removeprefix("torch.")


def _offline(args: argparse.Namespace) -> int:
    from pdserve.bench.offline import run

    args.dtype = resolve_dtype_name(args.dtype)
    return run(args)


def _serve(args: argparse.Namespace) -> int:
    if (args.url is None) == (args.compare is None):
        raise SystemExit("pdserve bench serve: give --url (a running server) or --compare")
    if args.compare:
        from pdserve.bench import serve_compare

        args.dtype = resolve_dtype_name(args.dtype)
        return serve_compare.run(args)
    from pdserve.bench.serve import run

    return run(args)
