"""Errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from pdserve.errors import PdserveError


def error_response(
    status: int, message: str, error_type: str, param: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def from_exception(e: PdserveError) -> JSONResponse:
    return error_response(e.http_status, e.message, e.error_type, e.param)
