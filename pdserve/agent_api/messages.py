"""Anthropic's Messages API (`POST /v1/messages`) on a node and on the proxy: each message is
a chat completion run by the server's own chat handler (`bridge.py`), as `/v1/responses`
is, so it takes the same templates, tool calling and P/D legs.

How the Messages API maps onto chat:
    system (a string or text blocks)       → a system message first
    user content: text blocks              → the user message's text
                  tool_result blocks       → tool messages answering their tool_use_id
    assistant content: text blocks         → the assistant message's text
                       tool_use blocks     → its tool calls (input as JSON arguments)
                       thinking blocks     → left out (templates drop earlier reasoning)
    tools (custom), tool_choice            → chat's tools; auto / any (required) / tool
                                             (named) / none; disable_parallel_tool_use
    stop_sequences, max_tokens, temperature, top_p, top_k → chat's fields
    output_config.format (json_schema)     → response_format
    thinking {type: disabled}              → chat_template_kwargs enable_thinking false
And back: reasoning → a `thinking` block, text → a `text` block, each tool call → a
`tool_use` block; finish "tool_calls" → stop_reason `tool_use`, "length" → `max_tokens`,
a stop string → `stop_sequence` (named), else `end_turn`. Errors take Anthropic's schema
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.agent_api.bridge import ChatHandler, ChatResult, run_chat
from pdserve.agent_api.responses_input import new_id
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.openai_api import fields
from pdserve.openai_api.errors import MAX_BODY_BYTES, read_json, validate_body

NOT_SERVED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "container": ("pdserve runs no code containers", (None,)),
    "mcp_servers": ("pdserve calls no MCP servers", (None, [])),
    "context_management": ("inputs are never compacted", (None,)),
    "cache_control": ("pdserve's prefix cache works without markers", (None,)),
    "diagnostics": ("pdserve returns no diagnostics", (None,)),
}
NO_EFFECT: dict[str, str] = {
    "service_tier": "pdserve has one tier",
    "inference_geo": "pdserve runs where it is deployed",
    "speed": "pdserve has one speed",
    "user_profile_id": "an end user's id, for the operator's own records",
    "workspace_id": "a label for the operator's own records",
}
MESSAGES_PATH = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class MessagesRequest(fields.ScreenedBody):
    """Anthropic's request body (its fields checked here; blocks by `chat_body`)."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    not_served = NOT_SERVED
    no_effect = NO_EFFECT

    def chat_body(self) -> dict[str, Any]:
        messages = []
        if self.system:
            messages.append({"role": "system", "content": _texts(self.system, "system")})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{i}]")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
        }
        for name, value in (
            ("stop", self.stop_sequences),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
        ):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_chat_tool_choice(self.tool_choice))
        user = (self.metadata or {}).get("user_id")
        if user is not None:
            body["user"] = str(user)
        if self.thinking is not None:
            if self.thinking.get("type") != "disabled":
                raise InvalidRequestError(
                    "thinking: the model thinks as it does, with no token budget; send "
                    "{type: 'disabled'} to turn a thinking model's thinking off, or leave it out",
                    param="thinking",
                )
            body["chat_template_kwargs"] = {"enable_thinking": False}
        fmt = _output_format(self.output_config)
        if fmt is not None:
            body["response_format"] = fmt
        return body


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param=where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise InvalidRequestError(
                f"{where}[{j}].type must be 'text' here (this server reads text only); "
                f"got {kind!r}",
                param=f"{where}[{j}].type",
            )
        if not isinstance(block.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}].text must be a string", param=f"{where}[{j}]")
        parts.append(block["text"])
    return "".join(parts)


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Messages API message as chat messages (a user turn's tool results come first,
    each as a tool message)."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"{where}.role must be user or assistant", param=f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of blocks", param=f"{where}.content"
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_texts([block], at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise InvalidRequestError(f"{at} needs an id and a name", param=at)
            if not isinstance(block.get("input", {}), dict):
                raise InvalidRequestError(f"{at}.input must be an object", param=f"{at}.input")
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequestError(f"{at}.tool_use_id must be a string", param=at)
            result = _texts(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            results.append(
                {"role": "tool", "tool_call_id": block["tool_use_id"], "content": result}
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise InvalidRequestError(
                f"{at}.type {kind!r} is not supported in a {role} message: pdserve reads "
                "text, tool_use (assistant) and tool_result (user) blocks",
                param=f"{at}.type",
            )
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
        raise InvalidRequestError(
            f"{where}: pdserve serves custom tools (name, description, input_schema) only",
            param=where,
        )
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    chosen: Any = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool" and isinstance(choice.get("name"), str):
        chosen = {"type": "function", "function": {"name": choice["name"]}}
    if chosen is None:
        raise InvalidRequestError(
            "tool_choice.type must be auto, any, tool (with a name) or none", param="tool_choice"
        )
    body: dict[str, Any] = {"tool_choice": chosen}
    if choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    return body


def _output_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    if not config:
        return None
    if config.get("effort") is not None:
        raise InvalidRequestError(
            "output_config.effort is not supported: the model has no effort level",
            param="output_config.effort",
        )
    fmt = config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise InvalidRequestError(
            "output_config.format must be {type: 'json_schema', schema: {...}}",
            param="output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


def _stop(choice: dict[str, Any], stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's end."""
    finish = choice.get("finish_reason")
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    prompt = int(usage.get("prompt_tokens", 0))
    return {
        "input_tokens": prompt - cached,
        "output_tokens": int(usage.get("completion_tokens", 0)),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


class _Blocks:
    """Content blocks folded from chat deltas, with the stream events that build them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open: str | None = None

    def _emit(self, kind: str, **data: Any) -> None:
        self.events.append((kind, {"type": kind, **data}))

    def feed(self, delta: dict[str, Any]) -> None:
        if delta.get("reasoning_content"):
            self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            self.close()
            function = call.get("function") or {}
            arguments = function.get("arguments") or "{}"
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = {}
            block = {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu"),
                "name": function.get("name"),
                "input": parsed,
            }
            self.blocks.append(block)
            index = len(self.blocks) - 1
            self._emit("content_block_start", index=index, content_block={**block, "input": {}})
            self._emit(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": arguments},
            )
            self._emit("content_block_stop", index=index)

    def _text(self, kind: str, text: str) -> None:
        field = "thinking" if kind == "thinking" else "text"
        if self._open != kind:
            self.close()
            start = {"type": kind, field: ""}
            if kind == "thinking":
                start["signature"] = ""
            self.blocks.append(dict(start))
            self._emit("content_block_start", index=len(self.blocks) - 1, content_block=start)
            self._open = kind
        self.blocks[-1][field] += text
        delta = {"type": f"{kind}_delta" if kind == "thinking" else "text_delta", field: text}
        self._emit("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def close(self) -> None:
        if self._open is not None:
            self._emit("content_block_stop", index=len(self.blocks) - 1)
            self._open = None


class MessagesAPI:
    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat

    def routes(self) -> list[Route]:
        return [Route(MESSAGES_PATH, self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        try:
            body = validate_body(await read_json(request, MAX_BODY_BYTES), MessagesRequest)
            chat = body.chat_body()
        except PdserveError as e:
            return anthropic_error(e.http_status, e.message)
        if body.stream:
            chat.update(stream=True, stream_options={"include_usage": True})
        result = await run_chat(self.chat, request, chat)
        message: dict[str, Any] = {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": [],
        }
        if result.stream is not None:
            return StreamingResponse(
                self._events(message, body, result), media_type="text/event-stream"
            )
        if result.status >= 400 or result.body is None:
            return _error_of(result)
        choice = (result.body.get("choices") or [{}])[0]
        blocks = _Blocks()
        blocks.feed(choice.get("message") or {})
        stop_reason, stop_sequence = _stop(choice, body.stop_sequences or [])
        message.update(
            content=blocks.blocks,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(result.body.get("usage")),
        )
        return JSONResponse(message)

    async def _events(
        self, message: dict[str, Any], body: MessagesRequest, result: ChatResult
    ) -> AsyncGenerator[str, None]:
        start = {
            **message,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        yield _sse("message_start", {"type": "message_start", "message": start})
        blocks = _Blocks()
        usage, last = None, {}
        async with contextlib.aclosing(result.chunks()) as chunks:
            async for chunk in chunks:
                if isinstance(chunk.get("error"), dict):
                    error = chunk["error"]
                    code = error.get("code") if isinstance(error.get("code"), int) else 500
                    kind = ERROR_TYPES.get(code, "api_error")
                    data = {
                        "type": "error",
                        "error": {"type": kind, "message": error.get("message")},
                    }
                    yield _sse("error", data)
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    blocks.feed(choice.get("delta") or {})
                    if choice.get("finish_reason"):
                        last = choice
                for kind, data in blocks.events:
                    yield _sse(kind, data)
                blocks.events.clear()
        blocks.close()
        stop_reason, stop_sequence = _stop(last, body.stop_sequences or [])
        for kind, data in blocks.events:
            yield _sse(kind, data)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield _sse(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(usage)}
        )
        yield _sse("message_stop", {"type": "message_stop"})


def _error_of(result: ChatResult) -> Response:
    if result.status == 499:
        return Response(status_code=499)
    error = (result.body or {}).get("error")
    message = error.get("message") if isinstance(error, dict) else "the request failed"
    return anthropic_error(result.status if result.status >= 400 else 502, str(message))


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


OPENAPI = {MESSAGES_PATH: (MessagesRequest, "Anthropic's Messages API (SSE events when stream)")}
"""For /openapi.json (`openapi_document`'s `described`)."""
