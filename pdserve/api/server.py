"""The OpenAI-compatible HTTP server of one node.

Life of a request: parse and validate the body (400 on any bad field) → mint ids
(`cmpl-…`; the client's X-Request-Id is only echoed, never used as a key) → send it to the
engine process → stream SSE chunks or wait for the final output. If the client goes away
first, leaving the output iterator aborts the request in the engine (blocks freed within
one engine step). The first engine message is awaited before a streaming 200 is
committed, so engine-side rejections (prompt too long, …) reach the client as 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.errors import error_body, error_response, from_exception
from pdserve.api.metrics import MetricsRecorder
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.responses import ChoiceBuilder
from pdserve.engine.async_client import AsyncEngineClient
from pdserve.errors import InvalidRequestError, PdserveError, StatusError
from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = ("/health", "/metrics")


class ServerState:
    def __init__(self, client: AsyncEngineClient, api_key: str | None, model_name: str) -> None:
        self.client = client
        self.api_key = api_key
        self.model_name = model_name
        self.ready = False
        self.draining = False
        self.num_inflight = 0
        """HTTP requests whose handling (streams included) has not ended."""
        self.started_s = time.time()
        self.metrics = MetricsRecorder(model_name)


def create_app(state: ServerState) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _serve(state, request, CompletionRequest, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, ChatCompletionRequest, chat=True)

    async def models(request: Request) -> Response:
        card = {"id": state.model_name, "object": "model", "created": int(state.started_s),
                "owned_by": "pdserve", "max_model_len": state.client.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if not state.ready or state.draining or state.client.dead:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        body = state.metrics.render(state.client.stats)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def admin_kv(request: Request) -> Response:
        s = state.client.stats
        return JSONResponse({
            "num_blocks": s.num_blocks, "num_free_blocks": s.num_free_blocks,
            "num_held_blocks": s.num_held_blocks, "num_running": s.num_running,
            "num_waiting": s.num_waiting, "num_preemptions": s.num_preemptions,
        })  # fmt: skip

    app = Starlette(
        middleware=[Middleware(EdgeMiddleware, state=state)],
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/kv", admin_kv, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
    )
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _not_allowed)
    app.add_exception_handler(Exception, _internal_error)
    return app


class EdgeMiddleware:
    """Pure ASGI middleware: bearer-key check (constant time), X-Request-Id echo, and the
    in-flight count the drain waits on (a request leaves it when its ASGI call returns:
    response fully sent, or the client gone).

    Pure ASGI rather than BaseHTTPMiddleware so request bodies, streaming responses and
    disconnect messages pass through untouched.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        key = self.state.api_key
        if key and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                response = error_response(401, "invalid or missing API key", "authentication_error")
                await response(scope, receive, send)
                return
        request_id = headers.get("x-request-id", b"")[:256]

        async def send_with_id(message: Message) -> None:
            if request_id and message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        self.state.num_inflight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.state.num_inflight -= 1


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route {request.url.path}", "not_found_error")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} not allowed here", "invalid_request_error")


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error on %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "internal_error")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    too_large = StatusError(
        f"body larger than {MAX_BODY_BYTES} bytes", status=413, error_type="invalid_request_error"
    )
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit():
        raise InvalidRequestError("bad Content-Length header")
    if int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > MAX_BODY_BYTES:
            raise too_large
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequestError("body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise InvalidRequestError(f"{where}: {first['msg']}", param=param) from e


async def _serve(
    state: ServerState, request: Request, model: type[BaseModel], chat: bool
) -> Response:
    if not state.ready or state.draining:
        return error_response(503, "the server is starting or draining", "service_unavailable")
    try:
        body = await _parse(request, model)
        if body.model not in (None, state.model_name):
            raise StatusError(
                f"model {body.model!r} does not exist", status=404, error_type="not_found_error"
            )
        builder = ChoiceBuilder.for_request(body, chat, state.model_name)
        kwargs = _engine_inputs(body, chat)
        outputs = state.metrics.track(
            state.client.generate(builder.request_id, builder.params, **kwargs)
        )
        first = await _first_or_disconnect(request, outputs)
    except PdserveError as e:
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    if first is None:  # client left before anything was produced
        return Response(status_code=499)
    if body.stream:
        # A streaming response only notices a gone client when its next write fails, one
        # token later; this watcher aborts as soon as the disconnect message arrives.
        watcher = asyncio.create_task(
            _abort_on_disconnect(request, state.client, builder.request_id)
        )
        return StreamingResponse(
            _sse(builder, first, outputs), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"}, background=BackgroundTask(watcher.cancel),
        )  # fmt: skip
    try:
        final = await _last_or_disconnect(request, first, outputs)
    except PdserveError as e:  # e.g. the engine process died mid-request
        return from_exception(e)
    if final is None:
        return Response(status_code=499)
    return JSONResponse(builder.full_response(final))


def _engine_inputs(body: Any, chat: bool) -> dict[str, Any]:
    if chat:
        return {"messages": body.chat_messages()}
    return {"prompt": body.single_prompt()}


async def _first_or_disconnect(
    request: Request, outputs: AsyncIterator[RequestOutput]
) -> RequestOutput | None:
    return await _race_disconnect(request, outputs.__anext__(), outputs)


async def _last_or_disconnect(
    request: Request, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
) -> RequestOutput | None:
    async def drain() -> RequestOutput:
        last = first
        while not last.finished:
            last = await outputs.__anext__()
        return last

    return await _race_disconnect(request, drain(), outputs)


async def _race_disconnect(
    request: Request, work: Awaitable[RequestOutput], outputs: AsyncIterator[RequestOutput]
) -> RequestOutput | None:
    """Await `work` unless the client disconnects first; then close `outputs` (abort)."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(_wait_disconnect(request))
    done, _ = await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    gone_task.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await work_task
    await outputs.aclose()  # type: ignore[attr-defined]
    return None


async def _abort_on_disconnect(
    request: Request, client: AsyncEngineClient, request_id: str
) -> None:
    await _wait_disconnect(request)
    await client.abort([request_id])  # idempotent: the stream's own cleanup aborts again


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse(
    builder: ChoiceBuilder, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
) -> AsyncIterator[str]:
    """SSE chunks; closing this generator (client gone) closes `outputs`, which aborts.

    An error after the 200 was committed (the engine died) is sent as a final
    `data: {"error": ...}` event, as vLLM does, instead of a silently cut stream."""
    try:
        output = first
        while True:
            for chunk in builder.stream_chunks(output):
                yield f"data: {json.dumps(chunk)}\n\n"
            if output.finished:
                break
            output = await outputs.__anext__()
        usage = builder.usage_chunk()
        if usage is not None:
            yield f"data: {json.dumps(usage)}\n\n"
    except PdserveError as e:
        yield f"data: {json.dumps(error_body(e))}\n\n"
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
