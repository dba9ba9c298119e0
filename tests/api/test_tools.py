"""Tool calls (pdserve/tools.py): OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`,
tool calls and results in the history. Through the `openai` SDK against a node on the
default model (whose chat template knows no tools: pdserve's Hermes rendering), and the
parser and stream builder on their own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from pdserve.errors import InvalidRequestError
from pdserve.model.files import load_tokenizer
from pdserve.openai_api.responses import ChoiceBuilder
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.proxy.assembler import StreamAssembler
from pdserve.sampling_params import SamplingParams
from pdserve.tools import ToolCallParser, ToolSpec, hermes_messages
from tests.api.conftest import API_KEY, Server

pytestmark = pytest.mark.timeout(180)


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    days: int = Field(ge=1, le=7)


class Time(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: str = Field(max_length=12)


def function(name: str, model: type[BaseModel], description: str) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


TOOLS = [
    function("get_weather", Weather, "The weather forecast for a city"),
    function("get_time", Time, "The time in a time zone"),
]
ARGUMENTS = {"get_weather": Weather, "get_time": Time}
ASK = [{"role": "user", "content": "What will the weather be in Paris tomorrow?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def valid_calls(calls: Any, allowed: set[str]) -> list[tuple[str, BaseModel]]:
    """Each call's name is an allowed tool and its arguments validate against its schema."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        model = ARGUMENTS[call.function.name]
        out.append((call.function.name, model.model_validate_json(call.function.arguments)))
    return out


def test_required_and_named_choices_give_valid_calls(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=120, temperature=0,
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice  # one call, and the grammar ends
    assert choice.message.content is None
    assert len(valid_calls(choice.message.tool_calls, {"get_weather", "get_time"})) == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(2):
        # Parallel calls: the grammar lets the model add calls until it ends them or runs
        # out of tokens (then the cut call stays text and finish_reason says "length").
        done = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice=named,  # type: ignore[arg-type]
            max_tokens=160, seed=seed, temperature=1.0,
        )  # fmt: skip
        valid_calls(done.choices[0].message.tool_calls, {"get_time"})
        assert done.choices[0].finish_reason in ("tool_calls", "length")


def test_a_streamed_call_arrives_in_openai_s_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True,
    )  # fmt: skip
    pieces, finish, text = [], None, ""
    for chunk in stream:
        for choice in chunk.choices:
            pieces += choice.delta.tool_calls or []
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and text == ""
    assert [p.index for p in pieces] == [0]
    valid_calls(pieces, {"get_weather", "get_time"})


def test_a_two_turn_tool_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=120, temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24 C"}'},
    ]
    second = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, max_tokens=24, temperature=0,  # type: ignore[arg-type]
    )  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The history made the prompt longer by the call and its result, rendered as text.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # type: ignore[union-attr]


def test_tokenize_renders_the_tools_as_a_chat_does(server: Server, client: openai.OpenAI) -> None:
    def tokenize(body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.post(f"{server.url}/tokenize", json=body, headers=headers, timeout=30)

    plain = tokenize({"messages": ASK}).json()["count"]
    counted = tokenize({"messages": ASK, "tools": TOOLS}).json()["count"]
    done = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=1,  # type: ignore[arg-type]
    )  # fmt: skip
    assert counted == done.usage.prompt_tokens > plain + 50  # type: ignore[union-attr]
    refused = tokenize({"prompt": "hi", "tools": TOOLS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_auto_answers_text_or_calls_and_none_answers_text(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        done = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=40, temperature=0,
        )  # fmt: skip
        message = done.choices[0].message
        if message.tool_calls:  # the small model may or may not call
            assert choice == "auto"
            valid_calls(message.tool_calls, {"get_weather", "get_time"})
        else:
            assert message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "code"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0]"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    body = {"messages": ASK, "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body=body, cast_to=dict)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


def test_tools_on_completions_are_unrecognized(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.completions.create(
            model="default", prompt="x", max_tokens=2, extra_body={"tools": TOOLS}
        )


# -- the parts on their own ---------------------------------------------------------------

SPEC = ToolSpec.parse(TOOLS, "auto", None)
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["Sure. ", CALL, "\n", BAD, "<tool", "_call>", "x <"]), max_size=6),
    st.lists(st.integers(1, 30), max_size=40),
)
def test_a_stream_split_anywhere_parses_as_the_whole_text(
    parts: list[str], cuts: list[int]
) -> None:
    assert SPEC is not None
    text = "".join(parts)
    whole = ToolCallParser(SPEC).parse(text)
    parser, content, calls, at = ToolCallParser(SPEC), "", [], 0
    for n in [*cuts, len(text)]:
        piece = parser.feed(text[at : at + n])
        content, calls, at = content + piece.content, calls + list(piece.calls), at + n
    content += parser.finish().content
    assert content == whole.content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    # Nothing is lost: every call counted, every other character kept as text.
    assert len(whole.calls) == text.count(CALL)
    assert whole.content == text.replace(CALL, "")


def test_builder_streams_assemble_to_its_full_answer() -> None:
    text = f"Let me look.\n{CALL}\n{CALL.replace('UTC', 'CET')}"
    builder = ChoiceBuilder("chatcmpl-1", SamplingParams(max_tokens=99), True, "m", False,
                            tools=SPEC)  # fmt: skip
    assembler = StreamAssembler()
    for i in range(0, len(text), 7):
        last = i + 7 >= len(text)
        piece = CompletionOutput(0, text[: i + 7], delta_text=text[i : i + 7],
                                 finish_reason="stop" if last else None)  # fmt: skip
        for chunk in builder.stream_chunks(RequestOutput("r", [1], [piece], finished=last)):
            assembler.add(json.loads(json.dumps(chunk)))
    streamed = assembler.answer()["choices"][0]
    whole = CompletionOutput(0, text, finish_reason="stop")
    full = builder.full_response(RequestOutput("r", [1], [whole], finished=True))["choices"][0]
    assert streamed["finish_reason"] == full["finish_reason"] == "tool_calls"
    assert streamed["message"]["content"].strip() == full["message"]["content"] == "Let me look."
    args = [json.loads(c["function"]["arguments"]) for c in full["message"]["tool_calls"]]
    assert args == [{"zone": "UTC"}, {"zone": "CET"}]
    assert [c["function"] for c in streamed["message"]["tool_calls"]] == [
        c["function"] for c in full["message"]["tool_calls"]
    ]


def test_parallel_false_keeps_the_second_call_as_text() -> None:
    spec = ToolSpec.parse(TOOLS, "auto", False)
    assert spec is not None
    parsed = ToolCallParser(spec).parse(CALL + CALL)
    assert len(parsed.calls) == 1 and parsed.content == CALL


def test_the_default_model_s_template_gets_the_hermes_rendering() -> None:
    tokenizer = load_tokenizer("default")
    assert tokenizer is not None
    spec = ToolSpec.parse(TOOLS, "auto", None)
    assert spec is not None
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(history, tools=spec.template_tools())
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    assert hermes_messages([{"role": "user", "content": "hi"}], None) == [
        {"role": "user", "content": "hi"}
    ]


def test_tool_spec_refusals() -> None:
    with pytest.raises(InvalidRequestError, match="distinct"):
        ToolSpec.parse([TOOLS[0], TOOLS[0]], None, None)
    with pytest.raises(InvalidRequestError, match="parallel_tool_calls"):
        ToolSpec.parse(TOOLS, None, "yes")
    assert ToolSpec.parse(None, "none", None) is None
    assert ToolSpec.parse([], None, None) is None
