"""A `/v1/responses` request, checked, as the chat completion request that serves it.

Every field is honoured, refused with a 400 naming it, or accepted as a label that changes
no output (`fields.screen`, with this API's own tables below; docs/api.md lists them).

How the Responses API maps onto chat (OpenAI's own mapping of the two APIs):
    instructions                  → a system message first (not carried to a continuation)
    input: a string               → one user message
    input items: message          → a message of its role (input_text / output_text parts)
                 function_call    → the assistant's tool call (calls in a row: one message)
                 function_call_output → a tool message answering its call_id
                 reasoning        → left out: chat templates drop earlier turns' reasoning
    previous_response_id          → that response's conversation (its context, input and
                                    output) before this input
    tools (function), tool_choice → chat's tools and tool_choice (grammar-enforced when
                                    required or named)
    text.format                   → response_format (json_schema, json_object)
    max_output_tokens             → max_completion_tokens
    reasoning.effort "none"       → chat_template_kwargs enable_thinking false (Qwen3)
    top_logprobs                  → logprobs on each output_text
"""

from __future__ import annotations

import uuid
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.openai_api import fields

NOT_SERVED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "conversation": ("send previous_response_id: pdserve keeps no conversation objects", (None,)),
    "prompt": ("pdserve has no stored prompt templates", (None,)),
    "max_tool_calls": ("pdserve runs no built-in tools", (None,)),
    "truncation": ("inputs are never truncated", (None, "disabled")),
    "context_management": ("inputs are never compacted", (None,)),
    "access_programs": ("pdserve has no access programs", (None,)),
    "background_options": ("a background response runs at once, with no window", (None,)),
    "image": ("pdserve answers in text only", (None,)),
    "moderation": ("pdserve runs no moderation", (None,)),
}
NO_EFFECT: dict[str, str] = {
    "service_tier": "pdserve has one tier",
    "safety_identifier": "an end user's id, for the operator's own records",
    "prompt_cache_key": "pdserve's prefix cache needs no key: it matches prompts by content",
    "prompt_cache_retention": "pdserve's prefix cache keeps blocks until it needs the space",
    "stream_options": "pdserve's stream events carry no obfuscation padding",
    "prompt_cache_options": "pdserve's prefix cache matches prompts by content, no breakpoints",
}
INCLUDABLE = {
    "message.output_text.logprobs": "with top_logprobs, output_text parts carry logprobs",
    "reasoning.encrypted_content": "reasoning items carry their text; nothing is encrypted",
}
"""`include` values pdserve serves (anything else is a 400)."""


class ResponsesRequest(fields.ScreenedBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    user: str | None = None

    not_served = NOT_SERVED
    no_effect = NO_EFFECT

    def check(self) -> None:
        """What pydantic's types do not say (400s naming the field)."""
        if self.metadata is not None and (
            len(self.metadata) > 16
            or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())
        ):
            raise InvalidRequestError(
                "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters",
                param="metadata",
            )
        for value in self.include or ():
            if value not in INCLUDABLE:
                raise InvalidRequestError(
                    f"include value {value!r} is not supported; pdserve serves "
                    f"{', '.join(sorted(INCLUDABLE))}",
                    param="include",
                )
        if self.background and not self.store:
            raise InvalidRequestError("a background response must be stored", param="background")
        if self.background and self.stream:
            raise InvalidRequestError(
                "a background response is not streamed here: poll GET /v1/responses/{id}",
                param="stream",
            )
        if isinstance(self.input, str) and not self.input:
            raise InvalidRequestError("input must not be empty", param="input")

    def thinking_off(self) -> bool:
        """`reasoning.effort` "none" turns a thinking model's thinking off; other efforts
        and summaries are refused: pdserve's models have no effort level."""
        reasoning = self.reasoning or {}
        for key, value in reasoning.items():
            if key == "effort" and value in (None, "none"):
                continue
            if value is not None:
                raise InvalidRequestError(
                    f"reasoning.{key} {value!r} is not supported: the model thinks as it "
                    "does (send effort 'none' to turn a thinking model's thinking off)",
                    param=f"reasoning.{key}",
                )
        return reasoning.get("effort") == "none"

    def chat_body(
        self, context: list[dict[str, Any]], items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The chat completion request that answers this one, after `context` (a previous
        response's conversation) and with this request's input `items` (`input_items`)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += chat_messages([*context, *items])
        if not messages:
            raise InvalidRequestError("input must hold at least one message", param="input")
        body: dict[str, Any] = {"messages": messages}
        if self.model is not None:
            body["model"] = self.model
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        for name, value in (
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("user", self.user),
            ("response_format", _response_format(self.text)),
        ):
            if value is not None:
                body[name] = value
        if self.top_logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.thinking_off():
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return body


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
               "reasoning": "rs"}  # fmt: skip


def input_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items of the API's shape (a string is one user message), each with an
    id (the client's, or a new one); each item checked, so a conversation only ever stores
    items a continuation can read."""
    items = _checked_items(raw)
    return [{"id": new_id(ID_PREFIXES[item["type"]]), **item} for item in items]


def _checked_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": [_part("user", raw)]}]
    items = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"{where}.role must be user, assistant, system or developer; got {role!r}",
                    param=f"{where}.role",
                )
            text = _text(item.get("content"), where)
            items.append({**item, "type": "message", "content": [_part(role, text)]})
        elif kind == "function_call":
            _require_strings(item, where, "call_id", "name", "arguments")
            items.append(item)
        elif kind == "function_call_output":
            _require_strings(item, where, "call_id")
            items.append({**item, "output": _text(item.get("output"), where, "output")})
        elif kind == "reasoning":
            items.append(item)
        else:
            raise InvalidRequestError(
                f"{where}.type {kind!r} is not supported: pdserve reads message, "
                "function_call, function_call_output and reasoning items",
                param=f"{where}.type",
            )
    return items


def _part(role: str, text: str) -> dict[str, Any]:
    """A message's text as one part of the API's shape (as `input_items` lists it)."""
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _require_strings(item: dict[str, Any], where: str, *keys: str) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise InvalidRequestError(
                f"missing required parameter {where}.{key} (a string)", param=f"{where}.{key}"
            )


TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _text(content: Any, where: str, key: str = "content") -> str:
    """A message's content (or a tool output): a string or text parts, joined."""
    at = f"{where}.{key}"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{at} must be a string or a list of text parts", param=at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise InvalidRequestError(
                f"{at}[{j}].type must be input_text or output_text (this server reads text "
                f"only); got {kind!r}",
                param=f"{at}[{j}].type",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{at}[{j}].text must be a string", param=f"{at}[{j}]")
        texts.append(text)
    return "".join(texts)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items (checked by `input_items`, or a stored output) as chat messages."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"], "input")})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not last.get("_closed"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_closed"] = True
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    for message in messages:
        message.pop("_closed", None)
    return messages


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidRequestError(
            f"{where}.type {kind!r} is not supported: pdserve serves function tools only",
            param=f"{where}.type",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    fmt = (text or {}).get("format")
    extra = set(text or {}) - {"format", "verbosity"}
    if extra or (text or {}).get("verbosity") not in (None, "medium"):
        raise InvalidRequestError(
            "text takes format only (verbosity: the model has no setting)", param="text"
        )
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object with a type", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError(
        "text.format.type must be text, json_object or json_schema", param="text.format"
    )
