"""The one way the agent APIs (`/v1/responses`, `/v1/messages`) generate: a chat completion
request run by the server's own chat handler (a node's, or the proxy's with its P/D legs),
and its answer read back as chat chunks.

The chat handler gets a request of its own (`inner_request`): the client's connection, its
headers (auth was checked at the edge already; X-Request-Id and traceparent carry on), and
the chat body in place of the client's. Its receive channel is the client's once the body
is read, so a client that leaves aborts the chat request exactly as it would a chat
client's: the node's watcher and the proxy's legs see the same disconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope

ChatHandler = Callable[[Request], Awaitable[Response]]
"""`POST /v1/chat/completions` of this server, as a function of its request."""


def inner_request(scope: Scope, receive: Receive, body: dict[str, Any]) -> Request:
    """A request whose body is `body` (JSON) and whose later messages are `receive`'s."""
    raw = json.dumps(body).encode()
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type")]
    headers += [(b"content-length", str(len(raw)).encode()), (b"content-type", b"application/json")]
    sent = False

    async def receive_body() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return Request({**scope, "headers": headers}, receive_body)


async def never_disconnects() -> Message:
    """The receive channel of work no client waits on (a background response): it ends
    only by being cancelled."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@dataclass
class ChatResult:
    """The chat handler's answer: an error (`status` ≥ 400, `body` in OpenAI's schema), a
    whole answer (`body`), or a stream (`chunks`). 499: the client left first."""

    status: int
    body: dict[str, Any] | None = None
    stream: StreamingResponse | None = None

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        """The stream's `data:` events, parsed, `[DONE]` left out. Closing this closes the
        chat stream, which ends its request (aborted if it was still running)."""
        assert self.stream is not None
        source = self.stream.body_iterator
        buffer = b""
        try:
            async for piece in source:
                buffer += piece if isinstance(piece, bytes) else str(piece).encode()
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        yield json.loads(line[len(b"data: ") :])
        finally:
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()
            task = self.stream.background
            if task is not None:
                # Synchronous cleanups are run here, not awaited through a thread: after the
                # client left, every await in this scope is cancelled.
                if getattr(task, "is_async", False):
                    await task()
                else:
                    task.func(*task.args, **task.kwargs)


async def run_chat(chat: ChatHandler, request: Request, body: dict[str, Any]) -> ChatResult:
    return await run_chat_on(chat, request.scope, request.receive, body)


async def run_chat_on(
    chat: ChatHandler, scope: Scope, receive: Receive, body: dict[str, Any]
) -> ChatResult:
    response = await chat(inner_request(scope, receive, body))
    if isinstance(response, StreamingResponse):
        return ChatResult(response.status_code, stream=response)
    data: Any = None
    if response.body:
        try:
            data = json.loads(bytes(response.body))
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
    if response.background is not None:
        await response.background()
    return ChatResult(response.status_code, data if isinstance(data, dict) else None)
