"""OpenAI's Responses API through the proxy, split across a prefill and a decode node (the
tiny chat model: random weights, a byte-level tokenizer), driven by the `openai` SDK.

A response is a chat completion underneath (`pdserve/agent_api/`), so the strongest check
is equality: greedy, the response's text is the chat answer to the messages the Responses
request stands for, whether it was streamed, chained through `previous_response_id` (over
a proxy restart, from SQLite), or given its history inline."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.agent_api import responses_input
from pdserve.launch import Node, stop_all
from tests.api.conftest import API_KEY, Server, start_servers
from tests.proxy.conftest import agent_node_args, start_agent_proxy

pytestmark = pytest.mark.timeout(240)

GREEDY = {"temperature": 0.0}


class Item(BaseModel):
    label: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)


TOOLS: list[Any] = [
    {"type": "function", "name": "put", "description": "store an item",
     "parameters": Item.model_json_schema()},
    {"type": "function", "name": "get", "parameters": {
        "type": "object", "properties": {"label": {"type": "string", "maxLength": 8}},
        "required": ["label"], "additionalProperties": False}},
]  # fmt: skip


@pytest.fixture(scope="module")
def proxy(
    agent_nodes: tuple[Server, Server], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    """A proxy that asks clients for no key: each client's key names its stored responses."""
    front = start_agent_proxy(agent_nodes, tmp_path_factory.mktemp("store") / "r.sqlite3")
    yield front
    stop_all([front])


def sdk(proxy: Node, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)


def chat_text(proxy: Node, messages: list[dict[str, Any]], **fields: Any) -> str:
    done = sdk(proxy).chat.completions.create(model=None, messages=messages, **fields)  # type: ignore[call-overload]
    return str(done.choices[0].message.content or "")


def test_a_response_is_the_chat_answer_streamed_or_not(proxy: Node) -> None:
    client = sdk(proxy)
    asked = {"input": "hello", "instructions": "be brief", "max_output_tokens": 12, **GREEDY}
    whole = client.responses.create(model="default", **asked)  # type: ignore[call-overload]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert whole.output_text == chat_text(proxy, messages, max_tokens=12, **GREEDY)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert whole.usage is not None and whole.usage.output_tokens == 12
    kinds, ids = [], set()
    with client.responses.stream(model="default", **asked) as stream:  # type: ignore[call-overload]
        for event in stream:
            kinds.append(event.type)
            if hasattr(event, "response"):
                ids.add(event.response.id)
    [streamed_id] = ids
    streamed = sdk(proxy).responses.retrieve(streamed_id)  # stored as the stream ended
    assert streamed.output_text == whole.output_text
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds.count("response.output_text.delta") >= 1
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip


def test_parse_with_a_pydantic_model_and_json_object(proxy: Server) -> None:
    client = sdk(proxy)
    for seed in range(2):  # sampled: the grammar alone makes it parse
        done = client.responses.parse(
            model="default", input=f"an item {seed}", text_format=Item, max_output_tokens=80
        )
        assert isinstance(done.output_parsed, Item), done
    done = client.responses.create(
        model="default", input="json", text={"format": {"type": "json_object"}},
        max_output_tokens=300, **GREEDY,
    )  # fmt: skip
    assert done.status == "completed", done
    assert isinstance(json.loads(done.output_text), dict)


def test_a_forced_tool_call_and_its_result_continue_the_conversation(proxy: Node) -> None:
    """The call comes back as a function_call item; its output, sent with
    previous_response_id, answers as the chat API answers the whole exchange."""
    client = sdk(proxy)
    first = client.responses.create(
        model="default", input="store one", tools=TOOLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "put"}, max_output_tokens=120, **GREEDY,
    )  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "put" and call.status == "completed"
    Item.model_validate_json(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "stored"}
    second = client.responses.create(
        model="default", previous_response_id=first.id, input=[result], tools=TOOLS,
        max_output_tokens=16, **GREEDY,
    )  # fmt: skip
    inline = client.responses.create(  # the same history, sent whole, stored nowhere
        model="default", store=False, tools=TOOLS, max_output_tokens=16, **GREEDY,
        input=[{"role": "user", "content": "store one"}, call.model_dump(), result],
    )  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: t[k] for k in t if k != "type"}}
                  for t in TOOLS]  # fmt: skip
    as_chat = chat_text(proxy, [
        {"role": "user", "content": "store one"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": "put", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "stored"},
    ], tools=chat_tools, max_tokens=16, **GREEDY)  # fmt: skip
    assert second.output_text == inline.output_text == as_chat
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(inline.id)


def _turn(client: openai.OpenAI, previous: str | None, text: str) -> Any:
    return client.responses.create(
        model="default", input=text, previous_response_id=previous, max_output_tokens=8,
        **GREEDY,
    )  # fmt: skip


def test_a_chain_of_five_turns_survives_a_proxy_restart(
    agent_nodes: tuple[Server, Server], tmp_path: Path
) -> None:
    """Turns 1-2 on one proxy, 3-5 on a new one reading the same SQLite file; turn 5 is
    the chat answer to the whole conversation, and its prefill computed only the tokens
    the earlier turns had not (the prefill node's counter)."""
    store = tmp_path / "responses.sqlite3"
    questions = ["one", "two", "three", "four", "five"]
    front = start_agent_proxy(agent_nodes, store)
    try:
        client = sdk(front)
        turns = [_turn(client, None, questions[0])]
        turns.append(_turn(client, turns[0].id, questions[1]))
    finally:
        stop_all([front])
    front = start_agent_proxy(agent_nodes, store)
    try:
        client = sdk(front)
        for question in questions[2:4]:
            turns.append(_turn(client, turns[-1].id, question))
        computed = _prompt_tokens_computed(agent_nodes[0])
        turns.append(_turn(client, turns[-1].id, questions[4]))
        computed = _prompt_tokens_computed(agent_nodes[0]) - computed
        messages: list[dict[str, Any]] = []
        for question, turn in zip(questions, turns, strict=True):
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": turn.output_text}]  # fmt: skip
        assert turns[-1].output_text == chat_text(front, messages[:-1], max_tokens=8, **GREEDY)
        usage = turns[-1].usage
        cached = usage.input_tokens_details.cached_tokens
        assert cached > 0 and computed == usage.input_tokens - cached, (computed, usage)
        with pytest.raises(openai.NotFoundError):  # another key's conversation is not there
            _turn(sdk(front, "bob"), turns[-1].id, "six")
    finally:
        stop_all([front])
    with sqlite3.connect(store) as db:  # the file holds the five, and no key in clear
        rows = db.execute("SELECT id, owner FROM pdserve_responses").fetchall()
    assert {r[0] for r in rows} == {t.id for t in turns}
    assert all(re.fullmatch("[0-9a-f]{64}", r[1]) for r in rows)


def test_the_fifth_turn_computes_only_its_new_tokens_with_two_prefill_nodes(
    agent_nodes: tuple[Server, Server], chat_model_dir: Path, tmp_path: Path
) -> None:
    """Cache-aware routing (the proxy hashing prompts with the nodes' own tokenizer) keeps
    a chain on the prefill node that holds its history: in turn 5 the two prefill nodes
    together compute exactly the prompt tokens that were not cached, and most were."""
    [other] = start_servers(agent_node_args(chat_model_dir, "prefill"))
    front = start_agent_proxy(agent_nodes, tmp_path / "r.sqlite3", "--model",
                              str(chat_model_dir), more_prefill=(other,))  # fmt: skip
    try:
        client = sdk(front)
        previous = None
        for question in ["one", "two", "three", "four"]:
            previous = _turn(client, previous, question * 8).id
        prefills = (agent_nodes[0], other)
        before = sum(_prompt_tokens_computed(p) for p in prefills)
        fifth = _turn(client, previous, "five" * 8)
        computed = sum(_prompt_tokens_computed(p) for p in prefills) - before
        usage = fifth.usage
        cached = usage.input_tokens_details.cached_tokens
        assert computed == usage.input_tokens - cached, (computed, usage)
        assert cached >= usage.input_tokens // 2, usage  # the history, to its last full block
    finally:
        stop_all([front, other])


def _prompt_tokens_computed(node: Server) -> int:
    view = httpx.get(f"{node.url}/admin/kv", headers={"Authorization": f"Bearer {API_KEY}"})
    return int(view.json()["num_prompt_tokens_computed"])


def test_stored_responses_belong_to_the_key_that_made_them(proxy: Node) -> None:
    alice, bob = sdk(proxy, "alice"), sdk(proxy, "bob")
    made = alice.responses.create(model="default", input="hi", max_output_tokens=2)
    assert alice.responses.retrieve(made.id).output_text == made.output_text
    asked = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]  # fmt: skip
    later = alice.responses.create(model="default", input=asked, previous_response_id=made.id,
                                   max_output_tokens=2)  # fmt: skip
    listed = alice.responses.input_items.list(later.id, order="asc")
    assert [(i.role, i.content[0].text) for i in listed.data] == [  # type: ignore[union-attr]
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]  # its own input, not its context
    newest = alice.responses.input_items.list(later.id, limit=1)
    assert newest.data[0].id == listed.data[-1].id and newest.has_more
    for call in (bob.responses.retrieve, bob.responses.delete, bob.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    alice.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as missing:
        alice.responses.create(model="default", input="x", previous_response_id=made.id)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_store_that_cannot_be_written_is_a_503_and_nothing_is_reported_stored(
    agent_nodes: tuple[Server, Server], tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    front = start_agent_proxy(agent_nodes, blocked / "responses.sqlite3")  # its directory is a file
    try:
        client = sdk(front)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as refused:
                client.responses.create(model="default", input="hi", max_output_tokens=2,
                                        stream=stream)  # fmt: skip
            assert refused.value.status_code == 503
            assert "response store is unavailable" in str(refused.value)
        done = client.responses.create(model="default", input="hi", max_output_tokens=2,
                                       store=False)  # fmt: skip
        assert done.status == "incomplete"
    finally:
        stop_all([front])


def test_every_field_of_the_sdk_request_is_served_refused_or_labelled(proxy: Node) -> None:
    """Issue 34's field walk for `responses.create`: every parameter the installed SDK can
    send is honoured, refused with a 400 naming it, or a documented label."""
    from openai.types.responses import response_create_params

    sdk_fields = set(response_create_params.ResponseCreateParamsBase.__annotations__)
    served = set(responses_input.ResponsesRequest.model_fields)
    known = served | set(responses_input.NOT_SERVED) | set(responses_input.NO_EFFECT)
    assert sdk_fields <= known, sorted(sdk_fields - known)
    client = sdk(proxy)
    for name in responses_input.NOT_SERVED:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="default", input="x", extra_body={name: {"a": 1}})
        assert refused.value.body["param"] == name, name  # type: ignore[index]
    refusals = [
        ({"include": ["file_search_call.results"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"background": True, "stream": True}, "stream"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ]
    for extra, param in refusals:
        body = {"model": "default", "input": "x", **extra}
        with pytest.raises(openai.BadRequestError) as refused:
            client.post("/responses", cast_to=object, body=body)
        assert refused.value.body["param"] == param, (extra, refused.value.body)  # type: ignore[index]


def test_a_background_response_runs_after_the_answer(proxy: Node) -> None:
    client = sdk(proxy)
    queued = client.responses.create(model="default", input="go", background=True,
                                     max_output_tokens=4, **GREEDY)  # fmt: skip
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.status == "incomplete" and done.usage is not None
    assert done.output_text == chat_text(proxy, [{"role": "user", "content": "go"}],
                                         max_tokens=4, **GREEDY)  # fmt: skip
