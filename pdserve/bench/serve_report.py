"""`pdserve bench serve` as a command: the load (`serve.py`), then its report, vLLM's
benchmark_serving table and what failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from pdserve.bench.serve import (
    ENDPOINT_PATHS,
    BenchError,
    BenchSummary,
    LatencyStats,
    ServeBenchConfig,
    run_requests,
    summarize,
    wall_duration_s,
)

MAX_FAILURE_KINDS_SHOWN = 5


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_report(summary: BenchSummary, config: ServeBenchConfig, model: str) -> list[str]:
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Model:", model),
        _row("Endpoint:", ENDPOINT_PATHS[config.endpoint]),
        _row("Successful requests:", summary.num_completed),
        _row("Failed requests:", summary.num_failed),
        _row("Maximum request concurrency:", config.concurrency),
        _row("Request rate configured (RPS):", config.request_rate),
        _row("Benchmark duration (s):", summary.duration_s),
        _row("Total input tokens:", summary.total_input_tokens),
        _row("Total generated tokens:", summary.total_output_tokens),
        _row("Request throughput (req/s):", summary.request_throughput),
        _row("Output token throughput (tok/s):", summary.output_throughput),
        _row("Total Token throughput (tok/s):", summary.total_token_throughput),
    ]
    sections = (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
    )
    for attr, short, title in sections:
        stats: LatencyStats = getattr(summary, attr)
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", stats.mean_ms))
        lines.append(_row(f"Median {short} (ms):", stats.median_ms))
        lines.append(_row(f"P99 {short} (ms):", stats.p99_ms))
    lines.append("=" * 50)
    return lines + failure_lines(summary, config)


def failure_lines(summary: BenchSummary, config: ServeBenchConfig) -> list[str]:
    if not summary.failures:
        return []
    shown = summary.failures[:MAX_FAILURE_KINDS_SHOWN]
    lines = [f"Failures ({summary.num_failed} requests, {len(summary.failures)} kinds):"]
    for kind in shown:
        status = f"HTTP {kind.http_status}" if kind.http_status is not None else "no response"
        lines.append(f"  {status} x{kind.count}: {kind.message}")
    if len(summary.failures) > len(shown):
        lines.append(f"  ... and {len(summary.failures) - len(shown)} more kinds")
    client_errors = any(k.http_status is not None and 400 <= k.http_status < 500 for k in shown)
    if config.endpoint == "completions" and client_errors:
        lines.append(
            "hint: --endpoint completions sends prompts as lists of token ids (as vLLM "
            "accepts); a server that rejects token-id prompts answers 4xx: try --endpoint chat"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    """`pdserve bench serve`: 0 if every request succeeded, 1 if any failed."""
    config = ServeBenchConfig.from_args(args)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    model, records = asyncio.run(run_requests(config))
    if all(not r.success and r.http_status is None for r in records):
        first_error = records[0].error
        raise BenchError(f"no request got an HTTP answer from {config.base_url}: {first_error}")
    summary = summarize(records, wall_duration_s(records))
    print("\n".join(format_report(summary, config, model)))
    if args.json:
        print(json.dumps(summary.to_json()))
    return 0 if summary.num_failed == 0 else 1
