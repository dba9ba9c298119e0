"""The `pdserve bench` subcommands this distribution adds (`pdserve bench serve` is in
pdserve itself): pdserve's CLI calls `add_parsers` when `pdserve_bench` is installed."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.bench.cli import DTYPES
from pdserve.config import KV_CACHE_DTYPES, QUANTIZATIONS


def add_parsers(bench_sub: Any) -> None:
    off = bench_sub.add_parser("offline", help="offline throughput vs. HF transformers")
    off.add_argument("--model", default="default")
    off.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="auto: what pdserve picks on this CPU"
    )
    off.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="how pdserve keeps the weights (auto: a GGUF's blocks, on the kernels)",
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
        "request at a time), llamacpp-avx2 (llama.cpp built for the AVX2 class by LEVEL=avx2 "
        "bench/llamacpp/setup.sh, one request at a time: beside PDSERVE_CPU_ISA=avx2), torch "
        "(pdserve on plain PyTorch ops), dense (pdserve, weights dequantized), kv-int8 "
        "(pdserve with the 8-bit KV cache), batch-invariant (pdserve with --batch-invariant), "
        "structured (pdserve, every request under a JSON schema)",
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

    from pdserve_bench.accuracy import add_parser as add_accuracy_parser
    from pdserve_bench.agent_apis import add_parser as add_agent_apis_parser
    from pdserve_bench.chaos.run import add_parser as add_chaos_parser
    from pdserve_bench.kernels import add_parser as add_kernels_parser
    from pdserve_bench.pd import add_parser as add_pd_parser
    from pdserve_bench.proxy import add_parser as add_proxy_parser
    from pdserve_bench.routing import add_parser as add_routing_parser

    add_pd_parser(bench_sub)
    add_proxy_parser(bench_sub)
    add_chaos_parser(bench_sub)
    add_kernels_parser(bench_sub)
    add_accuracy_parser(bench_sub)
    add_routing_parser(bench_sub)
    add_agent_apis_parser(bench_sub)


def resolve_dtype_name(name: str) -> str:
    """`auto` -> the dtype pdserve picks on this machine's CPU (bfloat16 or float32), so
    every system in a comparison runs in the same one."""
    import torch

    from pdserve.model.loader import resolve_dtype

    return str(resolve_dtype(name, torch.device("cpu"))).removeprefix("torch.")


def _offline(args: argparse.Namespace) -> int:
    from pdserve_bench.offline import run

    args.dtype = resolve_dtype_name(args.dtype)
    return run(args)


def serve_compare(args: argparse.Namespace) -> int:
    """`pdserve bench serve --compare`: start each system here in turn and load it."""
    from pdserve_bench import serve_compare

    args.dtype = resolve_dtype_name(args.dtype)
    return serve_compare.run(args)
