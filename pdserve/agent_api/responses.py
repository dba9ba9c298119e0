"""OpenAI's Responses API (`/v1/responses`) on a node and on the proxy: each response is a
chat completion run by the server's own chat handler (`bridge.py`), so a response through
the proxy takes the same P/D legs, routing and admission as a chat request.

Life of a response: checked (`responses_input.py`) → its previous response's conversation
read from the store (404 in the API's shape if the caller's key has none of that id) →
the chat request run, streamed or whole → the output folded into a Response
(`responses_output.py`) → stored with its conversation when `store` (default), before the
client is told it is complete → returned, or its final stream event sent.

`background: true` answers at once with a `queued` response and runs the chat request in
this process; `GET` reads its state from the store, `POST …/cancel` ends it (the chat
request sees its client leave, and aborts, releasing everything it held).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from pdserve.agent_api.bridge import ChatHandler, ChatResult, run_chat, run_chat_on
from pdserve.agent_api.responses_input import ResponsesRequest, input_items
from pdserve.agent_api.responses_output import ResponseRun
from pdserve.agent_api.store import ResponseStore, Stored, open_store, owner_of
from pdserve.errors import PdserveError, StatusError
from pdserve.openai_api.errors import MAX_BODY_BYTES, from_exception, read_json, validate_body

logger = logging.getLogger(__name__)


OPENAPI = {
    "/v1/responses": (ResponsesRequest, "OpenAI's Responses API (SSE events when stream is true)"),
    "/v1/responses/{response_id}": (None, "a stored response (GET), or its deletion (DELETE)"),
    "/v1/responses/{response_id}/cancel": (None, "cancel a background response"),
    "/v1/responses/{response_id}/input_items": (None, "a stored response's input items"),
}
"""For /openapi.json (`openapi_document`'s `described`)."""


def credential(request: Request) -> str:
    """The key a client presented (Bearer, or Anthropic's x-api-key); "" for none. Stored
    responses belong to it."""
    authorization = request.headers.get("authorization", "")
    if authorization.startswith("Bearer "):
        return authorization[len("Bearer ") :]
    return request.headers.get("x-api-key", "")


def not_found(response_id: str, param: str | None = None) -> StatusError:
    return StatusError(
        f"no response with id {response_id!r}",
        status=404,
        error_type="invalid_request_error",
        param=param,
    )


class _Background:
    """A background response running in this process, and its client's leaving."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def receive(self) -> Message:
        await self.cancelled.wait()
        return {"type": "http.disconnect"}


Slot = Callable[[list[tuple[bytes, bytes]]], contextlib.AbstractAsyncContextManager[None]]
"""A server's admission for work answered already (the proxy's line: `Admission.slot`), by
the request's headers; a node admits in its engine's queue and needs none."""


@contextlib.asynccontextmanager
async def _no_slot(headers: list[tuple[bytes, bytes]]) -> AsyncIterator[None]:
    yield


class ResponsesAPI:
    def __init__(
        self, chat: ChatHandler, store: str | ResponseStore | None, background_slot: Slot = _no_slot
    ) -> None:
        self.chat = chat
        self.store = store if isinstance(store, ResponseStore) else open_store(store)
        self.background_slot = background_slot
        """Held while a background response runs: the gate's slot ended with its answer."""
        self.running: dict[str, _Background] = {}

    def routes(self) -> list[Route]:
        one = "/v1/responses/{response_id}"
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route(one, self.retrieve, methods=["GET"]),
            Route(one, self.delete, methods=["DELETE"]),
            Route(f"{one}/cancel", self.cancel, methods=["POST"]),
            Route(f"{one}/input_items", self.list_input_items, methods=["GET"]),
        ]

    async def create(self, request: Request) -> Response:
        try:
            body = validate_body(await read_json(request, MAX_BODY_BYTES), ResponsesRequest)
            body.check()
            owner = owner_of(credential(request))
            context: list[dict[str, Any]] = []
            if body.previous_response_id is not None:
                previous = await self.store.get(body.previous_response_id, owner)
                if previous is None:
                    raise not_found(body.previous_response_id, "previous_response_id")
                context = previous.conversation
            elif body.store:
                await self.store.get("", owner)  # a store that is down: 503 before any work
            items = input_items(body.input)
            chat = body.chat_body(context, items)
        except PdserveError as e:
            return from_exception(e)
        run = ResponseRun(body)
        run.num_input = len(items)
        conversation = [*context, *items]
        if body.background:
            return await self._start_background(request, run, chat, owner, conversation)
        if body.stream:
            chat.update(stream=True, stream_options={"include_usage": True})
        result = await run_chat(self.chat, request, chat)
        if result.stream is not None:
            events = self._events(run, result, owner, conversation)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        if result.status >= 400 or result.body is None:
            return _chat_error(result)
        _fold_answer(run, result.body)
        try:
            await self._save(run, owner, conversation)
        except PdserveError as e:
            return from_exception(e)
        return JSONResponse(run.response)

    async def _save(self, run: ResponseRun, owner: str, conversation: list[dict[str, Any]]) -> None:
        if run.body.store:
            own = conversation[len(conversation) - run.num_input :]
            stored = Stored(run.response, [*conversation, *run.output], own)
            await self.store.put(run.id, owner, stored)

    async def _events(
        self, run: ResponseRun, result: ChatResult, owner: str, conversation: list[dict[str, Any]]
    ) -> AsyncGenerator[str, None]:
        """The stream: chat chunks folded as they come; the final event only once the
        response is stored (an `error` event instead if the store failed)."""
        usage = finish = None
        failed = False
        async with contextlib.aclosing(result.chunks()) as chunks:
            async for chunk in chunks:
                if isinstance(chunk.get("error"), dict):
                    run.start(None)
                    run.fail(chunk["error"])
                    failed = True
                    break
                run.start(chunk.get("model"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    run.feed(choice.get("delta") or {}, choice.get("logprobs"))
                    finish = choice.get("finish_reason") or finish
                for event in run.take_events():
                    yield _sse(event)
        if not failed:
            run.finish(finish, usage)
            try:
                await self._save(run, owner, conversation)
                run.final_event()
            except PdserveError as e:
                run.error_event(e.error_type, e.message)
        for event in run.take_events():
            yield _sse(event)

    async def _start_background(
        self,
        request: Request,
        run: ResponseRun,
        chat: dict[str, Any],
        owner: str,
        conversation: list[dict[str, Any]],
    ) -> Response:
        run.response["status"] = "queued"
        try:
            await self._save(run, owner, conversation)
        except PdserveError as e:
            return from_exception(e)
        background = _Background()
        self.running[run.id] = background
        scope = dict(request.scope)
        background.task = asyncio.create_task(
            self._run_background(run, chat, scope, background, owner, conversation)
        )
        return JSONResponse(run.response)

    async def _run_background(
        self,
        run: ResponseRun,
        chat: dict[str, Any],
        scope: dict[str, Any],
        background: _Background,
        owner: str,
        conversation: list[dict[str, Any]],
    ) -> None:
        try:
            async with self.background_slot(scope["headers"]):
                run.response["status"] = "in_progress"
                await self._save(run, owner, conversation)
                result = await run_chat_on(self.chat, scope, background.receive, chat)
            if background.cancelled.is_set():
                run.response["status"] = "cancelled"
            elif result.status >= 400 or result.body is None:
                error = (result.body or {}).get("error") or {}
                run.fail(error if isinstance(error, dict) else {"message": str(error)})
            else:
                _fold_answer(run, result.body)
            await self._save(run, owner, conversation)
        except PdserveError as e:  # the store failed: the response stays as last stored
            logger.warning("background response %s: %s", run.id, e.message)
        except Exception as e:  # no slot (the proxy is at capacity), or a bug: say so
            logger.warning("background response %s failed: %s", run.id, e)
            run.fail({"type": type(e).__name__, "message": str(e)})
            with contextlib.suppress(PdserveError):
                await self._save(run, owner, conversation)
        finally:
            self.running.pop(run.id, None)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            stored = await self.store.get(response_id, owner_of(credential(request)))
        except PdserveError as e:
            return from_exception(e)
        if stored is None:
            return from_exception(not_found(response_id))
        return JSONResponse(stored.response)

    async def list_input_items(self, request: Request) -> Response:
        """A stored response's own input items (`order` desc by default, `after`, `limit`
        1-100, as OpenAI pages them)."""
        response_id = request.path_params["response_id"]
        query = request.query_params
        order, after, limit = (
            query.get("order", "desc"),
            query.get("after"),
            query.get("limit", "20"),
        )
        try:
            if order not in ("asc", "desc") or not limit.isdigit() or not 1 <= int(limit) <= 100:
                raise StatusError("order must be asc or desc, limit 1 to 100", status=400,
                                  error_type="invalid_request_error")  # fmt: skip
            stored = await self.store.get(response_id, owner_of(credential(request)))
            if stored is None:
                raise not_found(response_id)
        except PdserveError as e:
            return from_exception(e)
        items = stored.input if order == "asc" else stored.input[::-1]
        ids = [i.get("id") for i in items]
        if after is not None and after in ids:
            items = items[ids.index(after) + 1 :]
        page = items[: int(limit)]
        return JSONResponse({
            "object": "list", "data": page, "has_more": len(items) > len(page),
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
        })  # fmt: skip

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            deleted = await self.store.delete(response_id, owner_of(credential(request)))
        except PdserveError as e:
            return from_exception(e)
        if not deleted:
            return from_exception(not_found(response_id))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        """Ends a background response running here; one that has ended is returned as it is."""
        response_id = request.path_params["response_id"]
        owner = owner_of(credential(request))
        try:
            stored = await self.store.get(response_id, owner)
            if stored is None:
                raise not_found(response_id)
            if not stored.response.get("background"):
                raise StatusError(
                    "only a background response can be cancelled",
                    status=400,
                    error_type="invalid_request_error",
                )
            running = self.running.get(response_id)
            if running is not None and running.task is not None:
                running.cancelled.set()
                await asyncio.shield(running.task)
            elif stored.response.get("status") in ("queued", "in_progress"):
                raise StatusError(
                    "the response runs on another server (or one that stopped)",
                    status=409,
                    error_type="invalid_request_error",
                )
            stored = await self.store.get(response_id, owner) or stored
        except PdserveError as e:
            return from_exception(e)
        return JSONResponse(stored.response)

    async def close(self) -> None:
        """At shutdown: every background response still running ends `cancelled` (its chat
        request sees its client leave and aborts), then the store closes."""
        for running in list(self.running.values()):
            running.cancelled.set()
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self.store.close()


def _fold_answer(run: ResponseRun, answer: dict[str, Any]) -> None:
    """A whole chat answer folded as one delta."""
    run.start(answer.get("model"))
    choice = (answer.get("choices") or [{}])[0]
    run.feed(choice.get("message") or {}, choice.get("logprobs"))
    run.finish(choice.get("finish_reason"), answer.get("usage"))
    run.take_events()


def _chat_error(result: ChatResult) -> Response:
    if result.status == 499:
        return Response(status_code=499)
    if result.body is not None:
        return JSONResponse(result.body, status_code=result.status)
    return from_exception(
        StatusError("the chat request failed", status=502, error_type="upstream_error")
    )


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
