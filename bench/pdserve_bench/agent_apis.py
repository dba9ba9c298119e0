"""`pdserve bench agent-apis --url URL`: what the Responses API costs over chat completions,
on one running server or cluster (`pdserve up`), in one run.

The same greedy requests (the same seeded words: `input` for one, a user message for the
other) go through `/v1/chat/completions` and `/v1/responses` in alternating rounds, after
one warm-up round of each; every round is `pdserve bench serve`'s load (`run_requests`).
Neither can send `ignore_eos` (the Responses API has none), so both run to their end of
sequence: greedy, they produce the same tokens, which the table shows. Responses are
stored (the default; SQLite unless the server was given another store), so the store's
writes are in the cost. The medians of the rounds are printed side by side, with the
ratio responses / chat, then each round's pair (a round of each, back to back) as a ratio:
on a shared 2-core machine the rounds drift by more than the difference measured.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from pdserve.bench.serve import ServeBenchConfig, run_requests, summarize, wall_duration_s

ENDPOINTS = ("chat", "responses")
METRICS = (
    ("request_throughput", "requests/s", True),
    ("output_throughput", "output tokens/s", True),
    ("mean_ttft_ms", "mean TTFT ms", False),
    ("mean_tpot_ms", "mean TPOT ms", False),
    ("mean_e2el_ms", "mean E2E ms", False),
)


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("agent-apis", help="the Responses API's cost over chat completions")
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64, help="words per request")
    p.add_argument("--output-len", type=int, default=64, help="max tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per endpoint")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _config(args: argparse.Namespace, endpoint: str) -> ServeBenchConfig:
    ns = argparse.Namespace(
        url=args.url, api_key=args.api_key, model=args.model, endpoint=endpoint,
        concurrency=args.concurrency, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, request_rate=float("inf"), seed=args.seed, timeout_s=600.0,
        ignore_eos=False,
    )  # fmt: skip
    return ServeBenchConfig.from_args(ns)


def _round(config: ServeBenchConfig) -> dict[str, Any]:
    _, records = asyncio.run(run_requests(config))
    return summarize(records, wall_duration_s(records)).to_json()


def run(args: argparse.Namespace) -> int:
    configs = {e: _config(args, e) for e in ENDPOINTS}
    for endpoint in ENDPOINTS:  # warm-up: the prefix cache and the code paths
        _round(configs[endpoint])
    rounds: dict[str, list[dict[str, Any]]] = {e: [] for e in ENDPOINTS}
    for _ in range(args.rounds):
        for endpoint in ENDPOINTS:
            rounds[endpoint].append(_round(configs[endpoint]))
    failed = {e: sum(r["failed"] for r in rounds[e]) for e in ENDPOINTS}
    tokens = {e: sorted({r["total_output_tokens"] for r in rounds[e]}) for e in ENDPOINTS}
    print(f"{args.rounds} rounds of {args.num_prompts} requests at concurrency {args.concurrency}"
          f" ({args.input_len} words in, up to {args.output_len} tokens out), medians")  # fmt: skip
    print(f"{'':18} {'chat':>10} {'responses':>10} {'ratio':>7}")
    for key, label, higher_is_better in METRICS:
        chat = statistics.median(r[key] for r in rounds["chat"])
        resp = statistics.median(r[key] for r in rounds["responses"])
        ratio = resp / chat if chat else float("nan")
        better = "higher is better" if higher_is_better else "lower is better"
        print(f"{label:18} {chat:10.2f} {resp:10.2f} {ratio:7.3f}  ({better})")
    pairs = [r["request_throughput"] / c["request_throughput"]
             for c, r in zip(rounds["chat"], rounds["responses"], strict=True)]  # fmt: skip
    print("requests/s by round (chat, responses): " + ", ".join(
        f"{c['request_throughput']:.2f} {r['request_throughput']:.2f}"
        for c, r in zip(rounds["chat"], rounds["responses"], strict=True)))  # fmt: skip
    print(f"ratio of each round's pair: median {statistics.median(pairs):.3f}, "
          f"min {min(pairs):.3f}, max {max(pairs):.3f}")  # fmt: skip
    print(f"output tokens per round: chat {tokens['chat']}, responses {tokens['responses']}")
    print(f"failed requests: chat {failed['chat']}, responses {failed['responses']}")
    return 0 if not any(failed.values()) else 1
