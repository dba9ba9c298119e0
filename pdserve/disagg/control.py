"""Engine process (decode node): the client of the control channel, HTTP on the prefill
node's API port under `/kv/` (the messages: `pdserve.disagg.messages`).

Every call carries the cluster credential (`Authorization: Bearer <cluster secret, or the
API key>`) when one is configured, and every message about a handoff its release token.
A claim names the blocks the decode node will read (the `remote_block_ids` it was given):
the prefill node refuses blocks that are not the handoff's (`Outcome.WRONG_BLOCKS`).

`ControlClient` is synchronous: it runs on the decode connector's worker threads. An
unreachable node, an error status or a body outside the protocol raises `ControlError`;
a node's answer about a handoff is an `Outcome`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from pdserve.disagg.messages import (
    ClaimBody,
    ClaimReply,
    Handshake,
    Outcome,
    OutcomeReply,
    RefBody,
    ReleaseBody,
    ReleaseReason,
    RenewBody,
    RenewReply,
)
from pdserve.disagg.params import HandoffRef
from pdserve.tls import TLSConfig

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 2.0

Reply = TypeVar("Reply", bound=BaseModel)


class ControlError(Exception):
    """The prefill node could not be reached or answered outside the protocol."""


class ControlClient:
    """A decode node's calls to prefill nodes' `/kv/*`, over HTTPS when the node has TLS
    (peers verified against `tls.ca_certs`, `pdserve/tls.py`)."""

    def __init__(
        self,
        credential: str | None,
        tls: TLSConfig | None = None,
        timeout_s: float = CONTROL_TIMEOUT_S,
    ) -> None:
        headers = {"Authorization": f"Bearer {credential}"} if credential else {}
        verify = (tls or TLSConfig()).client_context()
        self._http = httpx.Client(headers=headers, timeout=timeout_s, verify=verify)

    def handshake(self, url: str) -> Handshake:
        data = self._call("GET", f"{url}/kv/handshake")
        try:
            return Handshake.from_json(data)
        except (KeyError, TypeError, ValueError) as e:
            raise ControlError(f"bad handshake from {url}: {e}") from e

    def renew(self, url: str, refs: list[HandoffRef]) -> list[Outcome]:
        body = RenewBody(handoffs=[RefBody.of(r) for r in refs])
        return self._post(url, "renew", body, RenewReply).outcomes

    def claim(self, url: str, ref: HandoffRef, block_ids: Sequence[int]) -> tuple[Outcome, float]:
        body = ClaimBody(**RefBody.of(ref).model_dump(), block_ids=list(block_ids))
        reply = self._post(url, "claim", body, ClaimReply)
        return reply.outcome, reply.claim_timeout_s

    def finish_read(self, url: str, ref: HandoffRef, ok: bool) -> Outcome:
        path = "done" if ok else "failed"
        return self._post(url, path, RefBody.of(ref), OutcomeReply).outcome

    def release(self, url: str, ref: HandoffRef, reason: ReleaseReason) -> Outcome:
        body = ReleaseBody(**RefBody.of(ref).model_dump(), reason=reason)
        return self._post(url, "release", body, OutcomeReply).outcome

    def close(self) -> None:
        self._http.close()

    def _post(self, url: str, path: str, body: BaseModel, reply: type[Reply]) -> Reply:
        data = self._call("POST", f"{url}/kv/{path}", body.model_dump(mode="json"))
        try:
            return reply.model_validate(data, strict=False)
        except ValidationError as e:
            raise ControlError(f"POST {url}/kv/{path}: unexpected answer: {e}") from e

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, url, json=body)
        except httpx.HTTPError as e:
            raise ControlError(f"{method} {url}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise ControlError(f"{method} {url}: HTTP {response.status_code} {response.text[:200]}")
        try:
            data = response.json()
        except ValueError as e:
            raise ControlError(f"{method} {url}: body is not JSON") from e
        if not isinstance(data, dict):
            raise ControlError(f"{method} {url}: body is not a JSON object")
        return data
