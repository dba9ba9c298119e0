"""One client request through the proxy: the prefill leg, the decode leg, and every way the
pair can end. The proxy is the only component that sees the client between the legs.

    parse the body (400)
    route (`routing.py`): a request whose prompt the chosen decode node would compute
        fewer than `disagg_min_tokens` of runs whole there, as the decode leg below without
        a handoff; every other takes both legs
    prefill leg on the routed prefill node: non-streaming, 1 token, do_remote_decode
        with a release token the proxy mints for this attempt
        client gone → the leg is cancelled and released by its token (S1/S2)
        timeout, broken connection → released by its token; a fresh attempt on another
            prefill node (S17/S19), as after a 5xx or an unreachable node
        4xx → the same error to the client
    client gone now → release the handoff with its release token (S3)
    decode leg on the routed decode node, with the prefill answer's kv_transfer_params,
    always streamed (a non-streaming client's answer is assembled from the stream, so the
    decode timeout bounds the silence between tokens, not the answer's length)
        unreachable → another decode node (the handoff is still held), else release + 503
        any other failure (an error status, a broken or silent stream) → release + the same
            error (504 for silence); the status is checked before a streaming 200 is committed
        client gone → close the decode leg (the decode node releases or frees: S5/S7) and
            release (a no-op if the decode node already read the blocks)
    answer: the decode node's, with usage = prompt and cached tokens of the prefill leg +
    completion tokens of the decode leg (stream and non-stream)

The client's X-Request-Id (one is minted when it sent none) goes with both legs: nodes list
it with the handoff, echo it and abort by it. An abandoned prefill attempt is released by
that id and the attempt's token, never by waiting for the node to notice: the node cannot
tell an answer that is in flight when the proxy gives up from one that was delivered, and
without the token the proxy cannot name a handoff whose answer it never read. The token,
not the id, picks the handoff: client-chosen ids need not be unique (S14).

Each leg's outcome feeds its node's circuit breaker (`pool.py`): a 5xx, a timeout or a
broken connection counts against it, any other answer for it.

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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.errors import PdserveError
from pdserve.openai_api.caller import (
    ClientGone,
    client_request_id,
)
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
from pdserve.proxy.batched import route_each, several_prompts
from pdserve.proxy.client import Client, Stage
from pdserve.proxy.pool import Backend, BackendPool
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
    that asks for its prompt's logprobs, the whole request on a prefill node; a call with
    several prompts, each prompt so."""
    completions = path == "/v1/completions"
    prompts = several_prompts(body) if completions else None
    if prompts is not None:
        return await route_each(state, client, path, body, prompts, _route)
    prompt = state.router.prompt(body, chat=not completions)
    if completions and scores_prompt(body):
        # Its prompt's logprobs are the point (lm-eval's loglikelihood: echo, logprobs,
        # max_tokens 0 or 1): prompt work, for a prefill node, and no handoff to make.
        state.metrics.paths.labels("prefill_only").inc()
        client.span.set("pdserve.path", "prefill_only")
        return await _decode_leg(state, client, path, body, _Held(), {}, prompt, None,
                                 state.prefill)  # fmt: skip
    decode = state.router.choose(state.decode, prompt)
    if decode is not None and state.router.runs_whole(decode, prompt):
        state.metrics.paths.labels("decode_only").inc()
        client.span.set("pdserve.path", "decode_only")
        return await _decode_leg(state, client, path, body, _Held(), {}, prompt, decode)
    state.metrics.paths.labels("pd").inc()
    client.span.set("pdserve.path", "pd")
    prefill = await _prefill_leg(state, client, path, body, prompt)
    if isinstance(prefill, Response):
        return prefill
    backend, answer = prefill
    kv = answer.get("kv_transfer_params")
    if not isinstance(kv, dict):
        state.metrics.requests.labels("upstream_error").inc()
        return error_response(
            502, "the prefill node returned no kv_transfer_params", "upstream_error"
        )
    if isinstance(kv.get("control_url"), str):
        backend.control_url = kv["control_url"]
    client.stage = Stage.BETWEEN_LEGS
    if state.seams.between_legs_s:
        await asyncio.sleep(state.seams.between_legs_s)
    held = _Held(state, backend, kv)
    if client.gone or await client.request.is_disconnected():  # S3: gone between the legs
        await held.release()
        raise ClientGone
    usage = answer.get("usage") or {}
    return await _decode_leg(state, client, path, body, held, usage, prompt, None)


async def _client_body(request: Request) -> dict[str, Any] | Response:
    """The client's body as a node would read it (size, JSON, nesting: 413/400), or a 499
    when the client left before it arrived (found by `bench chaos`)."""
    try:
        body = await read_json(request, MAX_BODY_BYTES)
    except PdserveError as e:
        return Response(status_code=499) if e.http_status == 499 else from_exception(e)
    return body


# -- the prefill leg ------------------------------------------------------------------------


async def _prefill_leg(
    state: ProxyState, client: Client, path: str, body: dict[str, Any], prompt: Prompt | None
) -> tuple[Backend, dict[str, Any]] | Response:
    leg = {**body, "max_tokens": 1, "stream": False, "n": 1}  # n samples: the decode leg's
    leg.pop("stream_options", None)
    # No grammar work on the prefill node (structured outputs, a forced tool choice): the
    # decode node samples every token under it, the first one too (it recomputes the last
    # prompt position for it).
    leg.pop("response_format", None)
    leg.pop("structured_outputs", None)
    leg.pop("echo", None)  # the decode leg echoes the prompt
    if leg.get("tools"):
        leg["tool_choice"] = "none"  # the same prompt (tools stay in it), no grammar
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    last_error: Response = error_response(
        503, "no prefill node is available", "service_unavailable"
    )
    for backend in _attempts(state, state.prefill, prompt):
        token = secrets.token_urlsafe(24)
        leg["kv_transfer_params"] = {"do_remote_decode": True, "release_token": token}
        started = time.perf_counter()
        span = _leg_span(client, "prefill leg", backend)
        try:
            payload = json.dumps(leg).encode()
            headers = _leg_headers(state, client, span)
            tokens = state.router.tokens_to_compute(backend, prompt, reads_kv=False)
            # Counted as cached there from now on, not from its answer: a prompt sharing
            # this one's prefix that arrives meanwhile follows it, and the node's scheduler
            # computes the shared blocks once (`Scheduler._next_block_in_progress`).
            sent = state.router.sent(backend, prompt)
            status, content = await client.unless_gone(
                _post(backend, path, payload, headers, state.config.prefill_timeout_s, tokens)
            )
            span.set("http.response.status_code", status)
        except (ClientGone, UpstreamError) as e:
            state.router.failed(backend, sent)
            if not isinstance(e, Unreachable):  # it may have reached the node: let it go
                state.spawn(release(state, backend, client.request_id, token))
            if isinstance(e, ClientGone):
                raise
            backend.record_leg(False)
            if isinstance(e, Unreachable):
                backend.record(False)
            logger.warning("prefill leg on %s failed: %s", backend.url, e)
            last_error = upstream_failure(backend, e)
            continue
        finally:
            span.end()
        state.metrics.leg_seconds.labels("prefill").observe(time.perf_counter() - started)
        backend.record_leg(status < 500)
        if status == 200:
            return backend, json.loads(content)
        state.router.failed(backend, sent)
        last_error = forward_error(status, content)
        if status < 500:
            break  # the request itself is at fault: another node would say the same
    state.metrics.requests.labels("upstream_error").inc()
    return last_error


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


class _Held:
    """The handoff a decode leg reads, let go if the leg will not (none: a request that
    runs whole on the decode node)."""

    def __init__(
        self,
        state: ProxyState | None = None,
        prefill: Backend | None = None,
        kv: dict[str, Any] | None = None,
    ) -> None:
        self.state, self.prefill, self.kv = state, prefill, kv

    async def release(self) -> None:
        if self.state is not None and self.prefill is not None and self.kv is not None:
            await release_handoff(self.state, self.prefill, self.kv)


async def _decode_leg(
    state: ProxyState,
    client: Client,
    path: str,
    body: dict[str, Any],
    held: _Held,
    prefill_usage: dict[str, Any],
    prompt: Prompt | None,
    first: Backend | None,
    pool: BackendPool | None = None,
) -> Response:
    """The decode leg (with `held.kv`), or the whole request on a node of `pool` (the
    decode nodes unless named; without `held.kv`); `first`: the node routing already
    chose."""
    leg = {**body} if held.kv is None else {**body, "kv_transfer_params": held.kv}
    if not body.get("stream"):  # read as a stream all the same: see `_decode_answer`
        leg.update(stream=True, stream_options={"include_usage": True})
    payload = json.dumps(leg).encode()
    client.stage = Stage.DECODE
    for backend in _attempts(state, pool or state.decode, prompt, first):
        started = time.perf_counter()
        tokens = state.router.tokens_to_compute(backend, prompt, reads_kv=held.kv is not None)
        span = _leg_span(client, "decode leg", backend)
        try:
            send = backend.post_json(
                path,
                payload,
                _leg_headers(state, client, span),
                state.config.decode_timeout_s,
                tokens,
            )
            response = await client.unless_gone(send)
            span.set("http.response.status_code", response.status)
        except (ClientGone, UpstreamError) as e:
            span.end()
            if not isinstance(e, ClientGone):
                backend.record_leg(False)
            if isinstance(e, Unreachable):
                logger.warning("%s node unreachable: %s", backend.role, e)
                backend.record(False)
                continue  # never reached the node: the handoff is still held for another
            await held.release()
            if isinstance(e, ClientGone):
                raise
            state.metrics.requests.labels("upstream_error").inc()
            return upstream_failure(backend, e)
        backend.record_leg(response.status < 500)
        if response.status != 200:
            span.end()
            return await _decode_refused(state, response, held)
        state.router.sent(backend, prompt)
        if body.get("stream"):
            relay = relay_stream(state, client, backend, response, prefill_usage, started, span)
            return StreamingResponse(
                relay, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            return await _decode_answer(
                state, client, backend, response, held, prefill_usage, started
            )
        finally:
            span.end()
    await held.release()
    state.metrics.requests.labels("upstream_error").inc()
    role = (pool or state.decode).role
    return error_response(503, f"no {role} node is available", "service_unavailable")


async def _decode_refused(state: ProxyState, response: UpstreamResponse, held: _Held) -> Response:
    """An error status from the decode node: released, and forwarded as it came."""
    try:
        content = await response.read()
    except UpstreamError:
        content = b""
    finally:
        response.close()
    await held.release()
    state.metrics.requests.labels("upstream_error").inc()
    return forward_error(response.status, content)


async def _decode_answer(
    state: ProxyState,
    client: Client,
    backend: Backend,
    response: UpstreamResponse,
    held: _Held,
    prefill_usage: dict[str, Any],
    started: float,
) -> Response:
    """A non-streaming client's answer, assembled from the decode leg's stream: the
    decode timeout then bounds the silence between tokens, so a long answer that keeps
    coming is never cut, and a node that stops producing is (504). A leg that failed,
    stalled or broke releases its handoff: the node may never get to (a no-op once read)."""
    client.stage = Stage.STREAMING if streamed(response) else Stage.ANSWER
    try:
        data = await client.unless_gone(read_answer(response))
    except UpstreamError as e:
        backend.record_leg(False)
        await held.release()
        state.metrics.requests.labels("upstream_error").inc()
        return upstream_failure(backend, e)
    finally:
        response.close()
    state.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - started)
    if isinstance(data, StreamAssembler):  # the node gave up mid-stream (drain, operator)
        state.metrics.requests.labels("upstream_error").inc()
        return stream_error(data.error or {})
    if isinstance(data.get("usage"), dict):
        data["usage"] = merge_usage(prefill_usage, data["usage"])
    state.metrics.requests.labels("ok").inc()
    return JSONResponse(data)


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


async def release_handoff(state: ProxyState, backend: Backend, kv: dict[str, Any]) -> None:
    """Let go of a handoff the proxy will not use, named by the prefill answer's params: a
    pdserve node's handoff id is `remote_request_id`; a vLLM node's connector names its
    own (`handoff_id`, with its `control_url`)."""
    handoff_id = kv.get("handoff_id") or kv.get("remote_request_id")
    if handoff_id:
        await release(state, backend, handoff_id, kv.get("release_token"))


async def release(state: ProxyState, backend: Backend, request_id: str, token: str | None) -> None:
    """Release what `request_id` names on a prefill node (a handoff id, or a leg's
    X-Request-Id): by its release token, else with the node key (a node that mints no
    tokens). Refused when the node does not know it (the leg never arrived, or has ended),
    which is fine: nothing of it is held. A vLLM node takes it at its connector's endpoint
    (`Backend.control_url`); a stock vLLM node has none, and its own lease frees it."""
    body: dict[str, Any] = {"request_ids": [request_id]}
    if token:
        body["release_token"] = token
    state.metrics.releases.inc()
    url = backend.control_url or backend.url
    try:
        await state.http.post(
            f"{url}/v1/abort_requests", json=body, headers=state.node_headers, timeout=2.0
        )
    except httpx.HTTPError as e:  # its lease frees it
        logger.warning("release of %s on %s failed: %s", request_id, url, e)
