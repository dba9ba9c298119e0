"""The OpenAI-compatible HTTP server of one node.

Life of a request: parse and validate the body (400 on any bad field) → mint ids
(`cmpl-…`; the client's X-Request-Id is echoed, and usable to abort, but never a key) →
send it to the engine process → stream SSE chunks or wait for the final output. If the
client goes away first, leaving the output iterator aborts the request in the engine
(blocks freed within one engine step). The first engine message is awaited before a
streaming 200 is committed, so engine-side rejections (prompt too long, …) reach the client
as 4xx. A request the server itself aborts is an error, never a short completion: 503 when
a drain gave up on it (`ServerShuttingDownError`), 409 when an operator aborted it
(`RequestAbortedError`); a stream that already sent tokens ends with that error as its
last event, then `[DONE]`.

P/D legs (`kv_transfer_params`) take the same path with two additions:
- a prefill leg (prefill node, `do_remote_decode`) runs for exactly one token, and its
  answer carries the handoff that now pins the prompt's KV (`_serve_prefill_leg`);
- a decode leg (decode node, `do_remote_prefill`) rejected before the engine admitted it
  releases its handoff on the prefill node at once (S4); after admission the engine's
  connector owns that handoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict, replace
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.auth import bearer_matches
from pdserve.api.disagg_routes import disagg_routes
from pdserve.api.errors import (
    ERROR_HANDLERS,
    MAX_BODY_BYTES,
    error_body,
    error_response,
    from_exception,
    read_json,
)
from pdserve.api.metrics import MetricsRecorder
from pdserve.api.openapi import openapi_document
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.responses import ChoiceBuilder
from pdserve.disagg.control import ControlClient, ControlError
from pdserve.disagg.handoff_service import HandoffService
from pdserve.disagg.params import (
    KVTransferParams,
    RemoteDecode,
    RemotePrefill,
    remote_decode_from,
    remote_prefill_from,
)
from pdserve.engine.async_client import AsyncEngineClient
from pdserve.errors import InvalidRequestError, PdserveError, RequestAbortedError, StatusError
from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics", "/openapi.json")
SELF_AUTHENTICATED_PATHS = ("/v1/abort_requests",)
"""Admin key or a release token, checked by the route (`disagg_routes`)."""


class LiveRequests:
    """Requests being served, by server id and by X-Request-Id (for the abort API)."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[str]] = {}

    def add(self, request_id: str, client_request_id: str) -> None:
        for key in {request_id, client_request_id} - {""}:
            self._by_key.setdefault(key, set()).add(request_id)

    def remove(self, request_id: str, client_request_id: str) -> None:
        for key in {request_id, client_request_id} - {""}:
            ids = self._by_key.get(key, set())
            ids.discard(request_id)
            if not ids:
                self._by_key.pop(key, None)

    def resolve(self, key: str) -> set[str]:
        return set(self._by_key.get(key, ()))

    def request_ids(self) -> set[str]:
        """Server ids of every request being served."""
        return {i for ids in self._by_key.values() for i in ids}


class ServerState:
    def __init__(
        self,
        client: AsyncEngineClient,
        api_key: str | None,
        model_name: str,
        role: str = "both",
        cluster_secret: str | None = None,
    ) -> None:
        self.client = client
        self.api_key = api_key
        self.model_name = model_name
        self.role = role
        self.cluster_secret = cluster_secret or api_key
        """Credential for node-to-node calls, both ways (`/kv/*`, releases)."""
        self.handoffs: HandoffService | None = None
        """Prefill nodes: the handoff table and its service (set by `run_server`)."""
        self.live = LiveRequests()
        self.unloaded_decode_legs: set[str] = set()
        """Decode legs without a first output yet: a decode node's drain aborts them."""
        self._control: ControlClient | None = None
        self.ready = False
        self.draining = False
        self.num_inflight = 0
        """HTTP requests whose handling (streams included) has not ended."""
        self.started_s = time.time()
        self.debug_step_delay_s = 0.0
        """Testing only: a pause before each engine output is used (a slow decode)."""
        self.metrics = MetricsRecorder(model_name)
        client.on_transfers = self.metrics.record_transfers

    async def release_rejected(self, remote: RemotePrefill) -> None:
        """A decode leg refused before admission: its handoff goes back at once (S4)."""
        if self._control is None:  # one pooled client: a new one costs ~30 ms (TLS setup)
            self._control = ControlClient(self.cluster_secret)
        try:
            await asyncio.to_thread(
                self._control.release, remote.control_url, remote.ref, "rejected"
            )
        except ControlError as e:
            logger.warning(
                "could not release handoff %s: %s (its lease frees it)", remote.ref.handoff_id, e
            )


def _compute(state: ServerState) -> dict[str, str | None] | None:
    compute = state.client.compute
    return None if compute is None else asdict(compute)


def create_app(state: ServerState) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _serve(state, request, CompletionRequest, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, ChatCompletionRequest, chat=True)

    async def models(request: Request) -> Response:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started_s),
            "owned_by": "pdserve",
            "max_model_len": state.client.max_model_len,
            "compute": _compute(state),
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if not state.ready or state.draining or state.client.dead:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        if state.handoffs is not None:
            counts = Counter(h.state.value for h in state.handoffs.table.live())
            state.metrics.set_handoff_states(counts)
        body = state.metrics.render(state.client.stats)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def admin_kv(request: Request) -> Response:
        s = state.client.stats
        handoffs = state.handoffs.snapshot() if state.handoffs else []
        return JSONResponse(
            {
                "role": state.role,
                "compute": _compute(state),
                "num_blocks": s.num_blocks,
                "num_free_blocks": s.num_free_blocks,
                "num_held_blocks": s.num_held_blocks,
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "num_loading": s.num_loading,
                "num_preemptions": s.num_preemptions,
                "num_handoffs": len(handoffs),
                "handoffs": handoffs,
                "handoff_counters": dict(state.handoffs.table.counters) if state.handoffs else {},
            }
        )

    async def openapi(request: Request) -> Response:
        title = f"pdserve node ({state.role})"
        return JSONResponse(openapi_document(request.app.routes, title, OPEN_PATHS))

    app = Starlette(
        middleware=[Middleware(EdgeMiddleware, state=state)],
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/kv", admin_kv, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *disagg_routes(state),
        ],
        exception_handlers=ERROR_HANDLERS,
    )
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
        key = self._required_key(scope["path"])
        if key and not bearer_matches(headers.get("authorization", b""), key):
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

    def _required_key(self, path: str) -> str | None:
        if path in OPEN_PATHS or path in SELF_AUTHENTICATED_PATHS:
            return None
        if path.startswith("/kv/"):  # node-to-node
            return self.state.cluster_secret
        return self.state.api_key


def _validate(data: Any, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise InvalidRequestError(f"{where}: {first['msg']}", param=param) from e


def _kv_transfer(state: ServerState, data: dict[str, Any]) -> RemoteDecode | RemotePrefill | None:
    """The P/D leg this body asks for, checked against the node's role (400 otherwise)."""
    raw = data.get("kv_transfer_params")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError(
            "kv_transfer_params must be an object", param="kv_transfer_params"
        )
    params: KVTransferParams = _validate(raw, KVTransferParams)
    if not params.do_remote_decode and not params.do_remote_prefill:
        return None  # a neutral object, as some vLLM proxies send
    if params.do_remote_decode and params.do_remote_prefill:
        raise InvalidRequestError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
            param="kv_transfer_params",
        )
    wanted = "prefill" if params.do_remote_decode else "decode"
    if state.role != wanted:
        raise InvalidRequestError(
            f"this is a {state.role!r} node: a {wanted} leg needs a node started with "
            f"--role {wanted}",
            param="kv_transfer_params",
        )
    return remote_decode_from(params) if params.do_remote_decode else remote_prefill_from(params)


async def _serve(
    state: ServerState, request: Request, model: type[BaseModel], chat: bool
) -> Response:
    kv: RemoteDecode | RemotePrefill | None = None
    try:
        data = await read_json(request, MAX_BODY_BYTES)
        kv = _kv_transfer(state, data)
        if not state.ready or state.draining:
            raise StatusError(
                "the server is starting or draining", status=503, error_type="service_unavailable"
            )
        body = _validate(data, model)
        if body.model not in (None, state.model_name):
            raise StatusError(
                f"model {body.model!r} does not exist", status=404, error_type="not_found_error"
            )
        builder = ChoiceBuilder.for_request(body, chat, state.model_name)
        inputs = _engine_inputs(body, chat)  # before a prefill leg's handoff is minted
        if isinstance(kv, RemoteDecode) and body.stream:
            raise InvalidRequestError(
                "a prefill leg (do_remote_decode) cannot stream", param="stream"
            )
    except PdserveError as e:
        if isinstance(kv, RemotePrefill):
            await state.release_rejected(kv)
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    client_request_id = request.headers.get("x-request-id", "")[:256]
    state.live.add(builder.request_id, client_request_id)
    keep_registered = False
    try:
        if isinstance(kv, RemoteDecode):
            return await _serve_prefill_leg(state, request, inputs, builder, kv, client_request_id)
        response = await _generate(state, request, body, inputs, builder, kv)
        keep_registered = isinstance(response, StreamingResponse)  # the stream unregisters
        return response
    finally:
        if not keep_registered:
            state.live.remove(builder.request_id, client_request_id)
            state.unloaded_decode_legs.discard(builder.request_id)


async def _generate(
    state: ServerState,
    request: Request,
    body: Any,
    inputs: dict[str, Any],
    builder: ChoiceBuilder,
    kv: RemotePrefill | None,
) -> Response:
    request_id = builder.request_id
    if kv is not None:
        state.unloaded_decode_legs.add(request_id)
    try:
        outputs = state.metrics.track(
            state.client.generate(request_id, builder.params, **inputs, kv_transfer=kv)
        )
        if state.debug_step_delay_s:
            outputs = _paced(outputs, state.debug_step_delay_s)
        first = await _first_or_disconnect(request, outputs)
    except PdserveError as e:
        admitted = isinstance(e, RequestAbortedError) or e.error_type == "kv_transfer_error"
        if kv is not None and not admitted:
            await state.release_rejected(kv)  # never admitted (after that the connector owns it)
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    state.unloaded_decode_legs.discard(request_id)
    if first is None:  # client left before anything was produced
        return Response(status_code=499)
    if body.stream:
        # A streaming response only notices a gone client when its next write fails, one
        # token later; this watcher aborts as soon as the disconnect message arrives.
        watcher = asyncio.create_task(_abort_on_disconnect(request, state.client, request_id))
        client_request_id = request.headers.get("x-request-id", "")[:256]

        def finish_stream() -> None:
            watcher.cancel()
            state.live.remove(request_id, client_request_id)

        return StreamingResponse(
            _sse(state, builder, first, outputs),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(finish_stream),
        )
    try:
        final = await _last_or_disconnect(request, first, outputs)
    except PdserveError as e:  # the engine process died, or the server aborted it
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    if final is None:
        return Response(status_code=499)
    return JSONResponse(builder.full_response(final))


async def _serve_prefill_leg(
    state: ServerState,
    request: Request,
    inputs: dict[str, Any],
    builder: ChoiceBuilder,
    kv: RemoteDecode,
    client_request_id: str,
) -> Response:
    """One token, then the prompt's KV stays pinned under a new handoff whose params the
    answer carries. EOS and stop strings are ignored: the leg exists for its KV (S18)."""
    builder.params = replace(
        builder.params, max_tokens=1, min_tokens=0, ignore_eos=True, stop=(), stop_token_ids=()
    )
    service = state.handoffs
    assert service is not None  # a prefill leg is only accepted by a prefill node
    handoff = service.begin(builder.request_id, client_request_id, kv.release_token)
    outputs = state.metrics.track(
        state.client.generate(builder.request_id, builder.params, **inputs, kv_transfer=kv)
    )
    try:
        final = await _race_disconnect(request, _last(outputs), outputs)
    except PdserveError as e:
        await service.cancel(handoff)
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    if final is None or await request.is_disconnected():
        # Client gone before its answer (S1/S2): nothing stays held. If it leaves after
        # this check, while the answer is in flight, it can release by its own token
        # (the proxy does), else the lease frees the handoff.
        await service.cancel(handoff)
        return Response(status_code=499)
    answer = builder.full_response(final)
    if await service.commit(handoff, final):
        answer["kv_transfer_params"] = service.transfer_params(handoff, final).model_dump()
    return JSONResponse(answer)


async def _paced(
    outputs: AsyncIterator[RequestOutput], delay_s: float
) -> AsyncIterator[RequestOutput]:
    """`outputs`, each one `delay_s` late (`--debug-step-delay-s`); closing it closes them."""
    try:
        async for output in outputs:
            await asyncio.sleep(delay_s)
            yield output
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = await outputs.__anext__()
    while not last.finished:
        last = await outputs.__anext__()
    return last


def _engine_inputs(body: Any, chat: bool) -> dict[str, Any]:
    """The prompt or the messages, as the engine takes them (400 if they are unusable)."""
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
    state: ServerState,
    builder: ChoiceBuilder,
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    """SSE chunks; closing this generator (client gone) closes `outputs`, which aborts.

    An error after the 200 was committed (the engine died, the server aborted the request)
    is sent as a final `data: {"error": ...}` event, as vLLM does, instead of a silently
    cut stream or a finish_reason that reads like a completion."""
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
        state.metrics.request_failed(f"http_{e.http_status}")
        yield f"data: {json.dumps(error_body(e))}\n\n"
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"
