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

P/D legs (`kv_transfer_params`) are the node's `NodeLegs` (`pdserve.api.pd_legs`): it
parses them against the node's role, serves prefill legs, and releases the handoff of a
decode leg the engine never admitted. A decode leg otherwise takes the path above.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.agent_api import messages as messages_api
from pdserve.agent_api import responses as responses_api
from pdserve.agent_api.messages import MessagesAPI
from pdserve.agent_api.responses import ResponsesAPI
from pdserve.api.batched import generate_many
from pdserve.api.disagg_routes import disagg_routes
from pdserve.api.edge import OPEN_PATHS, EdgeMiddleware
from pdserve.api.live import abort_on_disconnect
from pdserve.api.state import ServerState
from pdserve.disagg.params import RemoteDecode
from pdserve.engine.kv_types import KVTransferSpec
from pdserve.errors import InvalidRequestError, PdserveError, StatusError
from pdserve.openai_api.caller import (
    client_request_id,
    request_span,
    unless_gone_closing,
)
from pdserve.openai_api.errors import (
    ERROR_HANDLERS,
    MAX_BODY_BYTES,
    error_body,
    error_response,
    from_exception,
    read_json,
    validate_body,
)
from pdserve.openai_api.openapi import openapi_document
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest, check_model
from pdserve.openai_api.responses import ChoiceBuilder, Echo
from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


def create_app(state: ServerState) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _serve(state, request, CompletionRequest, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, ChatCompletionRequest, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    async def health(request: Request) -> Response:
        if not state.ready or state.draining or state.client.dead:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        handoff_states = state.legs.handoff_states()
        if handoff_states is not None:
            state.metrics.set_handoff_states(handoff_states)
        body = state.metrics.render(state.client.stats)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def admin_kv(request: Request) -> Response:
        return JSONResponse(_kv_view(state))

    async def admin_prefix_cache(request: Request) -> Response:
        return _prefix_cache_view(state, request.query_params.get("since"))

    async def tokenize(request: Request) -> Response:
        return await state.tokenization.tokenize(request, state.client.max_model_len)

    async def detokenize(request: Request) -> Response:
        return await state.tokenization.detokenize(request)

    async def openapi(request: Request) -> Response:
        title = f"pdserve node ({state.legs.role})"
        described = {**responses_api.OPENAPI, **messages_api.OPENAPI}
        return JSONResponse(openapi_document(request.app.routes, title, OPEN_PATHS, described))

    # The agent APIs run each request as a chat completion of this node (`agent_api/`).
    responses = ResponsesAPI(chat_completions, state.response_store)
    state.closers.append(responses.close)

    return Starlette(
        middleware=[Middleware(EdgeMiddleware, state=state)],
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/admin/kv", admin_kv, methods=["GET"]),
            Route("/admin/prefix_cache", admin_prefix_cache, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *responses.routes(),
            *MessagesAPI(chat_completions).routes(),
            *disagg_routes(state),
        ],
        exception_handlers=ERROR_HANDLERS,
    )


def _compute(state: ServerState) -> dict[str, str | None] | None:
    compute = state.client.compute
    return None if compute is None else asdict(compute)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started_s),
        "owned_by": "pdserve",
        "max_model_len": state.client.max_model_len,
        "compute": _compute(state),
    }


def _kv_view(state: ServerState) -> dict[str, Any]:
    """`GET /admin/kv`: the KV pool, the engine's queues and (prefill nodes) the handoffs."""
    s = state.client.stats
    return {
        "role": state.legs.role.value,
        "compute": _compute(state),
        "num_blocks": s.num_blocks,
        "num_free_blocks": s.num_free_blocks,
        "num_held_blocks": s.num_held_blocks,
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "num_loading": s.num_loading,
        "num_preemptions": s.num_preemptions,
        "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
        **state.legs.admin_view(),
    }


def _prefix_cache_view(state: ServerState, since: str | None) -> Response:
    """`GET /admin/prefix_cache[?since=VERSION]`: the block hashes the prefix cache holds
    (`kv_cache/prefix_summary.py`), or `{"version": V, "unchanged": true}` when V is still
    current, so the proxy's polls cost little while nothing changes."""
    index = state.client.prefix_index
    if since is not None:
        if not since.isdigit():
            return error_response(
                400, "since must be a version number", "invalid_request_error", param="since"
            )
        if int(since) == index.version:
            return JSONResponse({"version": index.version, "unchanged": True})
    return JSONResponse(index.summary().model_dump())


async def _serve(
    state: ServerState, request: Request, model: type[BaseModel], chat: bool
) -> Response:
    kv: KVTransferSpec | None = None
    try:
        data = await read_json(request, MAX_BODY_BYTES)
        kv = state.legs.parse(data)
        if not state.ready or state.draining:
            raise StatusError(
                "the server is starting or draining", status=503, error_type="service_unavailable"
            )
        body: Any = validate_body(data, model)
        check_model(body.model, state.model_name)
        builder = ChoiceBuilder.for_request(body, chat, state.model_name, state.client.thinks)
        inputs = _engine_inputs(body, chat)  # before a prefill leg's handoff is minted
        _check_leg(body, builder, kv, len(inputs))
        echoes = await _echoes(state, body, inputs) if not chat and body.echo else None
    except PdserveError as e:
        await state.legs.refused(kv, e)
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    caller_id = client_request_id(request.headers)
    state.live.add(builder.request_id, caller_id)
    keep_registered = False
    try:
        if len(inputs) > 1:
            return await generate_many(state, request, inputs, builder, echoes, body.stream)
        builder.echo = echoes[0] if echoes else None
        if isinstance(kv, RemoteDecode):
            return await state.legs.serve_prefill_leg(request, inputs[0], builder, kv, caller_id)
        response = await _generate(state, request, body, inputs[0], builder, kv)
        keep_registered = isinstance(response, StreamingResponse)  # the stream unregisters
        return response
    finally:
        if not keep_registered:
            state.live.remove(builder.request_id, caller_id)
            state.legs.loaded(builder.request_id)


async def _generate(
    state: ServerState,
    request: Request,
    body: Any,
    inputs: dict[str, Any],
    builder: ChoiceBuilder,
    kv: KVTransferSpec | None,
) -> Response:
    request_id = builder.request_id
    state.legs.loading(request_id, kv)
    try:
        outputs = state.metrics.track(
            state.client.generate(request_id, builder.params, **inputs, kv_transfer=kv),
            request_span(request, request_id),
        )
        if state.seams.step_delay_s:
            outputs = _paced(outputs, state.seams.step_delay_s)
        first = await unless_gone_closing(request, outputs.__anext__(), outputs)
    except PdserveError as e:
        await state.legs.refused(kv, e)
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    state.legs.loaded(request_id)
    if first is None:  # client left before anything was produced
        return Response(status_code=499)
    if body.stream:
        return _stream(state, request, builder, first, outputs)
    try:
        final = await unless_gone_closing(request, _rest(first, outputs), outputs)
    except PdserveError as e:  # the engine process died, or the server aborted it
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    if final is None:
        return Response(status_code=499)
    return JSONResponse(builder.full_response(final))


def _stream(
    state: ServerState,
    request: Request,
    builder: ChoiceBuilder,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
) -> StreamingResponse:
    # A streaming response only notices a gone client when its next write fails, one
    # token later; this watcher aborts as soon as the disconnect message arrives.
    request_id = builder.request_id
    watcher = asyncio.create_task(abort_on_disconnect(request, state.client, [request_id]))
    caller_id = client_request_id(request.headers)

    def finish_stream() -> None:
        watcher.cancel()
        state.live.remove(request_id, caller_id)

    return StreamingResponse(
        _sse(state, builder, first, outputs),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(finish_stream),
    )


async def _paced(
    outputs: AsyncGenerator[RequestOutput, None], delay_s: float
) -> AsyncGenerator[RequestOutput, None]:
    """`outputs`, each one `delay_s` late (a test seam); closing it closes them."""
    try:
        async for output in outputs:
            await asyncio.sleep(delay_s)
            yield output
    finally:
        await outputs.aclose()


async def _rest(
    first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
) -> RequestOutput:
    last = first
    while not last.finished:
        last = await outputs.__anext__()
    return last


def _engine_inputs(body: Any, chat: bool) -> list[dict[str, Any]]:
    """The prompts or the messages, as the engine takes them (400 if they are unusable):
    one engine request each."""
    if chat:
        spec = body.tool_spec()
        tools = spec.template_tools() if spec is not None else None
        kwargs = body.chat_template_kwargs
        return [{"messages": body.chat_messages(), "tools": tools, "template_kwargs": kwargs}]
    return [{"prompt": prompt} for prompt in body.prompts()]


def _check_leg(body: Any, builder: ChoiceBuilder, kv: KVTransferSpec | None, prompts: int) -> None:
    """What a request with several prompts, or a P/D leg, cannot ask for (400s)."""
    if kv is None:
        return
    if prompts > 1:
        raise InvalidRequestError("a P/D leg carries one prompt", param="prompt")
    if isinstance(kv, RemoteDecode) and body.stream:
        raise InvalidRequestError("a prefill leg (do_remote_decode) cannot stream", param="stream")
    if isinstance(kv, RemoteDecode) and body.n != 1:
        raise InvalidRequestError(
            "a prefill leg samples one first token: send n on the decode leg", param="n"
        )
    if not isinstance(kv, RemoteDecode) and builder.params.prompt_logprobs is not None:
        raise InvalidRequestError(
            "a decode leg reads the prompt's KV, not its logprobs: the prefill leg returns "
            "them (echo with logprobs)",
            param="echo",
        )


async def _echoes(state: ServerState, body: Any, inputs: list[dict[str, Any]]) -> list[Echo]:
    """Each prompt's echo: its text as sent (token ids decoded by the model's tokenizer,
    loaded into this process on first use: no torch)."""
    try:
        tok = await state.tokenization.tokenizer()
    except InvalidRequestError as e:
        raise InvalidRequestError(
            "echo needs the model's tokenizer: it has none", param="echo"
        ) from e
    return [
        Echo(p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False), tok.token_text)
        for p in (i["prompt"] for i in inputs)
    ]


async def _sse(
    state: ServerState,
    builder: ChoiceBuilder,
    first: RequestOutput,
    outputs: AsyncGenerator[RequestOutput, None],
) -> AsyncGenerator[str, None]:
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
        await outputs.aclose()
    yield "data: [DONE]\n\n"
