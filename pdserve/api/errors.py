"""Errors in OpenAI's schema (`{"error": {"message", "type", "param", "code"}}`), and the
body reader whose failures become them."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from pdserve.errors import InvalidRequestError, PdserveError, StatusError


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


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """A request body that must be a JSON object of at most `max_bytes` (413, 400 otherwise)."""
    too_large = StatusError(
        f"body larger than {max_bytes} bytes", status=413, error_type="invalid_request_error"
    )
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit():
        raise InvalidRequestError("bad Content-Length header")
    if int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > max_bytes:
                raise too_large
    except ClientDisconnect as e:  # gone before its body arrived: nothing to answer
        raise StatusError("client closed the request", status=499,
                          error_type="client_closed_request") from e  # fmt: skip
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequestError("body must be a JSON object")
    return data
