"""The control channel between a decode node and a prefill node: HTTP on the prefill
node's API port, under `/kv/`.

    GET  /kv/handshake   → engine id, epoch, KV layout, NIXL metadata of the prefill node
    POST /kv/renew       {"handoffs": [ref, …]}  → {"outcomes": […]}   (batched per node)
    POST /kv/claim       ref + {"block_ids"}     → {"outcome", "claim_timeout_s"}
    POST /kv/done        ref                     → {"outcome"}          (read succeeded)
    POST /kv/failed      ref                     → {"outcome"}          (read failed/abandoned)
    POST /kv/release     ref + {"reason"}        → {"outcome"}

A `ref` is `{"handoff_id", "release_token", "epoch"}`: the per-handoff token authorizes
the message for that handoff only. A claim names the blocks the decode node will read (the
`remote_block_ids` it was given): the prefill node refuses blocks that are not the
handoff's (`wrong_blocks`). The calls also carry the cluster credential
(`Authorization: Bearer <cluster secret, or the API key>`) when one is configured.

`ControlClient` is the decode side's synchronous client (it runs on the connector's
worker threads). Transport problems raise `ControlError`; outcomes are the prefill
table's `Outcome` values as strings.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.disagg.params import HandoffRef, KVLayout
from pdserve.disagg.transport import TransportInfo

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 2.0
RELEASE_REASONS = ("released", "rejected", "cancelled", "not_needed", "shutdown")


class ControlError(Exception):
    """The prefill node could not be reached or answered outside the protocol."""


@dataclass(frozen=True)
class Handshake:
    engine_id: str
    epoch: str
    layout: KVLayout
    transport: TransportInfo

    def as_json(self) -> dict[str, Any]:
        t = self.transport
        return {
            "engine_id": self.engine_id,
            "epoch": self.epoch,
            "layout": self.layout.__dict__,
            "transport": {
                **t.__dict__,
                "agent_metadata": base64.b64encode(t.agent_metadata).decode(),
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Handshake:
        t = dict(data["transport"])
        t["agent_metadata"] = base64.b64decode(t["agent_metadata"])
        return cls(data["engine_id"], data["epoch"], KVLayout(**data["layout"]), TransportInfo(**t))


class ControlClient:
    def __init__(self, credential: str | None, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        headers = {"Authorization": f"Bearer {credential}"} if credential else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s)

    def handshake(self, url: str) -> Handshake:
        data = self._call("GET", f"{url}/kv/handshake")
        try:
            return Handshake.from_json(data)
        except (KeyError, TypeError, ValueError) as e:
            raise ControlError(f"bad handshake from {url}: {e}") from e

    def renew(self, url: str, refs: list[HandoffRef]) -> list[str]:
        data = self._call("POST", f"{url}/kv/renew", {"handoffs": [r.as_json() for r in refs]})
        return [str(o) for o in data.get("outcomes", [])]

    def claim(self, url: str, ref: HandoffRef, block_ids: Sequence[int]) -> tuple[str, float]:
        body = {**ref.as_json(), "block_ids": list(block_ids)}
        data = self._call("POST", f"{url}/kv/claim", body)
        return str(data.get("outcome")), float(data.get("claim_timeout_s") or 0.0)

    def finish_read(self, url: str, ref: HandoffRef, ok: bool) -> str:
        path = "done" if ok else "failed"
        return str(self._call("POST", f"{url}/kv/{path}", ref.as_json()).get("outcome"))

    def release(self, url: str, ref: HandoffRef, reason: str) -> str:
        body = {**ref.as_json(), "reason": reason}
        return str(self._call("POST", f"{url}/kv/release", body).get("outcome"))

    def close(self) -> None:
        self._http.close()

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
