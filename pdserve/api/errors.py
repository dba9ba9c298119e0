"""Errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from pdserve.errors import PdserveError, StatusError


def error_body(e: PdserveError) -> dict[str, dict[str, object]]:
    """The schema's body for an error (also sent as the last event of a broken stream)."""
    return {
        "error": {
            "message": e.message,
            "type": e.error_type,
            "param": e.param,
            "code": e.http_status,
        }
    }


def from_exception(e: PdserveError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.http_status)


def error_response(
    status: int, message: str, error_type: str, param: str | None = None
) -> JSONResponse:
    return from_exception(StatusError(message, status=status, error_type=error_type, param=param))
