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
