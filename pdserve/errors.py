"""pdserve's exception types.

Every error a user can cause is one of these; the HTTP layer maps each class to an OpenAI
error JSON (`{"error": {"message", "type", "param", "code"}}`) with the status below.
Library code raises these instead of `assert`, which vanishes under `python -O`.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class. `http_status` and `error_type` drive the OpenAI error schema."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StatusError(PdserveError):
    """An error whose HTTP status and type are decided where it is raised (413, 404, an
    engine-side rejection relayed to the API process, ...)."""

    def __init__(
        self, message: str, *, status: int, error_type: str, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.http_status = status
        self.error_type = error_type


class InvalidRequestError(PdserveError):
    """The request (prompt, sampling parameters, ids) is malformed or out of range."""

    http_status = 400
    error_type = "invalid_request_error"


class ConfigError(PdserveError):
    """A configuration value is invalid; raised at start-up, never mid-request."""

    error_type = "config_error"


class ModelLoadError(PdserveError):
    """The model could not be loaded: missing or corrupt file, unsupported architecture."""

    error_type = "model_load_error"


class KVTransferError(PdserveError):
    """A decode leg's prompt KV could not come from its prefill node and the request fails
    (an incompatible prefill node, or policy `fail`): 502, as for any upstream failure. The
    engine had admitted the leg, so its KV connector has released the handoff."""

    http_status = 502
    error_type = "kv_transfer_error"


class RequestAbortedError(PdserveError):
    """The server aborted a request it had admitted while its caller was still waiting for
    the answer. The caller gets this error, never the engine's aborted output (which would
    read as a completion that stopped early). 409, as gRPC maps ABORTED: final, not a
    server fault, and not retried by the proxy, so an operator's abort
    (`POST /v1/abort_requests`) holds end to end. A request whose client left is aborted
    too, but then nobody is left to answer."""

    http_status = 409
    error_type = "request_aborted"


class ServerShuttingDownError(RequestAbortedError):
    """A draining node (SIGTERM) gave up on the request: a decode leg that had not loaded
    its KV yet, or anything still running at `--drain-timeout-s`. Another node can serve
    it, so 503 `service_unavailable`, as for the new requests a draining node refuses."""

    http_status = 503
    error_type = "service_unavailable"
