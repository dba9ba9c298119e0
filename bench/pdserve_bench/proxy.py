"""`pdserve bench proxy`: what the proxy adds, against nodes that answer instantly.

Processes: a stub node (a bare ASGI app under uvicorn that answers prefill legs with
made-up `kv_transfer_params` and every other completion with a canned answer), the proxy
pinned to one core, and this process as the load generator (a minimal keep-alive HTTP/1.1
client, so the generator is not what is measured). For each concurrency:
- direct: clients → stub (one request each);
- proxied: clients → proxy → stub (the prefill leg, then the decode leg).
Reports p50/p99 latency and requests/s of both, and the p50 the proxy adds. With `--tls`
the same again with every hop over TLS (a throwaway CA, `pdserve/tls.py`; keep-alive
connections, as the proxy keeps them): the direct rows' difference is one hop's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.launch import free_port, launch, sigterm_as_interrupt
from pdserve.parent_watch import ParentWatch
from pdserve.tls import TLSConfig, make_cluster_certs

BODY = json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0}).encode()


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("proxy", help="latency and rate the proxy adds (stub nodes)")
    p.add_argument("--concurrency", default="1,64", help="comma-separated")
    p.add_argument("--duration-s", type=float, default=5.0, help="per measurement")
    p.add_argument("--proxy-cpu", type=int, default=0, help="core the proxy is pinned to")
    p.add_argument("--tls", action="store_true", help="also measure with every hop over TLS")
    p.add_argument(
        "--discovery",
        action="store_true",
        help="also measure with the nodes from a members file the proxy follows",
    )
    p.add_argument(
        "--routing", default=None, help="the proxy's --routing (default: the proxy's default)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


# -- the stub node (run as `python -m pdserve_bench.proxy stub PORT PARENT_PID`) -------------

_PREFILL_ANSWER = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " a", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                           "remote_request_id": "ho-stub", "remote_block_ids": [0],
                           "remote_host": "127.0.0.1", "remote_port": 1,
                           "remote_num_tokens": 4, "release_token": "t"},
}).encode()  # fmt: skip
_DECODE_ANSWER = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " a b c d e f g h", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12},
}).encode()  # fmt: skip
_STUB_HEAD = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub"}
_DECODE_STREAM = b"".join(
    b"data: " + json.dumps(chunk).encode() + b"\n\n"
    for chunk in (
        *({**_STUB_HEAD, "choices": [{"index": 0, "text": f" {w}", "finish_reason": None}]}
          for w in "abcdefg"),
        {**_STUB_HEAD, "choices": [{"index": 0, "text": " h", "finish_reason": "length"}]},
        {**_STUB_HEAD, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 8,
                                                "total_tokens": 12}},
    )
) + b"data: [DONE]\n\n"  # fmt: skip
"""The decode answer as the stream the proxy asks every decode leg for."""


async def stub_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        answer, kind = b'{"status": "ok"}', b"application/json"
    elif scope["path"] == "/admin/prefix_cache":  # an empty cache, as a fresh node's
        answer = b'{"block_size": 16, "version": 0, "num_hashes": 0, "hashes": ""}'
        kind = b"application/json"
    elif b'"do_remote_decode": true' in body:  # a prefill leg (a decode leg's says false)
        answer, kind = _PREFILL_ANSWER, b"application/json"
    elif b'"stream": true' in body:  # every decode leg the proxy sends
        answer, kind = _DECODE_STREAM, b"text/event-stream"
    else:
        answer, kind = _DECODE_ANSWER, b"application/json"
    headers = [
        (b"content-type", kind),
        (b"content-length", str(len(answer)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


# -- a lean keep-alive client ------------------------------------------------------------------


async def _open(
    port: int, context: ssl.SSLContext | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, ssl=context)


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    writer.write(request)
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)
    return int(status_line.split()[1])


async def _load(
    port: int, concurrency: int, duration_s: float, context: ssl.SSLContext | None = None
) -> tuple[list[float], int]:
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
               b"content-type: application/json\r\ncontent-length: "
               + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)  # fmt: skip
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + duration_s

    async def client() -> None:
        nonlocal errors
        reader, writer = await _open(port, context)
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            if await _post(reader, writer, request) != 200:
                errors += 1
            latencies.append(time.perf_counter() - start)
        writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, errors


def _stats(latencies: list[float], duration_s: float) -> dict[str, float]:
    return {"p50_ms": 1000 * float(np.percentile(latencies, 50)),
            "p99_ms": 1000 * float(np.percentile(latencies, 99)),
            "rps": len(latencies) / duration_s}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    with sigterm_as_interrupt():  # SIGTERM stops the stub and the proxy as Ctrl-C does
        results = {"plain": _run(args, TLSConfig())}
        with tempfile.TemporaryDirectory(prefix="pdserve-bench-proxy-") as folder:
            if args.tls:
                certs = make_cluster_certs(Path(folder)).config()
                results["tls"] = _run(args, certs)
            if args.discovery:
                results["discovery"] = _run(args, TLSConfig(), Path(folder) / "members.json")
    for mode, rows in results.items():
        print(f"\n{mode}:")
        _print(rows)
    if args.discovery:
        for c in results["plain"]:
            added = (
                results["discovery"][c]["proxy"]["p50_ms"] - results["plain"][c]["proxy"]["p50_ms"]
            )
            print(f"concurrency {c}: discovery (a members file) adds {added:.2f} ms p50")
    if args.tls:
        for c in results["plain"]:
            plain, tls = results["plain"][c], results["tls"][c]
            hop = tls["direct"]["p50_ms"] - plain["direct"]["p50_ms"]
            both = tls["proxy"]["p50_ms"] - plain["proxy"]["p50_ms"]
            print(f"concurrency {c}: TLS adds {hop:.2f} ms p50 per hop (direct), "
                  f"{both:.2f} ms to a proxied request (3 hops)")  # fmt: skip
    if args.json:
        print(json.dumps(results))
    return 0


def _run(
    args: argparse.Namespace, tls: TLSConfig, members: Path | None = None
) -> dict[int, dict[str, Any]]:
    """One mode's rows; with `members`, the proxy follows that file (the stub in it) every
    health interval instead of being given the stub's URL."""
    stub_port, proxy_port = free_port(), free_port()
    stub = subprocess.Popen([sys.executable, "-m", "pdserve_bench.proxy", "stub", str(stub_port),
                             str(os.getpid()), *tls.as_args()])  # fmt: skip
    url = f"{tls.scheme}://127.0.0.1:{stub_port}"
    nodes = ["--prefill", url, "--decode", url]
    if members is not None:
        members.write_text(json.dumps({"prefill": [url], "decode": [url]}))
        nodes = ["--members-file", str(members)]
    routing = ["--routing", args.routing] if args.routing else []
    proxy = launch([*nodes, *routing], {"PDSERVE_LOG_LEVEL": "WARNING"},
                   port=proxy_port, command="proxy", tls=tls).process  # fmt: skip
    context = tls.client_context() if tls.serves else None
    try:
        os.sched_setaffinity(proxy.pid, {args.proxy_cpu})
        others = set(range(os.cpu_count() or 1)) - {args.proxy_cpu} or {args.proxy_cpu}
        os.sched_setaffinity(stub.pid, others)
        os.sched_setaffinity(0, others)
        for port in (stub_port, proxy_port):
            _wait_port(port, context)
        results = {}
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            row: dict[str, Any] = {}
            for name, port in (("direct", stub_port), ("proxy", proxy_port)):
                asyncio.run(_load(port, concurrency, 0.5, context))  # warm up
                latencies, errors = asyncio.run(_load(port, concurrency, args.duration_s, context))
                row[name] = {**_stats(latencies, args.duration_s), "errors": errors}
            row["added_p50_ms"] = row["proxy"]["p50_ms"] - row["direct"]["p50_ms"]
            results[concurrency] = row
        return results
    finally:
        for process in (proxy, stub):
            process.terminate()
            process.wait(10)


def _wait_port(port: int, context: ssl.SSLContext | None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            asyncio.run(_probe(port, context))
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


async def _probe(port: int, context: ssl.SSLContext | None) -> None:
    _, writer = await _open(port, context)
    writer.close()


def _print(results: dict[int, dict[str, Any]]) -> None:
    head = "| concurrency | direct p50 / p99 | proxied p50 / p99 | added p50 |"
    print(head + " direct req/s | proxied req/s |")
    print("|---|---|---|---|---|---|")
    for c, r in results.items():
        d, p = r["direct"], r["proxy"]
        print(f"| {c} | {d['p50_ms']:.2f} / {d['p99_ms']:.2f} ms | {p['p50_ms']:.2f} / "
              f"{p['p99_ms']:.2f} ms | {r['added_p50_ms']:.2f} ms | {d['rps']:.0f} | "
              f"{p['rps']:.0f} |")  # fmt: skip


async def _serve_stub(port: int, parent: ParentWatch, tls: TLSConfig) -> None:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(stub_app, host="127.0.0.1", port=port,
                                           log_level="error", **tls.uvicorn_options()))  # fmt: skip
    stop = functools.partial(setattr, server, "should_exit", True)
    watcher = asyncio.create_task(parent.stop_when_gone(stop, "stub node"))
    await server.serve()
    watcher.cancel()


if __name__ == "__main__" and sys.argv[1:2] == ["stub"]:  # stub PORT PARENT_PID [TLS flags]
    files = dict(zip(sys.argv[4::2], sys.argv[5::2], strict=True))
    stub_tls = TLSConfig(files.get("--ssl-certfile"), files.get("--ssl-keyfile"))
    asyncio.run(_serve_stub(int(sys.argv[2]), ParentWatch(int(sys.argv[3])), stub_tls))
