"""`pdserve bench serve`: metrics from hand-built records, then the real CLI against a fake
OpenAI-compatible streaming server (starlette + uvicorn on loopback, in a thread)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from pdserve.bench.serve import (
    RequestRecord,
    ServeBenchConfig,
    arrival_gaps_s,
    make_payloads,
    summarize,
    wall_duration_s,
)
from pdserve.cli import main
from pdserve.errors import ConfigError
from pdserve.launch import free_port

CHUNK_SLEEP_S = 0.01
MODEL_ID = "fake-model"

# ---------------------------------------------------------------------------- summarize


def make_records() -> list[RequestRecord]:
    """Three successes with known timelines and one failure."""
    return [
        RequestRecord(0.0, 0.3, (0.1, 0.15, 0.2, 0.3), prompt_tokens=10, completion_tokens=4),
        RequestRecord(1.0, 1.5, (1.2, 1.4), prompt_tokens=10, completion_tokens=2),
        RequestRecord(0.5, 0.6, (0.6,), prompt_tokens=10, completion_tokens=1),
        RequestRecord(0.0, 0.05, success=False, http_status=400, error="bad prompt"),
    ]


def test_summarize_uses_vllm_definitions() -> None:
    s = summarize(make_records(), duration_s=2.0)
    assert (s.num_completed, s.num_failed) == (3, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (30, 7)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(3.5)
    assert s.total_token_throughput == pytest.approx(18.5)
    # TTFT 100, 200, 100 ms (the failure's 50 ms is not a sample)
    assert s.ttft.mean_ms == pytest.approx(400 / 3)
    assert s.ttft.median_ms == pytest.approx(100)
    assert s.ttft.p99_ms == pytest.approx(198)  # linear between 100 and 200 at 0.98
    # TPOT (300-100)/3 and (500-200)/1; the one-token request has none
    assert s.tpot.mean_ms == pytest.approx((200 / 3 + 300) / 2)
    assert s.tpot.median_ms == pytest.approx((200 / 3 + 300) / 2)
    assert s.tpot.p99_ms == pytest.approx(200 / 3 + 0.99 * (300 - 200 / 3))
    # ITL pooled: 50, 50, 100 and 200 ms
    assert s.itl.mean_ms == pytest.approx(100)
    assert s.itl.median_ms == pytest.approx(75)
    assert s.itl.p99_ms == pytest.approx(197)
    # E2E 300, 500, 100 ms
    assert s.e2el.mean_ms == pytest.approx(300)
    assert s.e2el.median_ms == pytest.approx(300)
    assert s.e2el.p99_ms == pytest.approx(496)
    assert [(f.http_status, f.message, f.count) for f in s.failures] == [(400, "bad prompt", 1)]


def test_summarize_groups_failures_and_reports_zero_without_samples() -> None:
    failed = [
        RequestRecord(0.0, 0.1, success=False, http_status=503, error="busy"),
        RequestRecord(0.0, 0.2, success=False, http_status=None, error="ReadTimeout"),
        RequestRecord(0.0, 0.3, success=False, http_status=503, error="busy"),
    ]
    s = summarize(failed, duration_s=0.3)
    assert (s.num_completed, s.num_failed, s.request_throughput) == (0, 3, 0.0)
    assert s.ttft.mean_ms == s.itl.p99_ms == 0.0
    assert [(f.http_status, f.count) for f in s.failures] == [(503, 2), (None, 1)]
    assert summarize([], duration_s=0.0).output_throughput == 0.0


def test_wall_duration_spans_first_start_to_last_end() -> None:
    assert wall_duration_s(make_records()) == pytest.approx(1.5)
    assert wall_duration_s([]) == 0.0


def test_summary_json_uses_vllm_key_names() -> None:
    out = summarize(make_records(), duration_s=2.0).to_json()
    assert out["completed"] == 3 and out["failed"] == 1
    assert out["median_itl_ms"] == pytest.approx(75)
    assert out["failures"][0]["http_status"] == 400
    json.dumps(out)  # serializable as is


# ---------------------------------------------------------------------------- workload


def make_config(**overrides: Any) -> ServeBenchConfig:
    args: dict[str, Any] = {
        **dict(url="http://127.0.0.1:1/v1/", api_key=None, model=None, endpoint="completions"),
        **dict(concurrency=2, num_prompts=3, input_len=8, output_len=4, seed=0),
        **dict(request_rate=float("inf"), timeout_s=5.0),
        **overrides,
    }
    return ServeBenchConfig.from_args(argparse.Namespace(**args))


def test_completion_payloads_are_seeded_token_ids() -> None:
    payloads = make_payloads(make_config(), "m")
    assert payloads == make_payloads(make_config(), "m")
    assert payloads != make_payloads(make_config(seed=1), "m")
    for p in payloads:
        assert len(p["prompt"]) == 8 and all(100 <= t < 10_000 for t in p["prompt"])
        assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
        assert (p["max_tokens"], p["temperature"], p["ignore_eos"]) == (4, 0, True)


def test_chat_payloads_have_input_len_words() -> None:
    payloads = make_payloads(make_config(endpoint="chat"), "m")
    for p in payloads:
        (message,) = p["messages"]
        assert message["role"] == "user" and len(message["content"].split()) == 8


def test_config_strips_v1_and_rejects_bad_flags() -> None:
    assert make_config().base_url == "http://127.0.0.1:1"
    with pytest.raises(ConfigError, match="--concurrency must be at least 1"):
        make_config(concurrency=0)
    with pytest.raises(ConfigError, match="--request-rate must be positive"):
        make_config(request_rate=0.0)
    with pytest.raises(ConfigError, match="must start with http"):
        make_config(url="localhost:8000")


def test_arrival_gaps_are_poisson_when_rate_is_finite() -> None:
    assert arrival_gaps_s(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps_s(2000, 50.0, random.Random(0))
    assert gaps[0] == 0.0 and min(gaps[1:]) > 0
    assert sum(gaps) / 1999 == pytest.approx(1 / 50, rel=0.1)


# ---------------------------------------------------------------------------- fake server


@dataclass
class FakeServer:
    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self) -> None:
        self.bodies.clear()
        self.auth_headers.clear()
        self.max_in_flight = 0


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: FakeServer) -> Starlette:
    """/v1/models, streaming /v1/completions and /v1/chat/completions; under /flaky every
    other completion request is refused with a 400 OpenAI error; under /broken every stream
    ends in an error chunk."""
    flaky_counter = itertools.count()

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            if chat:  # OpenAI opens a chat stream with a role-only delta: not content
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(body["max_tokens"]):
                await asyncio.sleep(CHUNK_SLEEP_S)
                text = f" t{i}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
                yield sse({"choices": [choice]})
            n_prompt = len(body["messages"][0]["content"].split() if chat else body["prompt"])
            usage = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"]}
            yield sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            state.in_flight -= 1

    def completions(chat: bool, flaky: bool = False) -> Any:
        async def handle(request: Request) -> Response:
            body = await request.json()
            state.bodies.append(body)
            state.auth_headers.append(request.headers.get("authorization"))
            if flaky and next(flaky_counter) % 2 == 1:
                error = {"message": "prompt must be a string", "type": "invalid_request_error"}
                return JSONResponse({"error": error}, status_code=400)
            return StreamingResponse(stream(body, chat), media_type="text/event-stream")

        return handle

    routes = [
        Route("/v1/models", models),
        Route("/v1/completions", completions(chat=False), methods=["POST"]),
        Route("/v1/chat/completions", completions(chat=True), methods=["POST"]),
    ]
    flaky = [
        Route("/v1/models", models),
        Route("/v1/completions", completions(chat=False, flaky=True), methods=["POST"]),
    ]

    async def broken_stream() -> AsyncIterator[str]:  # vLLM reports engine errors in-stream
        yield sse({"choices": [{"text": " t0"}]})
        yield sse({"error": {"message": "engine died", "type": "internal_error"}})

    async def broken(request: Request) -> Response:
        return StreamingResponse(broken_stream(), media_type="text/event-stream")

    broken_routes = [
        Route("/v1/models", models),
        Route("/v1/completions", broken, methods=["POST"]),
    ]
    mounts = [Mount("/flaky", routes=flaky), Mount("/broken", routes=broken_routes)]
    return Starlette(routes=[*routes, *mounts])


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP;
    # with proto 0, Nagle + delayed ACKs hold the first chunks ~40 ms on reused connections.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    state = FakeServer(url=f"http://127.0.0.1:{sock.getsockname()[1]}")
    config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("fake server did not start")
            time.sleep(0.01)
        yield state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def bench_args(url: str, *extra: str) -> list[str]:
    args = ["bench", "serve", "--url", url, "--concurrency", "2", "--num-prompts", "4"]
    return [*args, "--input-len", "8", "--output-len", "5", "--json", *extra]


def report_value(out: str, label: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label) :].strip()


def test_completions_end_to_end(
    fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.reset()
    assert main(bench_args(fake_server.url)) == 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert report_value(out, "Successful requests:") == "4"
    assert report_value(out, "Total generated tokens:") == "20"
    result = json.loads(out.splitlines()[-1])
    assert (result["completed"], result["failed"]) == (4, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (32, 20)
    sleep_ms = CHUNK_SLEEP_S * 1000
    assert result["mean_ttft_ms"] >= 0.5 * sleep_ms  # the first chunk waits one sleep
    assert 0.5 * sleep_ms < result["median_itl_ms"] < 20 * sleep_ms
    assert result["mean_tpot_ms"] > 0 and result["mean_e2el_ms"] > result["mean_ttft_ms"]
    assert result["output_throughput"] == pytest.approx(20 / result["duration"])
    # what the server saw: the model from /v1/models, seeded token-id prompts, <= 2 in flight
    assert len(fake_server.bodies) == 4 and fake_server.max_in_flight == 2
    for body in fake_server.bodies:
        assert body["model"] == MODEL_ID and len(body["prompt"]) == 8
        assert body["ignore_eos"] is True and body["stream_options"]["include_usage"] is True
    assert fake_server.auth_headers == [None] * 4


def test_chat_end_to_end_with_poisson_arrivals(
    fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.reset()
    extra = ["--endpoint", "chat", "--model", "named", "--api-key", "k", "--request-rate", "100"]
    assert main(bench_args(fake_server.url, *extra)) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (result["completed"], result["total_output_tokens"]) == (4, 20)
    # the role-only first delta is not content: TTFT includes the first sleep
    assert result["mean_ttft_ms"] >= 0.5 * CHUNK_SLEEP_S * 1000
    assert {b["model"] for b in fake_server.bodies} == {"named"}
    assert fake_server.auth_headers == ["Bearer k"] * 4


def test_failed_requests_are_reported_and_exit_1(
    fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(bench_args(f"{fake_server.url}/flaky")) == 1
    out = capsys.readouterr().out
    assert report_value(out, "Successful requests:") == "2"
    assert report_value(out, "Failed requests:") == "2"
    assert "HTTP 400 x2: prompt must be a string" in out
    assert "rejects token-id prompts" in out
    result = json.loads(out.splitlines()[-1])
    assert (result["total_output_tokens"], result["failures"][0]["count"]) == (10, 2)
    assert 0.5 * CHUNK_SLEEP_S * 1000 < result["median_itl_ms"] < 20 * CHUNK_SLEEP_S * 1000


def test_error_chunk_mid_stream_is_a_failure(
    fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(bench_args(f"{fake_server.url}/broken")) == 1
    out = capsys.readouterr().out
    assert report_value(out, "Successful requests:") == "0"
    assert "HTTP 200 x4: engine died" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [([], "cannot reach"), (["--model", "m"], "no request got an HTTP answer")],
)
def test_unreachable_url_is_one_clear_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(bench_args(url, *extra)) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"pdserve: error: {message}") and url in line


def test_compare_starts_each_system_and_reports_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--compare pdserve`: a real pdserve process on the default model, started, loaded
    and stopped by the bench (vLLM's side needs bench/.venv-vllm, so it is not run here)."""
    args = ["bench", "serve", "--compare", "pdserve", "--dtype", "float32", "--concurrency",
            "2", "--num-prompts", "3", "--input-len", "8", "--output-len", "4"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 requests x (8 prompt + 4 output tokens)" in out
    assert report_value(out, "failed requests") == "0"
    assert float(report_value(out, "output tok/s")) > 0


def test_compare_refuses_unknown_systems_and_a_url_with_it() -> None:
    from pdserve_bench.serve_compare import parse_systems

    with pytest.raises(ConfigError, match="pdserve, vllm"):
        parse_systems("pdserve,sglang")
    args = ["bench", "serve", "--compare", "pdserve", "--url", "http://127.0.0.1:1",
            "--concurrency", "1", "--num-prompts", "1", "--input-len", "1",
            "--output-len", "1"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"--url .* or --compare"):
        main(args)
