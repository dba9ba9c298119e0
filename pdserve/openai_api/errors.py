"""Errors in OpenAI's schema (`{"error": {"message", "type", "param", "code"}}`), and the
body reader whose failures become them."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pdserve.errors import InvalidRequestError, PdserveError, StatusError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 4 << 20
"""Largest completion body a node or the proxy reads."""
MAX_JSON_DEPTH = 64
"""Deepest nesting a body may have. OpenAI bodies nest a few levels (a chat message's
content part is 5 deep). Python's json module gives up with a RecursionError near 1,000
levels, and whatever walks a body afterwards (validation, the proxy's json.dumps of a leg)
would have to survive any depth: a bound well under both keeps every body a 400."""


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


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route {request.url.path}", "not_found_error")


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} not allowed here", "invalid_request_error")


async def internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error on %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error", "internal_error")


ERROR_HANDLERS: dict[Any, Any] = {404: not_found, 405: not_allowed, Exception: internal_error}
"""For every Starlette app (nodes and proxy): its own 404, 405 and 500 are plain text."""


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
        raise StatusError(
            "client closed the request", status=499, error_type="client_closed_request"
        ) from e
    return parse_json_object(bytes(body))


def validate_body(data: Any, model: type[M]) -> M:
    """`data` as `model`, or a 400 naming the first bad field (`param`: its top-level name)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":  # OpenAI's words for a field it does not know
            raise InvalidRequestError(
                f"Unrecognized request argument supplied: {where}", param=param
            ) from e
        raise InvalidRequestError(f"{where}: {first['msg']}", param=param) from e


def parse_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A body that must be a JSON object nested at most `max_depth` levels (400 otherwise)."""
    too_deep = InvalidRequestError(f"body is nested deeper than {max_depth} levels")
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise too_deep from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidRequestError("body must be a JSON object")
    if json_depth(data, max_depth + 1) > max_depth:
        raise too_deep
    return data


def json_depth(value: Any, stop_at: int | None = None) -> int:
    """How deep a parsed JSON value nests (a scalar 0, `{}` or `[]` 1), level by level
    rather than by recursion; counting stops at `stop_at`."""
    depth = 0
    containers = [value] if isinstance(value, (dict, list)) else []
    while containers and (stop_at is None or depth < stop_at):
        depth += 1
        children = (c for v in containers for c in (v.values() if isinstance(v, dict) else v))
        containers = [c for c in children if isinstance(c, (dict, list))]
    return depth
