"""Online serving benchmark: load any OpenAI-compatible server, report like vLLM.

The life of one run:
1. `ServeBenchConfig.from_args` checks the flags; a bad value raises `ConfigError`.
2. The model name comes from `--model`, or the first id of `GET {url}/v1/models`.
3. `make_payloads` draws N seeded prompts: `completions` sends each prompt as a list of
   `input_len` token ids in [100, 10000) (vLLM accepts token-id prompts); `chat` sends one
   user message of `input_len` random common words (about one token each).
4. `run_requests` sends them as streaming requests (`max_tokens`, `temperature` 0,
   `ignore_eos`, usage in the stream). A semaphore caps requests in flight at
   `--concurrency`; with a finite `--request-rate` arrivals are Poisson (exponential gaps,
   the first request at t=0). Each request becomes one frozen `RequestRecord`: its start,
   the arrival time of every chunk that carries text, the final usage, and its outcome.
5. `summarize` turns the records into a `BenchSummary` with vLLM's benchmark_serving
   definitions (below); `serve_report.run` prints vLLM's table, then the JSON line if asked.

Metric definitions (over successful requests only; failures are counted and listed):
- TTFT: first text chunk time - request start.
- ITL: the gaps between successive text chunks, pooled over all requests.
- TPOT: (E2E - TTFT) / (completion_tokens - 1), for requests with more than one token.
- E2E: last byte of the stream - request start.
- Throughputs divide by the wall duration, first request sent to last request finished.
Mean, median and p99 use numpy (`np.percentile`, linear interpolation) as vLLM does; an
empty set of samples reports 0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from pdserve.errors import ConfigError, PdserveError

logger = logging.getLogger(__name__)

TOKEN_ID_LOW = 100  # skip special and control tokens at the start of most vocabularies
TOKEN_ID_HIGH = 10_000  # exclusive; below the vocabulary size of any real model
ENDPOINT_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
}
RESPONSES_END = ("response.completed", "response.incomplete")
"""A Responses stream's last event (it sends no `data: [DONE]`)."""
# Common English words that most BPE vocabularies encode as one token each (with the space).
_CHAT_TEXT = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "has had one their not but also its first new two after who they have her she been more "
    "other all time when would there into school year only world over most city can some "
    "many during state may three about between where such well him people used under out "
    "while part then these known could made both before later any through film since work "
    "game like team best life each music now found way house day long war band old"
)
CHAT_WORDS = tuple(_CHAT_TEXT.split())


class BenchError(PdserveError):
    """The benchmark could not run: the server is unreachable or answers nonsense."""

    error_type = "bench_error"


@dataclass(frozen=True)
class ServeBenchConfig:
    """What one `pdserve bench serve` run sends, and where."""

    base_url: str  # server root, without a trailing `/v1`; "" until --compare starts one
    api_key: str | None  # sent as `Authorization: Bearer ...` when given
    model: str | None  # None: the first id of GET /v1/models
    endpoint: str  # "completions", "chat" or "responses" (chat's words, as `input`)
    concurrency: int  # requests in flight at most
    num_prompts: int
    input_len: int  # prompt tokens per request (words for chat)
    output_len: int  # max_tokens per request; ignore_eos makes every request run to it
    request_rate: float  # Poisson arrivals per second; inf sends all at once
    seed: int
    timeout_s: float  # httpx connect/read/write timeout, per operation
    ignore_eos: bool = True  # vLLM's extension; the Responses API has none: run to EOS

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeBenchConfig:
        for name in ("concurrency", "num_prompts", "input_len", "output_len"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not args.request_rate > 0:
            raise ConfigError("--request-rate must be positive (inf: send all at once)")
        if not args.timeout_s > 0:
            raise ConfigError("--timeout-s must be positive")
        ignore_eos = getattr(args, "ignore_eos", True)
        if args.endpoint == "responses" and ignore_eos:
            raise ConfigError(
                "--endpoint responses runs each request to its end of sequence (the API has no "
                "ignore_eos): pass --no-ignore-eos, to the chat run it is compared with too"
            )
        base_url = "" if args.url is None else _server_root(args.url)
        return cls(
            base_url=base_url,
            api_key=args.api_key,
            model=args.model,
            endpoint=args.endpoint,
            concurrency=args.concurrency,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            request_rate=args.request_rate,
            seed=args.seed,
            timeout_s=args.timeout_s,
            ignore_eos=ignore_eos,
        )


def _server_root(url: str) -> str:
    base_url = url.rstrip("/").removesuffix("/v1")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"--url must start with http:// or https://, got {url!r}")
    try:
        httpx.URL(base_url)
    except httpx.InvalidURL as e:
        raise ConfigError(f"--url {url!r} is not a valid URL: {e}") from None
    return base_url


@dataclass(frozen=True)
class RequestRecord:
    """One request's timeline (time.perf_counter seconds) and outcome."""

    start_s: float
    end_s: float
    content_times_s: tuple[float, ...] = ()  # arrival of each chunk carrying text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    success: bool = True
    http_status: int | None = None  # None: no HTTP answer (connection error, timeout)
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.content_times_s[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def itls_s(self) -> list[float]:
        times = self.content_times_s
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass(frozen=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    p99_ms: float


@dataclass(frozen=True)
class FailureKind:
    http_status: int | None
    message: str
    count: int


@dataclass(frozen=True)
class BenchSummary:
    """Every reported number; failed requests count in `num_failed` and nowhere else."""

    duration_s: float
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # completion tokens / s
    total_token_throughput: float  # (prompt + completion tokens) / s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    failures: tuple[FailureKind, ...] = ()  # distinct kinds, first seen first

    def to_json(self) -> dict[str, Any]:
        """Flat keys named as vLLM's benchmark_serving result JSON names them."""
        out: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.num_completed,
            "failed": self.num_failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, name)
            out[f"mean_{name}_ms"] = stats.mean_ms
            out[f"median_{name}_ms"] = stats.median_ms
            out[f"p99_{name}_ms"] = stats.p99_ms
        out["failures"] = [asdict(f) for f in self.failures]
        return out


# ---------------------------------------------------------------------------- metrics


def latency_stats(samples_s: Sequence[float]) -> LatencyStats:
    if not samples_s:
        return LatencyStats(0.0, 0.0, 0.0)
    ms = np.asarray(samples_s, dtype=np.float64) * 1000.0
    return LatencyStats(float(np.mean(ms)), float(np.median(ms)), float(np.percentile(ms, 99)))


def group_failures(records: Sequence[RequestRecord]) -> tuple[FailureKind, ...]:
    counts: dict[tuple[int | None, str], int] = {}
    for r in records:
        if not r.success:
            key = (r.http_status, r.error)
            counts[key] = counts.get(key, 0) + 1
    return tuple(FailureKind(status, msg, n) for (status, msg), n in counts.items())


def wall_duration_s(records: Sequence[RequestRecord]) -> float:
    """First request sent to last request finished, failures included."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> BenchSummary:
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in done if r.completion_tokens > 1
    ]

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    return BenchSummary(
        duration_s=duration_s,
        num_completed=len(done),
        num_failed=len(records) - len(done),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        ttft=latency_stats([r.ttft_s for r in done]),
        tpot=latency_stats(tpots),
        itl=latency_stats([gap for r in done for gap in r.itls_s]),
        e2el=latency_stats([r.e2e_s for r in done]),
        failures=group_failures(records),
    )


# ---------------------------------------------------------------------------- workload


def make_payloads(config: ServeBenchConfig, model: str) -> list[dict[str, Any]]:
    """One request body per prompt, drawn from a RNG seeded with `config.seed`."""
    rng = random.Random(config.seed)
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": config.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        common["ignore_eos"] = True  # vLLM extension: run every request to max_tokens
    payloads = []
    for _ in range(config.num_prompts):
        if config.endpoint == "responses":
            text = " ".join(rng.choice(CHAT_WORDS) for _ in range(config.input_len))
            payloads.append({"model": model, "input": text, "temperature": 0, "stream": True,
                             "max_output_tokens": config.output_len})  # fmt: skip
        elif config.endpoint == "completions":
            ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(config.input_len)]
            payloads.append({**common, "prompt": ids})
        else:
            text = " ".join(rng.choice(CHAT_WORDS) for _ in range(config.input_len))
            payloads.append({**common, "messages": [{"role": "user", "content": text}]})
    return payloads


def arrival_gaps_s(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Wait before each request: 0 for the first, then exponential (Poisson arrivals)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


# ---------------------------------------------------------------------------- driver


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error body, or the start of whatever came back."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:200] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        for key in ("message", "detail"):  # vLLM's older error shape, FastAPI's
            if isinstance(data.get(key), str):
                return str(data[key])
    return json.dumps(data)[:200]


def _chunk_text(chunk: dict[str, Any]) -> str:
    if chunk.get("type") == "response.output_text.delta":  # the Responses API's
        delta = chunk.get("delta")
        return delta if isinstance(delta, str) else ""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text if isinstance(text, str) else ""


async def _read_stream(
    response: httpx.Response, start_s: float, fallback_prompt_tokens: int
) -> RequestRecord:
    """Consume an SSE stream up to `data: [DONE]`; timestamps every chunk with text."""
    times: list[float] = []
    usage: dict[str, Any] = {}
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, `: keep-alive` comments, `event:` lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter()  # on arrival, before parsing, as vLLM stamps chunks
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return _failed(start_s, response.status_code, f"stream chunk is not an object: {data}")
        if isinstance(chunk.get("error"), dict) or chunk.get("type") in (
            "error",
            "response.failed",
        ):
            return _failed(start_s, response.status_code, _error_message(data.encode()))
        if _chunk_text(chunk):
            times.append(now)
        if isinstance(chunk.get("usage"), dict):  # vLLM may repeat it on every chunk
            usage = chunk["usage"]
        if chunk.get("type") in RESPONSES_END:
            ended = chunk.get("response") or {}
            counts = ended.get("usage") or {}
            usage = {"prompt_tokens": counts.get("input_tokens"),
                     "completion_tokens": counts.get("output_tokens")}  # fmt: skip
            done = True
            break
    end_s = time.perf_counter()
    problem = "" if done else "stream ended before `data: [DONE]`"
    if not problem and not times:
        problem = "the stream carried no text"
    if problem:
        return _failed(start_s, response.status_code, problem)
    return RequestRecord(
        start_s=start_s,
        end_s=end_s,
        content_times_s=tuple(times),
        prompt_tokens=int(usage.get("prompt_tokens") or fallback_prompt_tokens),
        completion_tokens=int(usage.get("completion_tokens") or len(times)),
        http_status=response.status_code,
    )


def _failed(start_s: float, status: int | None, message: str) -> RequestRecord:
    return RequestRecord(
        start_s, time.perf_counter(), success=False, http_status=status, error=message
    )


async def send_request(
    client: httpx.AsyncClient, path: str, payload: dict[str, Any], fallback_prompt_tokens: int
) -> RequestRecord:
    """POST one streaming request; any failure becomes a record, never an exception."""
    start_s = time.perf_counter()
    try:
        async with client.stream("POST", path, json=payload) as response:
            if not response.is_success:
                message = _error_message(await response.aread())
                return _failed(start_s, response.status_code, message)
            return await _read_stream(response, start_s, fallback_prompt_tokens)
    except httpx.HTTPError as e:
        return _failed(start_s, None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    except ValueError as e:  # a chunk that is not JSON
        return _failed(start_s, None, f"malformed stream chunk: {e}")


async def resolve_model(client: httpx.AsyncClient, config: ServeBenchConfig) -> str:
    if config.model:
        return config.model
    url = f"{config.base_url}/v1/models"
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if not response.is_success:
        message = _error_message(response.content)
        raise BenchError(f"GET {url} answered {response.status_code}: {message}; pass --model")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {url} listed no model id; pass --model") from None


async def run_requests(config: ServeBenchConfig) -> tuple[str, list[RequestRecord]]:
    """Resolve the model, then send every request; returns (model, records in order)."""
    limits = httpx.Limits(
        max_connections=config.concurrency, max_keepalive_connections=config.concurrency
    )
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(
        base_url=config.base_url,
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(config.timeout_s),
        trust_env=False,  # a benchmark measures the server, not an environment proxy
    ) as client:
        model = await resolve_model(client, config)
        payloads = make_payloads(config, model)
        gaps_s = arrival_gaps_s(len(payloads), config.request_rate, random.Random(config.seed))
        path = ENDPOINT_PATHS[config.endpoint]
        semaphore = asyncio.Semaphore(config.concurrency)

        async def limited(payload: dict[str, Any]) -> RequestRecord:
            async with semaphore:
                return await send_request(client, path, payload, config.input_len)

        tasks = []
        for gap_s, payload in zip(gaps_s, payloads, strict=True):
            if gap_s > 0:
                await asyncio.sleep(gap_s)
            tasks.append(asyncio.create_task(limited(payload)))
        records = list(await asyncio.gather(*tasks))
    logger.debug("model %s: %d requests finished", model, len(records))
    return model, records
