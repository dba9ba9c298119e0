"""vLLM EngineCore (prefill node): the control endpoint `PdserveConnector` opens itself.

The same wire protocol as a pdserve prefill node's (`pdserve.disagg.messages`; the
decode side's client is `pdserve.disagg.control.ControlClient`) over the same
`HandoffTable`, on its own port, because vLLM's HTTP server has no way in for a connector:

    POST /kv/renew  /kv/claim  /kv/done  /kv/failed  /kv/release   (cluster credential, when
                                                                    set, + the release token)
    POST /v1/abort_requests   {"request_ids": [...], "release_token"?}  (token or credential)
    GET  /kv/handoffs         the live handoffs and the counters      (credential)

A standard-library threading server: a connector must not bring an event loop into vLLM's
processes, and every handler is a few table operations under the table's lock. The handlers
never touch blocks: a release marks the handoff, and the scheduler frees what the table
released at its next step (`PdserveScheduler.build_connector_meta`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel, ValidationError

from pdserve.disagg.handoff import HandoffState, HandoffTable
from pdserve.disagg.messages import (
    AbortRequest,
    ClaimBody,
    ClaimReply,
    OutcomeReply,
    RefBody,
    ReleaseBody,
    RenewBody,
    RenewReply,
)
from pdserve.errors import InvalidRequestError
from pdserve.openai_api.auth import bearer_matches

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logging: its format, its level
SHUTDOWN_POLL_S = 0.05  # how soon close() returns: serve_forever checks this often

MAX_BODY_BYTES = 1 << 20
SLOW_S = 0.1
"""A control message that takes longer is logged: a release must free within 50 ms."""


class ControlServer:
    """Serves `table` (guarded by `lock`) on host:port (0: any free port) in a thread."""

    def __init__(
        self,
        table: HandoffTable,
        lock: threading.Lock,
        host: str,
        port: int,
        cluster_secret: str | None,
        report: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.table, self.lock = table, lock
        self.cluster_secret = cluster_secret
        self.report = report
        """More of the node's state for `GET /kv/handoffs`."""
        self._http = ThreadingHTTPServer((host, port), _handler_class(self))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            args=(SHUTDOWN_POLL_S,),
            name="pdserve-control",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    # -- the routes (each returns (status, JSON body)) -------------------------------

    def renew(self, body: RenewBody) -> tuple[int, BaseModel]:
        with self.lock:
            outcomes = [
                self.table.renew(r.handoff_id, r.release_token, r.epoch) for r in body.handoffs
            ]
        return 200, RenewReply(outcomes=outcomes)

    def claim(self, body: ClaimBody) -> tuple[int, BaseModel]:
        with self.lock:
            outcome = self.table.claim(
                body.handoff_id, body.release_token, body.epoch, body.block_ids
            )
            timeout_s = self.table.claim_timeout_s
        return 200, ClaimReply(outcome=outcome, claim_timeout_s=timeout_s)

    def finish_read(self, body: RefBody, ok: bool) -> tuple[int, BaseModel]:
        with self.lock:
            outcome = self.table.finish_read(body.handoff_id, body.release_token, body.epoch, ok)
        return 200, OutcomeReply(outcome=outcome)

    def release(self, body: ReleaseBody) -> tuple[int, BaseModel]:
        with self.lock:
            outcome = self.table.release(
                body.handoff_id, body.release_token, body.epoch, reason=body.reason.as_recorded
            )
        return 200, OutcomeReply(outcome=outcome)

    def abort(self, body: AbortRequest, admin: bool) -> tuple[int, dict[str, Any]]:
        """As a pdserve node's abort API, for handoffs only: vLLM aborts its own running
        requests when their clients leave."""
        token = body.release_token
        if not admin and not token:
            return 401, _error(
                "the cluster credential or a release token is required", "authentication_error"
            )
        with self.lock:
            if not admin and not self.table.covers(body.ids, str(token)):
                return 403, _error("the release token does not cover every id", "permission_error")
            results = self.table.abort(body.ids, token, admin)
        outcomes = [
            {"id": i, "outcome": results[i].value if i in results else "not_found"}
            for i in body.ids
        ]
        return 200, {"results": outcomes}

    def handoffs(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            rows = [
                {
                    "handoff_id": h.handoff_id,
                    "request_id": h.request_id,
                    "client_request_id": h.client_request_id,
                    "state": h.state.value,
                    "num_blocks": len(h.block_ids),
                    "age_s": round(now - h.created_s, 3),
                }
                for h in self.table.live()
            ]
            counters = dict(self.table.counters)
        held = sum(
            int(r["num_blocks"]) for r in rows if r["state"] != HandoffState.PREFILLING.value
        )
        return {
            "num_handoffs": len(rows),
            "num_held_blocks": held,
            "handoffs": rows,
            "counters": counters,
            **self.report(),
        }


def _error(message: str, error_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": None}}


def _handler_class(server: ControlServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out as two writes: with Nagle's algorithm the body would
        # wait for the client's delayed ACK of the headers (40 ms on Linux, every call).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            if self.path != "/kv/handoffs":
                self._send(404, _error(f"no route {self.path}", "not_found_error"))
            elif not self._may_control():
                self._send(
                    401, _error("the cluster credential is required", "authentication_error")
                )
            else:
                self._send(200, server.handoffs())

        def do_POST(self) -> None:
            started = time.monotonic()
            try:
                status, reply = self._route(self._json())
            except InvalidRequestError as e:
                status, reply = 400, _error(str(e), "invalid_request_error")
            except ValidationError as e:
                status, reply = (
                    400,
                    _error(f"bad body: {e.errors()[0]['msg']}", "invalid_request_error"),
                )
            took_s = time.monotonic() - started
            if took_s > SLOW_S:
                logger.warning("POST %s took %.3f s", self.path, took_s)
            self._send(status, reply)

        def _route(self, data: dict[str, Any]) -> tuple[int, Any]:
            if self.path == "/v1/abort_requests":
                return server.abort(AbortRequest.from_json(data), self._has_credential())
            if not self._may_control():
                return 401, _error("the cluster credential is required", "authentication_error")
            routes: dict[str, Callable[[], tuple[int, Any]]] = {
                "/kv/renew": lambda: server.renew(RenewBody.model_validate(data)),
                "/kv/claim": lambda: server.claim(ClaimBody.model_validate(data)),
                "/kv/done": lambda: server.finish_read(RefBody.model_validate(data), ok=True),
                "/kv/failed": lambda: server.finish_read(RefBody.model_validate(data), ok=False),
                "/kv/release": lambda: server.release(ReleaseBody.model_validate(data)),
            }
            route = routes.get(self.path)
            if route is None:
                return 404, _error(f"no route {self.path}", "not_found_error")
            return route()

        def _has_credential(self) -> bool:
            """`Authorization: Bearer <cluster secret>` (never, when no secret is set)."""
            given = self.headers.get("authorization", "").encode("latin-1")
            return bearer_matches(given, server.cluster_secret)

        def _may_control(self) -> bool:
            """`/kv/*`: the cluster credential when one is set (release tokens still
            authorize each message about a handoff), as on a pdserve prefill node."""
            return not server.cluster_secret or self._has_credential()

        def _json(self) -> dict[str, Any]:
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY_BYTES:
                raise InvalidRequestError(f"body over {MAX_BODY_BYTES} bytes")
            try:
                data = json.loads(self.rfile.read(length) or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidRequestError(f"body is not JSON: {e}") from e
            if not isinstance(data, dict):
                raise InvalidRequestError("body must be a JSON object")
            return data

        def _send(self, status: int, reply: Any) -> None:
            body = reply.model_dump(mode="json") if isinstance(reply, BaseModel) else reply
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("control %s", format % args)

    return Handler
