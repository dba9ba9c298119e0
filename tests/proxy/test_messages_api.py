"""Anthropic's Messages API through the proxy, split across a prefill and a decode node (the
tiny chat model), driven by the `anthropic` SDK: each message is the chat answer to the
messages it stands for (greedy, equal), streamed or not, tool round trips included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.agent_api import messages as messages_api
from pdserve.launch import Node, stop_all
from tests.api.conftest import API_KEY, Server
from tests.proxy.conftest import start_agent_proxy

pytestmark = pytest.mark.timeout(240)

GREEDY = {"extra_body": {"temperature": 0.0}}
"""The SDK no longer sends temperature itself; pdserve still honours it."""


class Item(BaseModel):
    label: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)


SCHEMA = {**Item.model_json_schema(), "additionalProperties": False}
TOOL = {"name": "put", "description": "store an item", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def proxy(
    agent_nodes: tuple[Server, Server], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    """A proxy that requires the key, as Anthropic's SDK sends it (x-api-key)."""
    store = tmp_path_factory.mktemp("store") / "r.sqlite3"
    front = start_agent_proxy(agent_nodes, store, "--api-key", API_KEY)
    yield front
    stop_all([front])


def client(proxy: Node, key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0)


def chat(proxy: Node, messages: list[dict[str, Any]], **fields: Any) -> Any:
    sdk = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)
    done = sdk.chat.completions.create(
        model="default", messages=messages, temperature=0.0, **fields
    )  # type: ignore[call-overload]
    return done.choices[0]


def test_a_message_is_the_chat_answer_streamed_or_not(proxy: Node) -> None:
    asked: dict[str, Any] = {
        "model": "default",
        "max_tokens": 12,
        "system": "be brief",
        "messages": [{"role": "user", "content": "hello"}],
        **GREEDY,
    }
    whole = client(proxy).messages.create(**asked)
    expected = chat(proxy, [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hello"}], max_tokens=12)  # fmt: skip
    [block] = whole.content
    assert block.type == "text" and block.text == expected.message.content
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    kinds = []
    with client(proxy).messages.stream(**asked) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == block.text  # type: ignore[union-attr]

    def prompt(usage: Any) -> int:  # Anthropic's input_tokens leave out cache reads
        return int(usage.input_tokens + usage.cache_read_input_tokens)

    assert prompt(final.usage) == prompt(whole.usage)
    assert final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_is_named(proxy: Node) -> None:
    text = chat(proxy, [{"role": "user", "content": "hi"}], max_tokens=12).message.content
    stop = text[3:5]  # a piece of what greedy decoding writes
    done = client(proxy).messages.create(
        model="default", max_tokens=12, stop_sequences=[stop],
        messages=[{"role": "user", "content": "hi"}], **GREEDY,
    )  # fmt: skip
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == stop
    assert stop not in done.content[0].text  # type: ignore[union-attr]


def test_a_tool_round_trip(proxy: Node) -> None:
    """A forced tool_use, streamed and not; its tool_result answers as chat answers the
    same exchange."""
    sdk = client(proxy)
    question = {"role": "user", "content": "store one"}
    forced = {"type": "tool", "name": "put", "disable_parallel_tool_use": True}
    used = sdk.messages.create(model="default", max_tokens=120, tools=[TOOL], tool_choice=forced,  # type: ignore[list-item, arg-type]
                               messages=[question], **GREEDY)  # type: ignore[list-item]  # fmt: skip
    [call] = used.content
    assert used.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "put"
    Item.model_validate(call.input)
    with sdk.messages.stream(model="default", max_tokens=120, tools=[TOOL], tool_choice=forced,  # type: ignore[list-item, arg-type]
                             messages=[question], **GREEDY) as stream:  # type: ignore[list-item]  # fmt: skip
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert streamed.content[0].input == call.input  # type: ignore[union-attr]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "stored"}
    answer = sdk.messages.create(
        model="default", max_tokens=10, tools=[TOOL],  # type: ignore[list-item]
        messages=[question, {"role": "assistant", "content": used.content},  # type: ignore[list-item, typeddict-item]
                  {"role": "user", "content": [result]}], **GREEDY,  # type: ignore[list-item]
    )  # fmt: skip
    arguments = json.dumps(call.input)
    expected = chat(
        proxy,
        [
            question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "put", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "stored"},
        ],
        max_tokens=10,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "put",
                    "description": "store an item",
                    "parameters": TOOL["input_schema"],
                },
            }
        ],
    )
    assert answer.content[0].text == expected.message.content  # type: ignore[union-attr]


def test_the_key_as_x_api_key_and_errors_in_anthropics_shape(proxy: Node) -> None:
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        client(proxy, "wrong").messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert unauthorized.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(proxy).messages.create(model="default", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "http://127.0.0.1/x.png"}}]}])  # fmt: skip
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "messages[0].content[0].type" in body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(proxy).messages.create(
            model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_every_field_of_the_sdk_request_is_served_refused_or_labelled(proxy: Node) -> None:
    from anthropic.types import message_create_params

    sdk_fields = set(message_create_params.MessageCreateParamsBase.__annotations__)
    served = set(messages_api.MessagesRequest.model_fields)
    known = served | set(messages_api.NOT_SERVED) | set(messages_api.NO_EFFECT)
    assert sdk_fields <= known, sorted(sdk_fields - known)
    sdk = client(proxy)
    base = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    refusals = [{name: {"a": 1}} for name in messages_api.NOT_SERVED] + [
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"output_config": {"effort": "high"}},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    ]
    for extra in refusals:
        with pytest.raises(anthropic.BadRequestError) as refused:
            sdk.post("/v1/messages", cast_to=object, body={**base, **extra})
        assert next(iter(extra)) in refused.value.body["error"]["message"], extra  # type: ignore[index]


def test_structured_output(proxy: Node) -> None:
    done = client(proxy).messages.create(
        model="default", max_tokens=80, messages=[{"role": "user", "content": "an item"}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )  # fmt: skip
    Item.model_validate_json(done.content[0].text)  # type: ignore[union-attr]
