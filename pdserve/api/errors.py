"""Errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from pdserve.errors import PdserveError


def error_response(
    status: int, message: str, error_type: str, param: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def error_body(e: PdserveError) -> dict[str, dict[str, object]]:
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
