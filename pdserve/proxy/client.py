"""The proxy's view of one client request: where it is (`Stage`), and its disconnect."""

from __future__ import annotations

import asyncio
import enum
import secrets
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from pdserve.openai_api.caller import client_request_id, request_span, unless_gone, wait_disconnect
from pdserve.proxy.upstream import UpstreamResponse

T = TypeVar("T")


class Stage(enum.Enum):
    """Where a request is, as the proxy sees it; the stage of a client's departure."""

    RECEIVING = "receiving"
    """The request's body had not fully arrived."""
    PREFILL = "prefill"
    """The prefill leg is in flight: queued or running on the prefill node."""
    BETWEEN_LEGS = "between_legs"
    """The prefill answer is here (handoff held), the decode leg not yet sent."""
    DECODE = "decode"
    """The decode leg is sent, its answer's head not yet back: before the first token
    (queued on the decode node, reading the KV, or its first step). Every decode leg is
    asked to stream, for clients that did not ask too."""
    STREAMING = "streaming"
    """The decode node streams tokens: the KV was read and decoding runs."""
    ANSWER = "answer"
    """A decode node that ignored `stream` answers with one JSON body, being read."""


class Client:
    """Watches one client request for a disconnect (one task for both legs) and knows the
    stage the request is in."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.request_id = client_request_id(request.headers) or f"pdproxy-{secrets.token_hex(8)}"
        self.stage = Stage.PREFILL
        self.span = request_span(request, self.request_id)
        """The request's trace span: ended by `serve_request`, or by the stream it returns."""
        self._gone = asyncio.ensure_future(wait_disconnect(request))

    async def unless_gone(self, work: Awaitable[T]) -> T:
        """Await `work`, or cancel it (closing its upstream connection) and raise ClientGone
        if the client disconnects first."""
        return await unless_gone(work, self._gone, _close_if_response)

    @property
    def gone(self) -> bool:
        return self._gone.done()

    def close(self) -> None:
        self._gone.cancel()


def _close_if_response(result: object) -> None:
    if isinstance(result, UpstreamResponse):  # it arrived anyway: close what it opened
        result.close()
