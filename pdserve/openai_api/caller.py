"""The client on the other end of one HTTP request, as a node and the proxy both see it:
its X-Request-Id, and whether it is still there.

A client that disconnects shows up as an `http.disconnect` message on the request's
receive channel (its body has been read by then). `unless_gone` races the work in hand
against that message: whichever ends first wins, and work the client no longer waits for
is cancelled, and cleaned up if it had finished anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request

from pdserve import tracing
from pdserve.tracing import Span

T = TypeVar("T")

MAX_REQUEST_ID_CHARS = 256


class ClientGone(Exception):
    """The client disconnected while its request was being served."""


def client_request_id(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id as every pdserve server takes it: printable ASCII only,
    at most 256 characters; "" when there is none."""
    raw = headers.get("x-request-id", "")[:MAX_REQUEST_ID_CHARS]
    return "".join(c for c in raw if " " <= c <= "~")


async def wait_disconnect(request: Request) -> None:
    """Return once the client has disconnected (never, while it stays)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(
    work: Awaitable[T],
    gone: asyncio.Future[None],
    abandon: Callable[[T], object] | None = None,
) -> T:
    """`work`'s result, unless `gone` (a `wait_disconnect` task) completes first: then the
    work is cancelled and awaited (`abandon` gets its result if it finished all the same,
    to close what it opened) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    racing: set[asyncio.Future[Any]] = {task, gone}
    await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        result = await task
        if abandon is not None:
            abandon(result)
    raise ClientGone


async def unless_gone_closing(
    request: Request, work: Awaitable[T], outputs: AsyncGenerator[object, None]
) -> T | None:
    """A node's wait for engine outputs: `work`'s result, or None when the client leaves
    first; then `outputs` is closed, which aborts the request in the engine."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        return await unless_gone(work, gone)
    except ClientGone:
        await outputs.aclose()
        return None
    finally:
        gone.cancel()


def request_span(request: Request, request_id: str) -> Span:
    """The span of one request on this server (`NULL_SPAN` while tracing is off), the child
    of the caller's when its headers carry a `traceparent` (the proxy's legs do)."""
    span = tracing.start_span(f"{request.method} {request.url.path}", request.headers)
    span.set("pdserve.request_id", request_id)
    caller_id = client_request_id(request.headers)
    if caller_id:
        span.set("pdserve.client_request_id", caller_id)
    return span
