"""`pdserve bench routing`: the proxy's routing side by side, on 2 prefill + 2 decode nodes.

The nodes start once (real `pdserve serve` processes, one thread each: the machine's cores
are shared by four engines); each router then runs in front of the same nodes, one at a
time. Each router gets its own texts (a salt in every system prompt and message), so what
one left in the nodes' caches never helps the next.

Workloads (`--workload`):
- `chat`: `--conversations` conversations × `--turns` turns, all conversations at once,
  each sending its next turn when the last answer has arrived; they share
  `--system-prompts` long system prompts. Per router: TTFT p50/p99 over every turn, and
  the prompt tokens the nodes computed in all (their `pdserve_prompt_tokens_computed`).
  Routers: pdserve least-loaded, pdserve cache-aware, pdserve cache-aware with selective
  P/D (`--disagg-min-tokens`), and `vllm-router --policy cache_aware` where
  bench/vllm_router/setup.sh installed it.
- `short`: one request at a time, prompts of `--short-lens` tokens. TTFT p50 of a single
  node (a decode node, asked directly), of the proxy always P/D, and of the proxy with
  selective P/D, taking turns request by request: where P/D starts to pay for its second
  leg.
- `overload`: the proxy with `--max-concurrency C --max-queue 0`. First its capacity:
  `C` clients back to back (requests/s, TTFT p99: the unloaded baseline); then requests
  arriving at `--overload` times that rate (Poisson) for `--overload-s` seconds. Reports
  the 5xx count, how fast each 429 came, the accepted requests' TTFT p99 against the
  baseline, and how long until every node was idle afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.launch import Node, free_port, launch, stop_all, wait_healthy
from pdserve_bench.accuracy import load_text

ROOT = Path(__file__).resolve().parents[2]
VLLM_ROUTER = ROOT / "bench" / ".venv-vllm-router" / "bin" / "vllm-router"
VLLM_ROUTER_SETUP = "bench/vllm_router/setup.sh"
NODE_ENV = {"OMP_NUM_THREADS": "1", "PDSERVE_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "routing",
        help="the proxy's routing against least-loaded, "
        "vllm-router and a single node (2 prefill + 2 decode nodes)",
    )
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=None, help="the nodes' (default: theirs)")
    p.add_argument("--workload", choices=["chat", "short", "overload", "all"], default="all")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300, help="words per system prompt")
    p.add_argument("--message-words", type=int, default=30, help="words per user message")
    p.add_argument("--max-tokens", type=int, default=32, help="per answer")
    p.add_argument("--disagg-min-tokens", type=int, default=256, help="for the selective-P/D rows")
    p.add_argument("--short-lens", default="16,32,64,128,256", help="prompt tokens, `short`")
    p.add_argument("--short-requests", type=int, default=12, help="per length and system")
    p.add_argument("--capacity", type=int, default=8, help="`overload`: --max-concurrency")
    p.add_argument("--overload", type=float, default=4.0, help="`overload`: times capacity")
    p.add_argument("--overload-s", type=float, default=60.0, help="`overload`: seconds")
    p.add_argument("--compare", default="vllm-router", help="vllm-router, or nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)  # fmt: skip


@dataclass
class Nodes:
    prefill: list[Node]
    decode: list[Node]

    @property
    def all(self) -> list[Node]:
        return [*self.prefill, *self.decode]

    def prompt_tokens_computed(self) -> int:
        return sum(int(_get(n.url, "/admin/kv")["num_prompt_tokens_computed"]) for n in self.all)


def _get(url: str, path: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{url}{path}", timeout=10).json()
    return data


@contextlib.contextmanager
def start_nodes(args: argparse.Namespace) -> Iterator[Nodes]:
    common = ["--model", args.model, "--dtype", args.dtype]
    if args.block_size is not None:
        common += ["--block-size", str(args.block_size)]
    roles = ["prefill", "prefill", "decode", "decode"]
    nodes = [launch([*common, "--role", r], env=NODE_ENV) for r in roles]
    try:
        for n in nodes:
            wait_healthy(n, 300)
        yield Nodes(nodes[:2], nodes[2:])
    finally:
        stop_all(nodes)


@contextlib.contextmanager
def start_router(name: str, nodes: Nodes, args: argparse.Namespace, *extra: str) -> Iterator[str]:
    """A router in front of the nodes; its URL."""
    port = free_port()
    if name == "vllm-router":
        cmd = [
            str(VLLM_ROUTER),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            "--policy",
            "cache_aware",
            "--log-level",
            "warning",
        ]
        for n in nodes.prefill:
            cmd += ["--prefill", n.url]
        for n in nodes.decode:
            cmd += ["--decode", n.url]  # fmt: skip
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        router = Node(f"http://127.0.0.1:{port}", process)
        _wait_router(router)
    else:
        flags = [a for n in nodes.prefill for a in ("--prefill", n.url)]
        flags += [a for n in nodes.decode for a in ("--decode", n.url)]
        flags += ["--model", args.model, "--health-interval-s", "0.5", *extra]
        router = wait_healthy(launch(flags, env=NODE_ENV, port=port, command="proxy"), 60)
    try:
        yield router.url
    finally:
        stop_all([router])


def _wait_router(router: Node, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise SystemExit(f"vllm-router exited ({router.process.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{router.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit("vllm-router did not become healthy")


# -- the chat workload ---------------------------------------------------------------------


@dataclass
class Texts:
    """Words to build prompts from (the shipped public-domain prose), salted per router."""

    words: list[str]
    salt: str
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.salt)  # each router its own prompts

    def passage(self, num_words: int) -> str:
        start = self.rng.randrange(len(self.words) - num_words)
        return f"[{self.salt}] " + " ".join(self.words[start : start + num_words])


async def stream_chat(
    http: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[float, str, int]:
    """TTFT (first token's chunk), the answer's text, and the HTTP status."""
    start = time.perf_counter()
    ttft, parts = float("nan"), []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return ttft, "", response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if ttft != ttft:  # nan: the first token's chunk
                    ttft = time.perf_counter() - start
                parts.append(text)
    return ttft, "".join(parts), 200


async def run_chat(url: str, args: argparse.Namespace, texts: Texts) -> dict[str, Any]:
    systems = [texts.passage(args.system_words) for _ in range(args.system_prompts)]
    ttfts: list[float] = []
    by_turn: list[list[float]] = [[] for _ in range(args.turns)]
    failures = 0

    async def conversation(i: int, http: httpx.AsyncClient) -> None:
        nonlocal failures
        messages = [{"role": "system", "content": systems[i % len(systems)]}]
        await asyncio.sleep(0.05 * i)  # interleaved starts
        for turn in range(args.turns):
            messages.append({"role": "user", "content": texts.passage(args.message_words)})
            body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                    "stream": True, "model": args.model}  # fmt: skip
            ttft, answer, status = await stream_chat(http, url, body)
            if status != 200:
                failures += 1
                messages.pop()
                continue
            ttfts.append(ttft)
            by_turn[turn].append(ttft)
            messages.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=args.conversations + 4)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(conversation(i, http) for i in range(args.conversations)))
    return {
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
        "ttft_max_s_by_turn": [max(t, default=float("nan")) for t in by_turn],
        "num_turns": len(ttfts),
        "num_failed": failures,
        "wall_s": time.perf_counter() - started,
    }


def chat_systems(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(row name, router flags); vllm-router's flags are its own (start_router)."""
    selective = ["--routing", "cache-aware", "--disagg-min-tokens", str(args.disagg_min_tokens)]
    rows = [
        ("pdserve least-loaded", ["--routing", "least-loaded"]),
        ("pdserve cache-aware", ["--routing", "cache-aware"]),
        (f"pdserve cache-aware + selective P/D (<{args.disagg_min_tokens})", selective),
    ]
    if "vllm-router" in args.compare.split(","):
        if VLLM_ROUTER.exists():
            rows.append(("vllm-router cache_aware", []))
        else:
            print(f"vllm-router: not installed (run {VLLM_ROUTER_SETUP}); its row is skipped")
    return rows


def bench_chat(nodes: Nodes, args: argparse.Namespace, words: list[str]) -> list[dict[str, Any]]:
    results = []
    for i, (name, flags) in enumerate(chat_systems(args)):
        router = "vllm-router" if name.startswith("vllm-router") else "pdserve"
        with start_router(router, nodes, args, *flags) as url:
            before = nodes.prompt_tokens_computed()
            result = asyncio.run(run_chat(url, args, Texts(words, f"router {i}")))
            result["prompt_tokens_computed"] = nodes.prompt_tokens_computed() - before
        results.append({"system": name, **result})
        print(f"  {name}: {json.dumps(result)}", flush=True)
    return results


# -- the short-prompt workload ---------------------------------------------------------------


async def run_short(
    urls: list[str], lens: list[int], n: int, texts: Texts, model: str
) -> list[dict[int, float]]:
    """TTFT p50 per prompt length for each URL, one request at a time (completions,
    token-id prompts). The systems take turns request by request, so a shared machine's
    drift falls on all of them alike (a first version measured them one after another and
    saw 1.3x where turns see 0.9-1.0x)."""
    ttfts: list[dict[int, list[float]]] = [{length: [] for length in lens} for _ in urls]
    async with httpx.AsyncClient(timeout=600) as http:
        for length in lens:
            for _ in range(n):
                for i, url in enumerate(urls):
                    prompt = [texts.rng.randrange(3, 300) for _ in range(length)]  # any vocab
                    first = await _first_token_s(http, url, prompt, model)
                    if first is not None:
                        ttfts[i][length].append(first)
    return [
        {k: float(np.percentile(v, 50)) if v else float("nan") for k, v in by_len.items()}
        for by_len in ttfts
    ]


async def _first_token_s(
    http: httpx.AsyncClient, url: str, prompt: list[int], model: str
) -> float | None:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "model": model}
    start = time.perf_counter()
    first = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():  # to the end: the connection is reused
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first


def bench_short(nodes: Nodes, args: argparse.Namespace, words: list[str]) -> list[dict[str, Any]]:
    """A decode node asked directly, the proxy always P/D and the proxy with selective P/D,
    taking turns (`run_short`): two proxies over the same nodes."""
    lens = [int(x) for x in args.short_lens.split(",") if x]
    names = [
        "single node",
        "proxy, always P/D",
        f"proxy, selective P/D (<{args.disagg_min_tokens})",
    ]
    always = start_router("pdserve", nodes, args, "--disagg-min-tokens", "0")
    selective = start_router(
        "pdserve", nodes, args, "--disagg-min-tokens", str(args.disagg_min_tokens)
    )
    with always as always_url, selective as selective_url:
        urls = [nodes.decode[0].url, always_url, selective_url]
        ttfts = asyncio.run(
            run_short(urls, lens, args.short_requests, Texts(words, "s"), args.model)
        )
    rows = [{"system": name, **_short_row(t)} for name, t in zip(names, ttfts, strict=True)]
    for row in rows:
        print(f"  {json.dumps(row)}", flush=True)
    return rows


def _short_row(ttft: dict[int, float]) -> dict[str, float]:
    return {f"ttft_p50_s@{length}": value for length, value in ttft.items()}


# -- the overload workload ------------------------------------------------------------------


@dataclass
class Outcome:
    status: int
    seconds: float
    """To the first token (200), or to the answer's head (any other status)."""


async def one_request(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    start = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(r.status_code, time.perf_counter() - start)
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return Outcome(200, first if first is not None else float("nan"))


def _overload_body(rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    prompt = [rng.randrange(3, 300) for _ in range(64)]
    return {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "model": args.model}  # fmt: skip


async def closed_loop(url: str, args: argparse.Namespace, num_requests: int) -> dict[str, float]:
    """`--capacity` clients back to back: the rate and TTFT the proxy serves at capacity."""
    rng = random.Random("capacity")
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=600) as http:

        async def client() -> None:
            while len(outcomes) < num_requests:
                outcomes.append(await one_request(http, url, _overload_body(rng, args)))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.capacity)))
        elapsed = time.perf_counter() - start
    ttfts = [o.seconds for o in outcomes if o.status == 200]
    return {"requests_per_s": len(outcomes) / elapsed,
            "ttft_p99_s": float(np.percentile(ttfts, 99))}  # fmt: skip


async def open_loop(url: str, args: argparse.Namespace, rate: float) -> list[Outcome]:
    rng, arrivals = random.Random("overload"), random.Random("arrivals")
    tasks: list[asyncio.Task[Outcome]] = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        deadline = time.perf_counter() + args.overload_s
        while time.perf_counter() < deadline:
            tasks.append(asyncio.ensure_future(one_request(http, url, _overload_body(rng, args))))
            await asyncio.sleep(arrivals.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def node_is_idle(state: dict[str, Any]) -> bool:
    """A node's `/admin/kv`: no block in use or held, no handoff, no request."""
    return bool(
        state["num_free_blocks"] == state["num_blocks"]
        and state.get("num_handoffs", 0) == 0
        and state["num_running"] == state["num_waiting"] == state["num_loading"] == 0
    )


def wait_all_idle(urls: list[str], timeout_s: float = 60.0) -> float:
    """Seconds until every node is idle (inf if one is not within `timeout_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if all(node_is_idle(_get(url, "/admin/kv")) for url in urls):
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def bench_overload(nodes: Nodes, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--max-concurrency", str(args.capacity), "--max-queue", "0"]
    with start_router("pdserve", nodes, args, *flags) as url:
        base = asyncio.run(closed_loop(url, args, num_requests=6 * args.capacity))
        rate = args.overload * base["requests_per_s"]
        print(f"  capacity: {json.dumps(base)}; offering {rate:.1f} requests/s", flush=True)
        outcomes = asyncio.run(open_loop(url, args, rate))
    accepted = [o.seconds for o in outcomes if o.status == 200]
    rejected = [o.seconds for o in outcomes if o.status == 429]
    return {
        "offered_per_s": rate,
        "num_requests": len(outcomes),
        "num_ok": len(accepted),
        "num_429": len(rejected),
        "num_5xx": sum(1 for o in outcomes if o.status >= 500),
        "num_other": sum(1 for o in outcomes if o.status not in (200, 429) and o.status < 500),
        "reject_p99_s": float(np.percentile(rejected, 99)) if rejected else 0.0,
        "reject_max_s": max(rejected, default=0.0),
        "num_429_over_50ms": sum(1 for s in rejected if s > 0.05),
        "baseline_ttft_p99_s": base["ttft_p99_s"],
        "accepted_ttft_p99_s": float(np.percentile(accepted, 99)) if accepted else float("nan"),
        "idle_after_s": wait_all_idle([n.url for n in nodes.all]),
    }


def print_overload(r: dict[str, Any]) -> None:
    print(
        f"\noverload: {r['num_requests']} requests at {r['offered_per_s']:.1f}/s: "
        f"{r['num_ok']} served, {r['num_429']} answered 429, {r['num_5xx']} 5xx, "
        f"{r['num_other']} other"
    )
    print(
        f"  429 answered in: p99 {r['reject_p99_s'] * 1e3:.1f} ms, max "
        f"{r['reject_max_s'] * 1e3:.1f} ms; {r['num_429_over_50ms']} over 50 ms"
    )
    ratio = r["accepted_ttft_p99_s"] / r["baseline_ttft_p99_s"]
    print(
        f"  accepted TTFT p99 {r['accepted_ttft_p99_s'] * 1e3:.0f} ms against "
        f"{r['baseline_ttft_p99_s'] * 1e3:.0f} ms at capacity ({ratio:.2f}x)"
    )
    print(f"  every node idle {r['idle_after_s']:.2f} s after the last answer")  # fmt: skip


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    words = load_text().split()
    results: dict[str, Any] = {}
    with start_nodes(args) as nodes:
        if args.workload in ("chat", "all"):
            print(f"chat: {args.conversations} conversations x {args.turns} turns, "
                  f"{args.system_prompts} shared system prompts", flush=True)  # fmt: skip
            results["chat"] = bench_chat(nodes, args, words)
            print_chat(results["chat"])
        if args.workload in ("short", "all"):
            print(f"short prompts, one at a time: {args.short_lens} tokens", flush=True)
            results["short"] = bench_short(nodes, args, words)
            print_short(results["short"])
        if args.workload in ("overload", "all"):
            print(f"overload: {args.overload:g}x capacity ({args.capacity} in flight) for "
                  f"{args.overload_s:g} s", flush=True)  # fmt: skip
            results["overload"] = bench_overload(nodes, args)
            print_overload(results["overload"])
    if args.json:
        print(json.dumps(results))
    return 0


def print_chat(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    print(f"\n{'router':<44}{'TTFT p50':>10}{'p99':>9}{'prompt tok':>12}"
          f"{'vs least-loaded: p50':>22}{'tokens':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['system']:<44}{r['ttft_p50_s'] * 1e3:>8.0f}ms{r['ttft_p99_s'] * 1e3:>7.0f}ms"
            f"{r['prompt_tokens_computed']:>12}"
            f"{base['ttft_p50_s'] / r['ttft_p50_s']:>21.2f}x"
            f"{base['prompt_tokens_computed'] / max(r['prompt_tokens_computed'], 1):>7.2f}x"
        )
    print("(ratios: least-loaded's TTFT p50 / the row's, and its prompt tokens / the row's)")
    turns = " ".join(f"{i + 1:>6}" for i in range(len(base["ttft_max_s_by_turn"])))
    print(f"\n{'slowest TTFT (ms) by turn:':<46}{turns}")
    for r in rows:
        cells = " ".join(f"{t * 1e3:>6.0f}" for t in r["ttft_max_s_by_turn"])
        print(f"  {r['system']:<44}{cells}")


def print_short(rows: list[dict[str, Any]]) -> None:
    lens = [k.split("@")[1] for k in rows[0] if k.startswith("ttft")]
    print(f"\n{'TTFT p50 (ms), prompt tokens:':<34}" + "".join(f"{n:>8}" for n in lens))
    single = rows[0]
    for r in rows:
        cells = "".join(f"{r[f'ttft_p50_s@{n}'] * 1e3:>8.1f}" for n in lens)
        print(f"{r['system']:<34}{cells}")
    for r in rows[1:]:
        ratio = "".join(f"{r[f'ttft_p50_s@{n}'] / single[f'ttft_p50_s@{n}']:>8.2f}" for n in lens)
        print(f"{'  / single node: ' + r['system']:<34}{ratio}")
