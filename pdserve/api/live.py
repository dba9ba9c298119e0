"""The requests a node is serving, by server id and by the client's X-Request-Id: what the
abort API resolves a name to, and what a drain that timed out aborts; and a stream's
engine requests aborted the moment its client leaves (`abort_on_disconnect`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

from pdserve.openai_api.caller import wait_disconnect

if TYPE_CHECKING:
    from pdserve.engine.async_client import AsyncEngineClient


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


async def abort_on_disconnect(
    request: Request, client: AsyncEngineClient, request_ids: list[str]
) -> None:
    """Abort a stream's engine requests as soon as its client disconnects: a streaming
    response notices a gone client only when its next write fails, one token later. (The
    stream's own cleanup aborts again: abort is idempotent.)"""
    await wait_disconnect(request)
    await client.abort(request_ids)
