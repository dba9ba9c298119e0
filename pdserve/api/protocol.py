"""OpenAI request bodies, validated, and their translation to `SamplingParams`.

Every field is honoured or refused with a 400 naming it, never ignored: the fields below
are type-checked by pydantic and range-checked by `SamplingParams`; fields of OpenAI's API
and vLLM's extensions that pdserve does not serve pass only with values that ask for
nothing (`fields.screen`); any other field is unrecognized. Chat messages follow OpenAI's
schema (`parse_message`); tool messages and non-text content are refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from pdserve.api import fields
from pdserve.api.fields import NO_TOOLS
from pdserve.errors import InvalidRequestError, StatusError
from pdserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


def _document_screened(schema: JsonDict) -> None:
    """/openapi.json: the fields `fields.screen` passes, with what it does with them."""
    properties = schema.setdefault("properties", {})
    assert isinstance(properties, dict)
    for name, (why, accepted) in fields.NOT_SERVED.items():
        if name not in properties:
            allowed = ", ".join("null" if v is None else repr(v) for v in accepted)
            properties[name] = {"description": f"refused (400) unless {allowed}: {why}"}
    for name, effect in fields.NO_EFFECT.items():
        properties.setdefault(name, {"description": f"accepted, changes no output: {effect}"})


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_document_screened)

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

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        return fields.screen(data, set(cls.model_fields)) if isinstance(data, dict) else data

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


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


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (batched prompts are not supported yet)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError(
                    "batched prompts are not supported: send one prompt per request",
                    param="prompt",
                )
            p = p[0]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        return p  # type: ignore[return-value]


ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, checked against OpenAI's schema (`parse_message`): its text
    joined from its parts, the role as the chat template knows it (`developer` is
    `system`)."""

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None

    def template_input(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


def parse_message(raw: Any, index: int) -> ChatMessage:
    """One element of `messages`; every refusal is a 400 naming the parameter as OpenAI
    does (`messages[0].content`). Fields of tool calling are refused, not ignored: pdserve
    would answer as if the tools did not exist."""
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
    if role == "tool":
        raise InvalidRequestError(
            f"{where}: tool messages are not supported: {NO_TOOLS}", param=f"{where}.role"
        )
    for field in ("tool_calls", "function_call"):
        if raw.get(field) not in (None, []):
            raise InvalidRequestError(
                f"{where}.{field} is not supported: {NO_TOOLS}", param=f"{where}.{field}"
            )
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(f"{where}.name must be a string", param=f"{where}.name")
    content = _message_text(raw.get("content"), f"{where}.content", role == "assistant")
    return ChatMessage("system" if role == "developer" else role, content, name)


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
MESSAGE_SCHEMA: JsonDict = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, _PARTS]},
        "name": {"type": "string"},
    },
}
"""What `parse_message` accepts, as JSON Schema (for /openapi.json)."""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"items": MESSAGE_SCHEMA})
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    _parse_messages = field_validator("messages", mode="before")(parse_messages)

    def chat_messages(self) -> list[dict[str, str]]:
        return [m.template_input() for m in self.messages]
