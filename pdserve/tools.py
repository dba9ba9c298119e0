"""Tool calls: OpenAI's `tools` and `tool_choice`, in the prompt and out of the output.

One format on the wire between pdserve and the model, Hermes' (what Qwen2.5, Hermes and
many fine-tunes are trained on): each call is a JSON object in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- **In the prompt.** A chat template that knows tools (its text uses `tools`) gets them as
  Hugging Face templates take them: `tools=[...]`, and assistant `tool_calls` with their
  arguments as objects. A template that does not (the default model's) gets pdserve's own
  rendering (`hermes_messages`): the tools described in the system message, past calls as
  `<tool_call>` blocks in the assistant's text, tool results as `<tool_response>` blocks in
  a user turn. docs/api.md shows it.
- **Out of the output.** `tool_choice: "auto"` parses the model's own `<tool_call>` blocks
  (`ToolCallParser`); a block that is not a call to a known tool stays text, so nothing is
  lost. `"required"` and a named function are enforced by a grammar (`ToolSpec.grammar`):
  the model can only write calls, to the allowed tools, with arguments valid for their
  schemas, whatever the model. `"none"` leaves the output as text (the tools are still in
  the prompt, as vLLM does, so a P/D prefill leg sent `"none"` computes the same prompt).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_TEXT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""The tools block of pdserve's own rendering (Qwen2.5's words, which models of the Hermes
format know)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Choice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    """A chat request's tools and what it lets the model do with them."""

    tools: tuple[Tool, ...]
    choice: Choice
    name: str | None = None
    """The function a named `tool_choice` forces."""
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any, parallel: Any) -> ToolSpec | None:
        """OpenAI's fields, checked (a 400 naming the field); None without tools."""
        if parallel is not None and not isinstance(parallel, bool):
            raise InvalidRequestError(
                "parallel_tool_calls must be a boolean", param="parallel_tool_calls"
            )
        parsed = tuple(_tool(t, i) for i, t in enumerate(tools or ()))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools must have distinct names", param="tools")
        choice, name = _choice(tool_choice, names)
        if not parsed:
            return None
        return cls(parsed, choice, name, parallel is not False)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_openai() for t in self.tools]

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance's) of a forced choice: one or more calls (one when
        `parallel` is false) to the allowed tools, nothing else; None for auto and none."""
        if self.choice not in ("required", "named"):
            return None
        allowed = [t for t in self.tools if self.choice == "required" or t.name == self.name]
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in allowed
            ],
            "x-guidance": {"whitespace_flexible": False},
        }
        start = 'call ("\\n" call)*' if self.parallel else "call"
        return f'start: {start}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'


def _tool(raw: Any, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function'", param=f"{where}.type")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function must be an object", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(
            f"{where}.function.description must be a string",
            param=f"{where}.function.description",
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(
            f"{where}.function.parameters must be a JSON schema object",
            param=f"{where}.function.parameters",
        )
    return Tool(name, description, parameters)


def _choice(raw: Any, names: list[str]) -> tuple[Choice, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if raw in ("none", "auto", "required"):
        if raw != "none" and not names:
            raise InvalidRequestError(f"tool_choice {raw!r} needs tools", param="tool_choice")
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(raw, dict) and raw.get("type") == "function" and isinstance(name, str)):
        raise InvalidRequestError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return "named", name


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the prompt ---------------------------------------------------------------------------


def template_knows_tools(template: str) -> bool:
    """Whether a chat template renders tools itself (Hugging Face templates that do read
    a `tools` variable); pdserve renders them for one that does not."""
    return "tools" in template


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows tools: each call's arguments as an object (Hugging
    Face templates write `arguments | tojson`; OpenAI sends them as JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _as_object(c)}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _as_object(call: dict[str, Any]) -> Any:
    arguments = call["function"].get("arguments")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages a template without tools renders as the Hermes format: plain roles and
    text. The tools go at the end of the system message (one is added first if there is
    none); an assistant's calls become `<tool_call>` blocks after its text; each tool
    result becomes a user turn holding a `<tool_response>` block."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _as_object(c)})
                + f"\n{CLOSE}"
                for c in m["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools:
        block = SYSTEM_TEXT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# -- the output ---------------------------------------------------------------------------


@dataclass
class Parsed:
    """What a piece of output turned into: text for `content`, and whole calls."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


class ToolCallParser:
    """The model's output, streamed in (`feed`) or whole (`parse`), split into content and
    calls. Text that may be the start of a `<tool_call>` block is held back until it is
    known not to be; a block is released as a call once closed, or as text if it is not a
    call to a known tool (then or when the output ends unclosed: `finish`)."""

    def __init__(self, spec: ToolSpec) -> None:
        self._names = {t.name for t in spec.tools}
        self._max_calls = None if spec.parallel else 1
        self._pending = ""
        self.num_calls = 0

    def parse(self, text: str) -> Parsed:
        first, last = self.feed(text), self.finish()
        return Parsed(first.content + last.content, first.calls + last.calls)

    def feed(self, text: str) -> Parsed:
        self._pending += text
        content, calls = "", []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._pending, OPEN)
                content += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content += self._pending[:start]
                self._pending = self._pending[start:]
                break
            block = self._pending[start : end + len(CLOSE)]
            call = self._call(block[len(OPEN) : -len(CLOSE)])
            content += self._pending[:start]
            if call is None:
                content += block
            else:
                calls.append(call)
            self._pending = self._pending[end + len(CLOSE) :]
        return Parsed(content, tuple(calls))

    def finish(self) -> Parsed:
        """The output ended: what is still held back is text."""
        rest, self._pending = self._pending, ""
        return Parsed(rest)

    def _call(self, body: str) -> ToolCall | None:
        if self._max_calls is not None and self.num_calls >= self._max_calls:
            return None
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or data.get("name") not in self._names:
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                return None
        else:
            arguments = json.dumps(arguments, ensure_ascii=False)
        self.num_calls += 1
        return ToolCall(data["name"], arguments, new_call_id())


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
