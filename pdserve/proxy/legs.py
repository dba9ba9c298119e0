"""One client request through the proxy: the prefill leg, the decode leg, and every way the
pair can end. The proxy is the only component that sees the client between the legs.

    parse the body (400)
    route (`routing.py`): a request whose prompt the chosen decode node would compute
        fewer than `disagg_min_tokens` of runs whole there, as the decode leg below without
        a handoff; a completion scoring its prompt runs whole on a prefill node; every
        other takes both legs
    prefill leg on the routed prefill node: non-streaming, 1 token, do_remote_decode
        with a release token the proxy mints for this attempt
    client gone now → release the handoff with its release token (S3)
    decode leg on the routed decode node, with the prefill answer's kv_transfer_params,
    always streamed (a non-streaming client's answer is assembled from the stream, so the
    decode timeout bounds the silence between tokens, not the answer's length)
    answer: the decode node's, with usage = prompt and cached tokens of the prefill leg +
    completion tokens of the decode leg (stream and non-stream)

Each attempt of a leg on one node ends in an `attempts.End`; `attempts.CONSEQUENCES` says,
in one table, what the node's health learns, whether the attempt's handoff is let go and
whether another node may take the leg; `_settle` applies it and nothing else here does.
The request's outcome is counted once, where it ends (`_finish`, or the relayed stream).

The client's X-Request-Id (one is minted when it sent none) goes with both legs: nodes list
it with the handoff, echo it and abort by it. An abandoned prefill attempt is released by
that id and the attempt's token, never by waiting for the node to notice: the node cannot
tell an answer that is in flight when the proxy gives up from one that was delivered, and
without the token the proxy cannot name a handoff whose answer it never read. The token,
not the id, picks the handoff: client-chosen ids need not be unique (S14).

A client that leaves is recorded with the `Stage` the proxy was in when it noticed
(`/admin/departures`, `pdserve_proxy_departures_total`): what its cancel hit.

Only vLLM's `kv_transfer_params` fields are needed; `release_token` is used when present
(pdserve nodes), else the node credential.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.errors import PdserveError
from pdserve.openai_api.caller import ClientGone, client_request_id
from pdserve.openai_api.errors import MAX_BODY_BYTES, error_response, from_exception, read_json
from pdserve.openai_api.protocol import scores_prompt
from pdserve.proxy.answers import (
    forward_error,
    merge_usage,
    read_answer,
    relay_stream,
    stream_error,
    streamed,
    upstream_failure,
)
from pdserve.proxy.assembler import StreamAssembler
from pdserve.proxy.attempts import (
    CONSEQUENCES,
    Consequence,
    End,
    Leg,
    end_of_status,
    request_outcome,
)
from pdserve.proxy.batched import route_each, several_prompts
from pdserve.proxy.client import Client, Stage
from pdserve.proxy.pool import Backend, BackendPool
from pdserve.proxy.request import HandoffParams, Held, ProxyRequest
from pdserve.proxy.routing import Prompt
from pdserve.proxy.upstream import Unreachable, UpstreamError, UpstreamResponse
from pdserve.tracing import Span, SpanKind

if TYPE_CHECKING:
    from pdserve.proxy.state import ProxyState

logger = logging.getLogger(__name__)


async def serve_request(state: ProxyState, request: Request, path: str) -> Response:
    body = await _client_body(request)
    if isinstance(body, Response):
        if body.status_code == 499:
            state.record_departure(client_request_id(request.headers), Stage.RECEIVING)
        outcome = "client_gone" if body.status_code == 499 else "bad_request"
        state.metrics.requests.labels(outcome).inc()
        return body
    client = Client(request)
    response: Response = Response(status_code=499)
    try:
        response = await _route(state, client, path, body)
    except ClientGone:
        state.record_departure(client.request_id, client.stage)
        state.metrics.requests.labels("client_gone").inc()
    finally:
        client.close()
        client.span.set("http.response.status_code", response.status_code)
        if not isinstance(response, StreamingResponse):  # else the stream ends the span
            client.span.end()
    return response


async def _route(state: ProxyState, client: Client, path: str, body: dict[str, Any]) -> Response:
    """Both legs, or the decode leg alone (selective disaggregation), or, for a completion
    scoring its prompt, the whole request on a prefill node; a call with several prompts,
    each prompt so."""
    completions = path == "/v1/completions"
    prompts = several_prompts(body) if completions else None
    if prompts is not None:
        return await route_each(state, client, path, body, prompts, _route)
    req = ProxyRequest(state, client, path, body, state.router.prompt(body, chat=not completions))
    if completions and scores_prompt(body):
        # Its prompt's logprobs are the point (lm-eval's loglikelihood: echo, logprobs,
        # max_tokens 0 or 1): prompt work, for a prefill node, and no handoff to make.
        _count_path(req, "prefill_only")
        return await _decode_leg(req, state.prefill)
    decode = state.router.choose(state.decode, req.prompt)
    if decode is not None and state.router.runs_whole(decode, req.prompt):
        _count_path(req, "decode_only")
        return await _decode_leg(req, state.decode, decode)
    _count_path(req, "pd")
    return await _both_legs(req)


def _count_path(req: ProxyRequest, path: str) -> None:
    req.state.metrics.paths.labels(path).inc()
    req.client.span.set("pdserve.path", path)


async def _both_legs(req: ProxyRequest) -> Response:
    prefill = await _prefill_leg(req)
    if isinstance(prefill, Response):
        return prefill
    backend, answer = prefill
    raw = answer.get("kv_transfer_params")
    try:
        params = HandoffParams.model_validate(raw)
    except ValidationError:
        return _finish(req, End.FAILED, error_response(
            502, "the prefill node returned no usable kv_transfer_params", "upstream_error"
        ))  # fmt: skip
    if params.control_url:
        backend.control_url = params.control_url
    req.held = Held(backend, raw, params)
    req.prefill_usage = answer.get("usage") or {}
    req.client.stage = Stage.BETWEEN_LEGS
    if req.state.seams.between_legs_s:
        await asyncio.sleep(req.state.seams.between_legs_s)
    if req.client.gone or await req.client.request.is_disconnected():  # S3: gone between legs
        await req.release_held()
        raise ClientGone
    return await _decode_leg(req, req.state.decode)


def _finish(req: ProxyRequest, end: End, response: Response) -> Response:
    """The request ends here, with `end`: counted once."""
    req.state.metrics.requests.labels(request_outcome(end)).inc()
    return response


async def _settle(
    req: ProxyRequest,
    leg: Leg,
    end: End,
    backend: Backend,
    release: Callable[[], Awaitable[None]],
) -> bool:
    """Apply what `end` of an attempt of `leg` on `backend` means (`attempts.CONSEQUENCES`):
    the node's health, the attempt's handoff let go; True when another node may take it."""
    consequence = _record(req, leg, end, backend)
    if consequence.release:
        await release()
    return consequence.retry


def _record(req: ProxyRequest, leg: Leg, end: End, backend: Backend) -> Consequence:
    """`_settle` but the release, which the caller makes (a stream that ends cannot wait
    for it: anyio cancels every await of a request whose client left)."""
    consequence = CONSEQUENCES[leg, end]
    req.state.metrics.attempts.labels(leg.value, end.value).inc()
    if consequence.leg_ok is not None:
        backend.record_leg(consequence.leg_ok)
    if consequence.node_down:
        backend.record(False)
    return consequence


def _end_of_error(e: Exception) -> End:
    if isinstance(e, ClientGone):
        return End.CLIENT_GONE
    return End.UNREACHABLE if isinstance(e, Unreachable) else End.BROKEN


async def _client_body(request: Request) -> dict[str, Any] | Response:
    """The client's body as a node would read it (size, JSON, nesting: 413/400), or a 499
    when the client left before it arrived (found by `bench chaos`)."""
    try:
        body = await read_json(request, MAX_BODY_BYTES)
    except PdserveError as e:
        return Response(status_code=499) if e.http_status == 499 else from_exception(e)
    return body


# -- the prefill leg ------------------------------------------------------------------------


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, no stream, no grammar (the decode node samples
    every token under it, the first one too: it recomputes the last prompt position for
    it), the same prompt (tools stay in it)."""
    leg = {**body, "max_tokens": 1, "stream": False, "n": 1}  # n samples: the decode leg's
    for name in ("stream_options", "response_format", "structured_outputs", "echo"):
        leg.pop(name, None)  # the decode leg echoes the prompt
    if leg.get("tools"):
        leg["tool_choice"] = "none"
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


async def _prefill_leg(req: ProxyRequest) -> tuple[Backend, dict[str, Any]] | Response:
    """The prefill leg on the routed node, and on others while attempts may move on."""
    state, leg = req.state, _prefill_body(req.body)
    error: Response = error_response(503, "no prefill node is available", "service_unavailable")
    for backend in _attempts(state, state.prefill, req.prompt):
        token = secrets.token_urlsafe(24)
        leg["kv_transfer_params"] = {"do_remote_decode": True, "release_token": token}
        end, status, content = await _prefill_attempt(req, backend, leg)
        if end is End.OK:
            return backend, json.loads(content)
        retry = await _settle(req, Leg.PREFILL, end, backend, _releaser(req, backend, token))
        if end is End.CLIENT_GONE:
            raise ClientGone
        error = forward_error(status, content) if status else upstream_failure(backend, content)
        if not retry:
            break
    return _finish(req, End.FAILED, error)


def _releaser(req: ProxyRequest, backend: Backend, token: str) -> Callable[[], Awaitable[None]]:
    """An abandoned prefill attempt's release, by its token, in the background: it must
    not hold up the retry or the client's answer."""

    async def spawn() -> None:
        req.state.spawn(req.release_attempt(backend, token))

    return spawn


async def _prefill_attempt(
    req: ProxyRequest, backend: Backend, leg: dict[str, Any]
) -> tuple[End, int, Any]:
    """One attempt: (its end, the status (0 when there was none), the content, or the
    error). A good answer is settled here: it counts as cached on the node from now on."""
    state, client = req.state, req.client
    started = time.perf_counter()
    span = _leg_span(client, "prefill leg", backend)
    tokens = state.router.tokens_to_compute(backend, req.prompt, reads_kv=False)
    # Counted as cached there from now on, not from its answer: a prompt sharing this one's
    # prefix that arrives meanwhile follows it, and the node's scheduler computes the
    # shared blocks once (`Scheduler._next_block_in_progress`).
    sent = state.router.sent(backend, req.prompt)
    try:
        payload, headers = json.dumps(leg).encode(), _leg_headers(state, client, span)
        posted = _post(backend, req.path, payload, headers, state.config.prefill_timeout_s, tokens)
        status, content = await client.unless_gone(posted)
        span.set("http.response.status_code", status)
    except (ClientGone, UpstreamError) as e:
        state.router.failed(backend, sent)
        if not isinstance(e, ClientGone):
            logger.warning("prefill leg on %s failed: %s", backend.url, e)
        return _end_of_error(e), 0, e
    finally:
        span.end()
    end = end_of_status(status)
    if end is End.OK:
        state.metrics.leg_seconds.labels("prefill").observe(time.perf_counter() - started)
        await _settle(req, Leg.PREFILL, end, backend, _nothing)
    else:
        state.router.failed(backend, sent)
    return end, status, content


async def _nothing() -> None:
    return None


async def _post(
    backend: Backend,
    path: str,
    payload: bytes,
    headers: dict[str, str],
    timeout_s: float,
    compute_tokens: int,
) -> tuple[int, bytes]:
    response = await backend.post_json(path, payload, headers, timeout_s, compute_tokens)
    try:
        return response.status, await response.read()
    finally:
        response.close()


# -- the decode leg -------------------------------------------------------------------------


async def _decode_leg(
    req: ProxyRequest, pool: BackendPool, first: Backend | None = None
) -> Response:
    """The decode leg (with the held handoff's params), or the whole request on a node of
    `pool` (no handoff); `first`: the node routing already chose."""
    body = req.body if req.held.raw is None else {**req.body, "kv_transfer_params": req.held.raw}
    if not req.body.get("stream"):  # read as a stream all the same: see `_decode_answer`
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    payload = json.dumps(body).encode()
    req.client.stage = Stage.DECODE
    for backend in _attempts(req.state, pool, req.prompt, first):
        started = time.perf_counter()
        end, got = await _decode_attempt(req, backend, payload)
        retry = await _settle(req, Leg.DECODE, end, backend, req.release_held)
        if end is End.OK:
            return await _answer(req, backend, got, started)
        if end is End.CLIENT_GONE:
            raise ClientGone
        if not retry:
            return _finish(req, end, got)
    await req.release_held()
    return _finish(req, End.UNREACHABLE, error_response(
        503, f"no {pool.role} node is available", "service_unavailable"
    ))  # fmt: skip


async def _decode_attempt(req: ProxyRequest, backend: Backend, payload: bytes) -> tuple[End, Any]:
    """One attempt: (its end, the response with its head (OK), or the client's error)."""
    state, client = req.state, req.client
    tokens = state.router.tokens_to_compute(backend, req.prompt, reads_kv=req.held.raw is not None)
    span = _leg_span(client, "decode leg", backend)
    try:
        send = backend.post_json(req.path, payload, _leg_headers(state, client, span),
                                 state.config.decode_timeout_s, tokens)  # fmt: skip
        response = await client.unless_gone(send)
        span.set("http.response.status_code", response.status)
    except (ClientGone, UpstreamError) as e:
        span.end()
        if isinstance(e, Unreachable):
            logger.warning("%s node unreachable: %s", backend.role, e)
        return _end_of_error(e), None if isinstance(e, ClientGone) else upstream_failure(backend, e)
    if response.status != 200:
        span.end()
        return end_of_status(response.status), await _error_of(response)
    state.router.sent(backend, req.prompt)
    return End.OK, (response, span)


async def _error_of(response: UpstreamResponse) -> Response:
    """An error status from the decode node, forwarded as it came."""
    try:
        content = await response.read()
    except UpstreamError:
        content = b""
    finally:
        response.close()
    return forward_error(response.status, content)


async def _answer(
    req: ProxyRequest, backend: Backend, got: tuple[UpstreamResponse, Span], started: float
) -> Response:
    """The decode node's 200: relayed as it streams, or one answer assembled from it."""
    response, span = got
    state, client = req.state, req.client
    if req.body.get("stream"):

        def settle(end: End) -> None:
            if _record(req, Leg.ANSWER, end, backend).release:
                state.spawn(req.release_held())

        relay = relay_stream(state, client, response, req.prefill_usage, started, span, settle)
        return StreamingResponse(
            relay, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        return await _decode_answer(req, backend, response, started)
    finally:
        span.end()


async def _decode_answer(
    req: ProxyRequest, backend: Backend, response: UpstreamResponse, started: float
) -> Response:
    """A non-streaming client's answer, assembled from the decode leg's stream: the
    decode timeout then bounds the silence between tokens, so a long answer that keeps
    coming is never cut, and a node that stops producing is (504)."""
    state, client = req.state, req.client
    client.stage = Stage.STREAMING if streamed(response) else Stage.ANSWER
    try:
        data = await client.unless_gone(read_answer(response))
    except ClientGone:
        await _settle(req, Leg.ANSWER, End.CLIENT_GONE, backend, req.release_held)
        raise
    except UpstreamError as e:
        await _settle(req, Leg.ANSWER, End.BROKEN, backend, req.release_held)
        return _finish(req, End.BROKEN, upstream_failure(backend, e))
    finally:
        response.close()
    state.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - started)
    if isinstance(data, StreamAssembler):  # the node gave up mid-stream (drain, operator)
        await _settle(req, Leg.ANSWER, End.FAILED, backend, req.release_held)
        return _finish(req, End.FAILED, stream_error(data.error or {}))
    if isinstance(data.get("usage"), dict):
        data["usage"] = merge_usage(req.prefill_usage, data["usage"])
    await _settle(req, Leg.ANSWER, End.OK, backend, req.release_held)
    return _finish(req, End.OK, JSONResponse(data))


# -- helpers --------------------------------------------------------------------------------


def _leg_headers(state: ProxyState, client: Client, span: Span) -> dict[str, str]:
    return {**state.node_headers, "x-request-id": client.request_id, **span.headers()}


def _leg_span(client: Client, name: str, backend: Backend) -> Span:
    span = client.span.child(name, SpanKind.CLIENT)
    span.set("pdserve.node", backend.url)
    return span


def _attempts(
    state: ProxyState, pool: BackendPool, prompt: Prompt | None, first: Backend | None = None
) -> Iterator[Backend]:
    """The nodes to try for one leg, routed (`first` when routing already chose), each at
    most once; every one after the first counts as a retry."""
    tried: set[str] = set()
    policy = state.router.policies[pool.role].value
    while (backend := first or state.router.choose(pool, prompt, tried)) is not None:
        first = None
        if tried:
            state.metrics.retries.labels(pool.role).inc()
        state.metrics.routed.labels(pool.role, policy).inc()
        tried.add(backend.url)
        yield backend
