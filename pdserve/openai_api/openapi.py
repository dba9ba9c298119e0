"""The OpenAPI 3.1 document of a node or of the proxy (`GET /openapi.json`), for client
generators and API explorers.

Its paths are the app's own routes, read when asked, so it lists exactly what answers; the
completion bodies' schemas come from the pydantic models that validate them (chat messages
from `protocol.MESSAGE_SCHEMA`, next to the code that checks them), so they cannot drift
apart. Answers are described, not modelled: a completion is OpenAI's, every error is the
`Error` schema below.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from starlette.routing import Route

from pdserve.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

REF = "#/components/schemas/{model}"
BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
ABORT_BODY = {
    "type": "object",
    "required": ["request_ids"],
    "properties": {
        "request_ids": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": 1024,
            "description": "server request ids, X-Request-Ids or handoff ids",
        },
        "release_token": {
            "type": "string",
            "description": "instead of the admin key: this handoff's token",
        },
    },
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "null"]},
            },
        }
    },
}
SUMMARIES = {
    "/v1/completions": "OpenAI completions (SSE when stream is true)",
    "/v1/chat/completions": "OpenAI chat completions (SSE when stream is true)",
    "/v1/models": "the served model",
    "/tokenize": "a prompt or chat messages to the token ids the engine computes (vLLM's)",
    "/detokenize": "token ids to text (vLLM's)",
    "/health": "200 when serving, 503 while loading or draining",
    "/metrics": "Prometheus metrics",
    "/admin/kv": "KV pool counters and live handoffs",
    "/admin/departures": "the latest clients that left early, with their stage",
    "/v1/abort_requests": "abort requests, release handoffs (admin key or release token)",
    "/openapi.json": "this document",
}
"""Anything else (`/kv/*`) is the node-to-node control channel: docs/disaggregation.md."""


Described = Mapping[str, tuple[type[BaseModel] | None, str]]
"""Paths of layers above this one (the agent APIs): path → (its body's model, summary)."""


def openapi_document(
    routes: list[Any], title: str, open_paths: tuple[str, ...], described: Described | None = None
) -> dict[str, Any]:
    """The document for these routes; `open_paths` need no bearer key."""
    schemas: dict[str, Any] = {"Error": ERROR}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        for method in sorted(set(route.methods or ()) - {"HEAD"}):
            operation = _operation(route.path, schemas, described or {})
            if route.path in open_paths:
                operation["security"] = []
            paths.setdefault(route.path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _operation(path: str, schemas: dict[str, Any], described: Described) -> dict[str, Any]:
    model, summary = described.get(path, (BODIES.get(path), SUMMARIES.get(path)))
    summary = summary or "node-to-node control channel (cluster credential)"
    error_schema = {"schema": {"$ref": REF.format(model="Error")}}
    error = {
        "description": "an error in the OpenAI schema",
        "content": {"application/json": error_schema},
    }
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK"}, "4XX": error, "5XX": error},
    }
    body = _body_schema(path, model, schemas)
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return operation


def _body_schema(
    path: str, model: type[BaseModel] | None, schemas: dict[str, Any]
) -> dict[str, Any] | None:
    if model is not None:
        schema = model.model_json_schema(ref_template=REF)
        used = json.dumps(schema)  # ChatMessage, the parsed form, is not what clients send
        schemas.update(
            (k, v) for k, v in schema.pop("$defs", {}).items() if REF.format(model=k) in used
        )
        schemas[model.__name__] = schema
        return {"$ref": REF.format(model=model.__name__)}
    if path == "/v1/abort_requests":
        return ABORT_BODY
    return None
