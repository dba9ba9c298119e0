"""A node's ASGI edge, around every route: the key check (constant time; a bearer key, or
Anthropic's x-api-key header), the X-Request-Id echo, and the count of requests in flight
that a drain waits on.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, so that request bodies, streaming
responses and disconnect messages pass through untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.agent_api.messages import MESSAGES_PATH, anthropic_error
from pdserve.disagg import control_plane
from pdserve.openai_api.auth import key_matches
from pdserve.openai_api.caller import client_request_id
from pdserve.openai_api.errors import error_response, from_exception

if TYPE_CHECKING:
    from pdserve.api.state import ServerState

OPEN_PATHS = ("/health", "/metrics", "/openapi.json")
SELF_AUTHENTICATED_PATHS = ("/v1/abort_requests",)
"""Admin key or a release token, checked by the route (`disagg_routes`)."""


class EdgeMiddleware:
    """A request leaves the in-flight count when its ASGI call returns: response fully
    sent, or the client gone."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        path = scope["path"]
        key = self._required_key(path)
        presented = headers.get("authorization", b""), headers.get("x-api-key", b"")
        if key and not key_matches(*presented, key):
            if path.startswith("/kv/"):  # node-to-node: the control plane's own words
                response = from_exception(control_plane.credential_required())
            elif path == MESSAGES_PATH:  # Anthropic's clients read Anthropic's schema
                response = anthropic_error(401, "invalid or missing API key")
            else:
                response = error_response(401, "invalid or missing API key", "authentication_error")
            await response(scope, receive, send)
            return
        echo = client_request_id(Headers(scope=scope)).encode()

        async def send_with_id(message: Message) -> None:
            if echo and message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", echo)]
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
