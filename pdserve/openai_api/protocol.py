"""OpenAI request bodies, validated, and their translation to `SamplingParams`.

Every field is honoured or refused with a 400 naming it, never ignored: the fields below
are type-checked by pydantic and range-checked by `SamplingParams`; fields of OpenAI's API
and vLLM's extensions that pdserve does not serve pass only with values that ask for
nothing (`fields.screen`); any other field is unrecognized. Chat messages follow OpenAI's
schema (`parse_message`), tool calls and results included (`pdserve/tools.py`); non-text
content is refused the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import JsonDict

from pdserve import structured
from pdserve.errors import InvalidRequestError, StatusError
from pdserve.openai_api import fields
from pdserve.sampling_params import SamplingParams
from pdserve.tools import ToolSpec


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(fields.ScreenedBody):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    """vLLM's extension: choices carry `token_ids` (and the response `prompt_token_ids`)."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, as OpenAI sends it) → a bias added to its logit."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    kv_transfer_params: dict[str, Any] | None = None
    """A P/D leg's parameters, read by the node's `NodeLegs` (`pd_legs.py`)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's: `text`, `json_object`, or `json_schema` (structured.py)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: one of `json`, `regex`, `choice`, `grammar` (Lark or GBNF), `json_object`."""

    def output_limits(self) -> tuple[int | None, int | None]:
        """(max output tokens, logprobs per token): each request kind reads its own fields
        and defaults (the one place they are decided)."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        max_tokens, logprobs = self.output_limits()
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            grammar=self.grammar(),
        )

    def grammar(self) -> str | None:
        """The output's grammar, checked: a bad schema or grammar is a 400 here, before
        the engine sees the request."""
        grammar = structured.grammar_for(self.response_format, self.structured_outputs)
        if grammar is not None:
            structured.check(
                grammar, "response_format" if self.response_format else "structured_outputs"
            )
        return grammar

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


DEFAULT_COMPLETION_TOKENS = 16
"""A completion's `max_tokens` when none is sent (OpenAI's legacy API)."""


def scores_prompt(body: Mapping[str, Any]) -> bool:
    """A completions body whose point is its prompt: its logprobs (echo with logprobs), or
    the prompt computed and nothing generated (max_tokens 0). The proxy runs such a call
    whole on a prefill node (prompt work, no handoff)."""
    return body.get("max_tokens") == 0 or (
        bool(body.get("echo")) and body.get("logprobs") is not None
    )


def check_model(asked: str | None, served: str) -> None:
    """A request's `model`: none, or the one this server serves (404 otherwise, as OpenAI)."""
    if asked not in (None, served):
        raise StatusError(
            f"model {asked!r} does not exist", status=404, error_type="not_found_error"
        )


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (id, bias) pairs; a key that is not a token id is a
    400 (ranges and count are `SamplingParams`' checks, the vocabulary's bound the engine's)."""
    biases: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        if not key.strip().isdigit():
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            )
        biases[int(key)] = float(bias)
    return tuple(sorted(biases.items()))


MAX_PROMPTS = 256
"""Prompts per completions call (lm-eval sends a few to tens)."""


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    """The prompt is returned before the completion, and with `logprobs` its tokens'
    logprobs too (the first token's is null): what lm-eval's loglikelihood reads."""

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (a string or token ids) or a list of them."""
        p = self.prompt
        many = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(many) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"at most {MAX_PROMPTS} prompts per request, got {len(many)}", param="prompt"
            )
        for i, one in enumerate(many):
            if not one:
                where = "prompt" if len(many) == 1 else f"prompt[{i}]"
                raise InvalidRequestError(f"{where} must not be empty", param="prompt")
        return many  # type: ignore[return-value]

    def output_limits(self) -> tuple[int | None, int | None]:
        """OpenAI's completions default to 16 tokens; 0 computes the prompt only."""
        return (DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens,
                self.logprobs)  # fmt: skip

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        if self.echo and params.logprobs is not None:
            params = replace(params, prompt_logprobs=params.logprobs)
        return params


ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, checked against OpenAI's schema (`parse_message`): its text
    joined from its parts, the role as the chat template knows it (`developer` is
    `system`), an assistant's tool calls and a tool result's call id."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None
    name: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None

    def template_input(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def parse_message(raw: Any, index: int) -> ChatMessage:
    """One element of `messages`; every refusal is a 400 naming the parameter as OpenAI
    does (`messages[0].content`)."""
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{where} must be an object with a role and content", param=where)
    role = raw.get("role")
    if role is None:
        raise InvalidRequestError(f"missing required parameter {where}.role", param=f"{where}.role")
    if role not in ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role"
        )
    if raw.get("function_call") is not None:
        raise InvalidRequestError(
            f"{where}.function_call is OpenAI's deprecated form: send tool_calls",
            param=f"{where}.function_call",
        )
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name")
    calls = _tool_calls(raw.get("tool_calls"), where) if role == "assistant" else ()
    if role != "assistant" and raw.get("tool_calls") is not None:
        raise InvalidRequestError(
            f"{where}.tool_calls belongs to assistant messages", param=f"{where}.tool_calls"
        )
    call_id = raw.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise InvalidRequestError(
            f"missing required parameter {where}.tool_call_id (a string)",
            param=f"{where}.tool_call_id",
        )
    if role != "tool" and call_id is not None:
        raise InvalidRequestError(
            f"{where}.tool_call_id belongs to tool messages", param=f"{where}.tool_call_id"
        )
    content: str | None = None
    if not (calls and raw.get("content") is None):  # an assistant's calls may come alone
        content = _message_text(raw.get("content"), f"{where}.content", role == "assistant")
    as_template = "system" if role == "developer" else role
    return ChatMessage(as_template, content, name, calls, call_id)  # type: ignore[arg-type]


def _tool_calls(raw: Any, where: str) -> tuple[dict[str, Any], ...]:
    """An assistant's `tool_calls` as OpenAI sends them back: id, type, function name and
    arguments (JSON text)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    calls = []
    for i, call in enumerate(raw):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        ok = (
            isinstance(function, dict)
            and call.get("type", "function") == "function"
            and isinstance(call.get("id", ""), str)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        )
        if not ok:
            raise InvalidRequestError(
                f"{at} must be {{id, type: 'function', function: {{name, arguments}}}} "
                "with arguments as JSON text",
                param=at,
            )
        assert isinstance(function, dict)
        calls.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return tuple(calls)


def parse_messages(cls: Any, raw: Any) -> Any:
    """A `messages` field's validator (before pydantic's own): each message parsed."""
    # InvalidRequestError is not a ValueError: pydantic lets it through as it is.
    if not isinstance(raw, list):
        return raw  # pydantic's own 400: messages must be a list
    return [parse_message(m, i) for i, m in enumerate(raw)]


def _message_text(content: Any, where: str, assistant: bool) -> str:
    """A message's `content`: a string, or a non-empty list of text parts (an assistant's
    may also hold refusal parts), joined."""
    if content is None:
        raise InvalidRequestError(
            f"missing required parameter {where} (a string or a list of text parts)", param=where
        )
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(
            f"{where} must be a string or a non-empty list of text parts", param=where
        )
    texts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        field = "refusal" if kind == "refusal" and assistant else "text"
        if kind != field:
            raise InvalidRequestError(
                f"{at}.type must be 'text' (this server reads text only); got {kind!r}",
                param=f"{at}.type",
            )
        text = part.get(field)
        if not isinstance(text, str):
            raise InvalidRequestError(f"{at}.{field} must be a string", param=f"{at}.{field}")
        texts.append(text)
    return "".join(texts)


def _text_part(field: str) -> JsonDict:
    return {
        "type": "object",
        "required": ["type", field],
        "properties": {"type": {"const": field}, field: {"type": "string"}},
    }


_PARTS: JsonDict = {
    "type": "array",
    "minItems": 1,
    "items": {"anyOf": [_text_part("text"), _text_part("refusal")]},
    "description": "text parts (refusal parts: assistant messages only)",
}
_TOOL_CALL: JsonDict = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
MESSAGE_SCHEMA: JsonDict = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {
            "anyOf": [{"type": "string"}, _PARTS, {"type": "null"}],
            "description": "required, except on an assistant message with tool_calls",
        },
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "assistant only"},
        "tool_call_id": {"type": "string", "description": "tool messages only (required)"},
    },
}
"""What `parse_message` accepts, as JSON Schema (for /openapi.json)."""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"items": MESSAGE_SCHEMA})
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the model's chat template (vLLM's; Qwen3's `enable_thinking`)."""

    _parse_messages = field_validator("messages", mode="before")(parse_messages)

    def output_limits(self) -> tuple[int | None, int | None]:
        """The context is the limit unless one is given; logprobs only when asked."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        return max_tokens, (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.template_input() for m in self.messages]

    def tool_spec(self) -> ToolSpec | None:
        """The request's tools and choice, checked (400s name the field)."""
        return ToolSpec.parse(self.tools, self.tool_choice, self.parallel_tool_calls)

    def grammar(self) -> str | None:
        """A forced tool choice's grammar, or the structured output's."""
        spec = self.tool_spec()
        forced = spec.grammar() if spec is not None else None
        if forced is None:
            return super().grammar()
        if super().grammar() is not None:
            raise InvalidRequestError(
                "a required or named tool_choice cannot be combined with response_format "
                "or structured_outputs",
                param="tool_choice",
            )
        structured.check(forced, "tools")
        return forced


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    """Rendered into the prompt as a chat with them would be (`pdserve/tools.py`)."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """The chat template's extra variables, as a chat request's."""
    add_special_tokens: bool = True
    """The model's BOS where its tokenizer adds one and the text does not start with it,
    as the engine encodes completion prompts and rendered chats alike (vLLM defaults to
    false for messages; here the count must be what a chat computes)."""
    return_token_strs: bool = False

    _parse_messages = field_validator("messages", mode="before")(parse_messages)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
