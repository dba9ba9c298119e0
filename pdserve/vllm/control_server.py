"""vLLM EngineCore (prefill node): the control endpoint `PdserveConnector` opens itself.

The same wire protocol and rules as a pdserve prefill node's (`pdserve.disagg.control_plane`:
this is its second adapter; the decode side's client is `pdserve.disagg.control.
ControlClient`) over the same `HandoffTable`, on its own port, because vLLM's HTTP server has
no way in for a connector:

    POST /kv/renew  /kv/claim  /kv/done  /kv/failed  /kv/release   (cluster credential, when
                                                                    set, + the release token)
    POST /v1/abort_requests   {"request_ids": [...], "release_token"?}  (token or credential)
    GET  /kv/handoffs         the live handoffs and the counters      (credential)

A standard-library threading server: a connector must not bring an event loop into vLLM's
processes, and every handler is a few table operations under the table's lock. The handlers
never touch blocks: a release marks the handoff, and the scheduler frees what the table
released at its next step (`PdserveScheduler.build_connector_meta`).

It runs inside the inference engine's process, so nobody who reaches the port may pile work
into it: at most `MAX_CONNECTIONS` connections are served at once (each one thread; more are
closed at accept), a connection idle for `IDLE_TIMEOUT_S` is closed, and one whose request
has not been read and answered within `REQUEST_DEADLINE_S` (a client that trickles bytes)
is shut down by the serving loop. With TLS (`pdserve_ssl_certfile`, the files pdserve's
nodes take) the handshake runs in the connection's own thread, under the same timeouts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel

from pdserve.disagg import control_plane
from pdserve.disagg.handoff import HandoffState, HandoffTable
from pdserve.disagg.messages import AbortRequest
from pdserve.errors import InvalidRequestError, PdserveError, StatusError
from pdserve.openai_api.auth import bearer_matches
from pdserve.openai_api.errors import error_body, parse_json_object

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logging: its format, its level
SHUTDOWN_POLL_S = 0.05  # how soon close() returns, and how often overdue connections are cut

SLOW_S = 0.1
"""A control message that takes longer is logged: a release must free within 50 ms."""
MAX_CONNECTIONS = 64
"""Connections served at once (one thread each). Decode nodes keep a few pooled connections
each; more than this are closed at accept."""
IDLE_TIMEOUT_S = 5.0
"""A connection that sends nothing for this long is closed (a socket timeout)."""
CONNECTION_THREAD = "pdserve-control-connection"
REQUEST_DEADLINE_S = 10.0
"""From the moment a connection waits for a request to its answer: past it, the connection
is shut down whatever it is doing (a control message takes milliseconds)."""


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `MAX_CONNECTIONS` of them, each with a deadline the
    serving loop enforces."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 drops a burst's SYNs: 1 s client retries

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 tls: ssl.SSLContext | None) -> None:  # fmt: skip
        self.tls = tls
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.deadlines: dict[Any, tuple[float, socket.socket]] = {}
        """Per connection (keyed by its accepted socket): when, and what to shut down."""
        self.deadlines_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """ThreadingMixIn's, with the bound, and threads named for what they are."""
        if not self.slots.acquire(blocking=False):
            logger.warning("pdserve control: %d connections open, refusing one", MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=CONNECTION_THREAD,
            daemon=True,
        )
        try:
            thread.start()
        except BaseException:
            self.slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.deadlines_lock:
                self.deadlines.pop(request, None)
            self.slots.release()

    def arm(self, key: Any, connection: socket.socket) -> None:
        with self.deadlines_lock:
            self.deadlines[key] = (time.monotonic() + REQUEST_DEADLINE_S, connection)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke (reset, cut at its deadline, a failed TLS handshake) is
        the peer's doing: logged, not printed as a traceback into vLLM's output."""
        logger.debug("pdserve control: connection from %s ended", client_address, exc_info=True)

    def service_actions(self) -> None:
        """Every poll of the serving loop: shut down connections past their deadline (their
        thread's blocked read returns, and the thread ends)."""
        now = time.monotonic()
        with self.deadlines_lock:
            overdue = [k for k, (deadline, _) in self.deadlines.items() if deadline < now]
            connections = [self.deadlines.pop(k)[1] for k in overdue]
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by its thread
                connection.shutdown(socket.SHUT_RDWR)


class ControlServer:
    """Serves `table` (guarded by `lock`) on host:port (0: any free port) in a thread; HTTPS
    when `tls` (a server context) is given."""

    def __init__(
        self,
        table: HandoffTable,
        lock: threading.Lock,
        host: str,
        port: int,
        cluster_secret: str | None,
        report: Callable[[], dict[str, Any]] = dict,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.table, self.lock = table, lock
        self.cluster_secret = cluster_secret
        self.report = report
        """More of the node's state for `GET /kv/handoffs`."""
        self._http = _BoundedServer((host, port), _handler_class(self), tls)
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

    def post(self, path: str, data: Any, has_credential: bool) -> dict[str, Any]:
        """One POST's answer body (a `PdserveError` for a refusal): the control plane's
        rules, run under the table's lock."""
        if path == "/v1/abort_requests":
            return self.abort(AbortRequest.from_json(data), has_credential)
        control_plane.authorize_control(has_credential, self.cluster_secret)
        operation = control_plane.operation(path, data)
        with self.lock:
            result = operation.act(self.table)
        reply: BaseModel = operation.answer(result)
        return reply.model_dump(mode="json")

    def abort(self, body: AbortRequest, admin: bool) -> dict[str, Any]:
        """As a pdserve node's abort API, for handoffs only: vLLM aborts its own running
        requests when their clients leave."""
        token = body.release_token
        with self.lock:
            control_plane.authorize_abort(
                admin, token, lambda: self.table.covers(body.ids, str(token))
            )
            results = self.table.abort(body.ids, token, admin)
        return control_plane.abort_answer(body.ids, results)

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


def _read_body(rfile: Any, declared: str | None) -> Any:
    """The request's JSON body, read with the limits pdserve's nodes apply."""
    declared = (declared or "0").strip()
    if not declared.isdigit():
        raise InvalidRequestError("bad Content-Length header")
    if int(declared) > control_plane.MAX_BODY_BYTES:
        raise StatusError(
            f"body larger than {control_plane.MAX_BODY_BYTES} bytes",
            status=413,
            error_type="invalid_request_error",
        )
    return parse_json_object(rfile.read(int(declared)) or b"{}")


def _handler_class(server: ControlServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_TIMEOUT_S  # StreamRequestHandler sets it on the socket
        # Headers and body go out as two writes: with Nagle's algorithm the body would
        # wait for the client's delayed ACK of the headers (40 ms on Linux, every call).
        disable_nagle_algorithm = True

        def setup(self) -> None:
            self.accepted = self.request
            self._bounded().arm(self.accepted, self.request)
            tls = self._bounded().tls
            if tls is not None:  # the handshake here, not in the accept loop
                self.request.settimeout(IDLE_TIMEOUT_S)
                self.request = tls.wrap_socket(self.request, server_side=True)
                self._bounded().arm(self.accepted, self.request)
            super().setup()

        def handle_one_request(self) -> None:
            # Each request on a kept-alive connection gets its own deadline.
            self._bounded().arm(self.accepted, self.request)
            super().handle_one_request()

        def _bounded(self) -> _BoundedServer:
            assert isinstance(self.server, _BoundedServer)
            return self.server

        def do_GET(self) -> None:
            if self.path != "/kv/handoffs":
                self._send(404, _error(f"no route {self.path}", "not_found_error"))
            elif not self._has_credential() and server.cluster_secret:
                self._send(401, error_body(control_plane.credential_required()))
            else:
                self._send(200, server.handoffs())

        def do_POST(self) -> None:
            started = time.monotonic()
            try:
                data = _read_body(self.rfile, self.headers.get("content-length"))
                status, reply = 200, server.post(self.path, data, self._has_credential())
            except PdserveError as e:
                status, reply = e.http_status, error_body(e)
            took_s = time.monotonic() - started
            if took_s > SLOW_S:
                logger.warning("POST %s took %.3f s", self.path, took_s)
            self._send(status, reply)

        def _has_credential(self) -> bool:
            """`Authorization: Bearer <cluster secret>` (never, when no secret is set)."""
            given = self.headers.get("authorization", "").encode("latin-1", "replace")
            return bearer_matches(given, server.cluster_secret)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("control %s", format % args)

    return Handler


def _error(message: str, error_type: str) -> dict[str, Any]:
    return error_body(StatusError(message, status=404, error_type=error_type))
