"""`pdserve proxy`: the OpenAI API in front of prefill and decode nodes.

Life of the proxy: start (the model's tokenizer is loaded for routing; health checks and
prefix-summary polls begin; every node is presumed up until checks or calls say
otherwise) → serve: each completion passes admission (`admission.py`: 429 beyond
capacity), is routed (`routing.py`) and runs its legs (`legs.py`) →
SIGINT/SIGTERM: stop accepting, let uvicorn close connections (open streams are closed,
which aborts their decode legs), stop the health checks, close the connection pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

import httpx
import uvicorn
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve import logs
from pdserve.agent_api import messages as messages_api
from pdserve.agent_api import responses as responses_api
from pdserve.agent_api.messages import MESSAGES_PATH, MessagesAPI, anthropic_error
from pdserve.agent_api.responses import ResponsesAPI
from pdserve.errors import PdserveError
from pdserve.heap import freeze_startup_objects
from pdserve.openai_api.auth import key_matches
from pdserve.openai_api.errors import (
    ERROR_HANDLERS,
    MAX_BODY_BYTES,
    error_response,
    from_exception,
    read_json,
)
from pdserve.openai_api.openapi import openapi_document
from pdserve.parent_watch import ParentWatch
from pdserve.proxy.admission import AdmissionGate
from pdserve.proxy.legs import serve_request
from pdserve.proxy.membership import Membership
from pdserve.proxy.pool import BreakerState, check_health
from pdserve.proxy.state import ProxyState
from pdserve.tls import warn_if_exposed

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics", "/openapi.json")


def create_proxy_app(state: ProxyState) -> Starlette:
    async def completions(request: Request) -> Response:
        return await serve_request(state, request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await serve_request(state, request, "/v1/chat/completions")

    # The agent APIs run each request as a chat completion through the legs (`agent_api/`).
    responses = ResponsesAPI(chat_completions, state.config.response_store, state.admission.slot)
    state.closers.append(responses.close)

    async def pass_through(request: Request) -> Response:
        return await _pass_through(state, request)

    async def health(request: Request) -> Response:
        counts = {"num_prefill_up": state.prefill.num_up, "num_decode_up": state.decode.num_up}
        ok = counts["num_prefill_up"] > 0 and counts["num_decode_up"] > 0
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", **counts}, status_code=200 if ok else 503
        )

    async def metrics(request: Request) -> Response:
        m = state.metrics
        for pool in (state.prefill, state.decode):
            for b in pool.backends:
                m.backend_up.labels(b.role, b.url).set(int(b.up))
                m.backend_outstanding.labels(b.role, b.url).set(b.num_outstanding)
                open_ = b.breaker.state is not BreakerState.CLOSED
                m.backend_breaker_open.labels(b.role, b.url).set(int(open_))
                m.backend_cached_blocks.labels(b.role, b.url).set(len(b.cached.hashes))
                m.malformed_summaries.labels(b.role, b.url).set(b.malformed_summaries)
        m.waiting.set(state.admission.num_waiting)
        m.in_flight.set(state.admission.line.in_flight)
        return Response(
            generate_latest(state.metrics.registry),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    async def departures(request: Request) -> Response:
        return JSONResponse({"departures": list(state.departures)})

    async def openapi(request: Request) -> Response:
        described = {**responses_api.OPENAPI, **messages_api.OPENAPI}
        doc = openapi_document(request.app.routes, "pdserve proxy", OPEN_PATHS, described)
        return JSONResponse(doc)

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            *responses.routes(),
            *MessagesAPI(chat_completions).routes(),
            Route("/v1/models", pass_through, methods=["GET"]),
            Route("/tokenize", pass_through, methods=["POST"]),
            Route("/detokenize", pass_through, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/departures", departures, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        lifespan=functools.partial(_lifespan, state),
        exception_handlers=ERROR_HANDLERS,
    )
    reject, wait = state.metrics.rejected.labels, state.metrics.queue_wait_seconds
    app.add_middleware(
        AdmissionGate,
        admission=state.admission,
        on_reject=lambda reason: reject(reason).inc(),
        on_admit=wait.observe,
    )
    app.add_middleware(BearerAuth, api_key=state.config.api_key)  # outermost: 401 before 429
    return app


async def _pass_through(state: ProxyState, request: Request) -> Response:
    """`GET /v1/models`, `POST /tokenize`, `POST /detokenize`: one node's answer (every
    node serves the same model), passed through with the node credential."""
    backend = state.decode.choose() or state.prefill.choose()
    if backend is None:
        return error_response(503, "no node is available", "service_unavailable")
    try:
        body = await read_json(request, MAX_BODY_BYTES) if request.method == "POST" else None
        response = await state.http.request(
            request.method,
            f"{backend.url}{request.url.path}",
            json=body,
            headers=state.node_headers,
            timeout=30.0,
        )
    except PdserveError as e:
        return from_exception(e)
    except httpx.HTTPError as e:
        return error_response(502, f"node {backend.url}: {type(e).__name__}", "upstream_error")
    return Response(response.content, response.status_code, media_type="application/json")


@contextlib.asynccontextmanager
async def _lifespan(state: ProxyState, app: Starlette) -> AsyncIterator[None]:
    """The shared HTTP client and the health checks live as long as the app."""
    freeze_startup_objects()
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512)
    state.http = httpx.AsyncClient(limits=limits, verify=state.node_ssl)
    pools = [state.prefill, state.decode]
    summaries = state.router.reads_prompts
    checker = asyncio.create_task(
        check_health(
            pools, state.http, state.config.health_interval_s, state.node_headers, summaries
        )
    )
    follower = None
    if state.membership is not None:
        follower = asyncio.create_task(_follow(state, state.membership))
    try:
        yield
    finally:
        checker.cancel()
        if follower is not None:
            follower.cancel()
        for close in state.closers:  # before the legs' client closes: they may abort legs
            await close()
        if state.background:  # each release gives up after 2 s
            await asyncio.wait(set(state.background), timeout=5.0)
        await state.http.aclose()
        for pool in pools:
            for backend in pool.backends:
                backend.upstream.close()


async def _follow(state: ProxyState, membership: Membership) -> None:
    """Forever: the pools follow the discovery source, every health interval."""
    while True:
        try:
            members = await membership.members()
        except Exception as e:  # a source that fails keeps the last membership
            logger.warning("node discovery failed: %s", e)
            members = None
        if members is not None:
            state.prefill.set_members(members.get("prefill", []))
            state.decode.set_members(members.get("decode", []))
        await asyncio.sleep(state.config.health_interval_s)


class BearerAuth:
    """Clients need `Authorization: Bearer KEY` when the proxy has a key (constant-time)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            if not key_matches(*given, self.api_key):
                message = "invalid or missing API key"
                response = (
                    anthropic_error(401, message)
                    if scope["path"] == MESSAGES_PATH
                    else error_response(401, message, "authentication_error")
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def run_proxy(state: ProxyState) -> None:
    """Serve until SIGINT/SIGTERM (or, with `parent_pid`, until that process is gone)."""
    config = state.config
    server = uvicorn.Server(proxy_uvicorn_config(state))
    prefill, decode = list(config.prefill_urls), list(config.decode_urls)
    warn_if_exposed(config.host, config.tls, "the proxy")
    logger.info(
        "proxy on %s://%s:%d: prefill %s, decode %s",
        config.tls.scheme,
        config.host,
        config.port,
        prefill,
        decode,
    )
    watcher = None
    if config.parent_pid is not None:
        stop = functools.partial(setattr, server, "should_exit", True)
        watcher = asyncio.create_task(ParentWatch(config.parent_pid).stop_when_gone(stop, "proxy"))
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()


def proxy_uvicorn_config(state: ProxyState) -> uvicorn.Config:
    return uvicorn.Config(
        create_proxy_app(state),
        host=state.config.host,
        port=state.config.port,
        log_level=logs.uvicorn_level(),
        timeout_graceful_shutdown=2,
        **state.config.tls.uvicorn_options(),
    )
