"""The agent APIs' two folds, without a server: chat deltas into a Response and its events
(`responses_output.ResponseRun`), into Anthropic content blocks (`messages._Blocks`); and
Responses items into chat messages. The thinking model's reasoning is checked here (a
random model writes no `<think>` tags unless a regex makes it, which these APIs cannot
send); the servers' tests check the rest end to end."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.agent_api.messages import MessagesRequest, _Blocks
from pdserve.agent_api.responses_input import ResponsesRequest, chat_messages, input_items
from pdserve.agent_api.responses_output import ResponseRun
from pdserve.errors import InvalidRequestError

CALL = {"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "put", "arguments": '{"a": 1}'}}  # fmt: skip
DELTAS: list[dict[str, Any]] = [
    {"role": "assistant", "reasoning_content": "let me"},
    {"reasoning_content": " think"},
    {"content": "ok"},
    {"content": "!"},
    {"tool_calls": [CALL]},
]


def test_reasoning_text_and_a_call_fold_into_three_items_streamed_or_whole() -> None:
    streamed = ResponseRun(ResponsesRequest(input="x"))
    streamed.start("m")
    for delta in DELTAS:
        streamed.feed(delta)
    streamed.finish("tool_calls", {"prompt_tokens": 5, "completion_tokens": 7,
                                   "total_tokens": 12})  # fmt: skip
    streamed.final_event()
    events = streamed.take_events()
    whole = ResponseRun(ResponsesRequest(input="x"))
    whole.start("m")
    whole.feed({"reasoning_content": "let me think", "content": "ok!", "tool_calls": [CALL]})
    whole.finish("tool_calls", None)
    strip = [{k: v for k, v in o.items() if k != "id"} for o in streamed.output]
    assert strip == [{k: v for k, v in o.items() if k != "id"} for o in whole.output]
    reasoning, message, call = streamed.output
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "let me think"
    assert message["content"][0]["text"] == "ok!" and message["status"] == "completed"
    assert call == {**call, "type": "function_call", "call_id": "call_1", "name": "put",
                    "arguments": '{"a": 1}', "status": "completed"}  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["usage"]["output_tokens"] == 7


def test_anthropic_blocks_fold_the_same_deltas() -> None:
    blocks = _Blocks()
    for delta in DELTAS:
        blocks.feed(delta)
    blocks.close()
    assert blocks.blocks == [
        {"type": "thinking", "thinking": "let me think", "signature": ""},
        {"type": "text", "text": "ok!"},
        {"type": "tool_use", "id": "call_1", "name": "put", "input": {"a": 1}},
    ]
    kinds = [(k, d.get("index")) for k, d in blocks.events]
    assert kinds == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
        ("content_block_delta", 2), ("content_block_stop", 2),
    ]  # fmt: skip


def test_items_become_chat_messages() -> None:
    items = input_items([
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "b", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "a", "arguments": "{}"},
    ])  # fmt: skip
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": "{}"}}
             for c, n in (("c1", "a"), ("c2", "b"), ("c3", "a"))]  # fmt: skip
    assert chat_messages(items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": calls[:2]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": calls[2:]},
    ]


def test_anthropic_tool_results_come_before_the_users_text() -> None:
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "a", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "bad", "is_error": True},
                {"type": "text", "text": "and?"}]},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "tools": [{"name": "a", "input_schema": {"type": "object"}}],
        "thinking": {"type": "disabled"},
    })  # fmt: skip
    chat = body.chat_body()
    assert chat["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "tool_calls": [{"id": "t1",
         "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: bad"},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"type": "function_call", "name": "a", "arguments": "{}"}], "input[0].call_id"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0].type"),
    ],
)
def test_unusable_items_are_400s_naming_them(raw: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        input_items(raw)
    assert refused.value.param == param


def test_a_background_response_holds_its_slot_and_fails_without_one(tmp_path: Any) -> None:
    """`ResponsesAPI` over a fake chat handler (this layer alone): the slot is held while
    the chat request runs, and a slot refused (the proxy at capacity) fails the response."""
    import asyncio
    import contextlib

    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from pdserve.agent_api.responses import ResponsesAPI
    from pdserve.agent_api.store import SQLiteStore

    held: list[str] = []
    refuse = False

    @contextlib.asynccontextmanager
    async def slot(headers: list[tuple[bytes, bytes]]) -> Any:
        if refuse:
            raise RuntimeError("the proxy is at capacity")
        held.append("in")
        yield
        held.append("out")

    async def chat(request: Request) -> JSONResponse:
        assert held[-1] == "in"  # the chat request runs inside the slot
        message = {"role": "assistant", "content": "done"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        answer = {"model": "m", "choices": [choice], "usage": usage}
        return JSONResponse(answer)

    api = ResponsesAPI(chat, SQLiteStore(str(tmp_path / "r.sqlite3")), slot)
    transport = httpx.ASGITransport(app=Starlette(routes=api.routes()))

    async def run(refused: bool) -> dict[str, Any]:
        nonlocal refuse
        refuse = refused
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            started = await client.post("/v1/responses", json={"input": "x", "background": True})
            response_id = started.json()["id"]
            while api.running:  # until the background task has ended (its own event)
                await asyncio.wait([r.task for r in api.running.values() if r.task])
            return (await client.get(f"/v1/responses/{response_id}")).json()  # type: ignore[no-any-return]

    done = asyncio.run(run(False))
    assert done["status"] == "completed" and held == ["in", "out"]
    assert done["output"][0]["content"][0]["text"] == "done"
    failed = asyncio.run(run(True))
    assert failed["status"] == "failed" and "capacity" in failed["error"]["message"]
