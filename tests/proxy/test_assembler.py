"""The proxy's assembly of a non-streaming answer from a stream: for every kind of request a
node serves, the stream assembled equals the node's own non-streaming answer (on the tiny
model with a byte-level tokenizer: its random tokens split UTF-8 characters, so many steps
add no text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.proxy.assembler import StreamAssembler
from tests.api.conftest import API_KEY, Server, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = [{"role": "user", "content": "Name three colours"}]


@pytest.fixture(scope="module")
def server(chat_model_dir: Path) -> Iterator[Server]:
    node = start_server(
        "--model",
        str(chat_model_dir),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
        "--api-key",
        API_KEY,
    )
    try:
        yield node
    finally:
        stop_server(node)


def assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    assembler = StreamAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.answer()


def test_chunks_fold_into_one_choice_per_index() -> None:
    def chunk(index: int, text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 5,
            "model": "m",
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "logprobs": {"tokens": [text], "token_logprobs": [-1]},
                }
            ],
        }

    answer = assembled(
        [
            chunk(1, "b", [2], None),
            chunk(0, "a", [1], None),
            chunk(0, "c", [3], "length"),
            chunk(1, "d", [4], "stop"),
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "choices": [],
                "usage": {"completion_tokens": 4},
            },
        ]
    )
    assert [c["text"] for c in answer["choices"]] == ["ac", "bd"]
    assert [c["token_ids"] for c in answer["choices"]] == [[1, 3], [2, 4]]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "stop"]
    assert answer["choices"][0]["logprobs"] == {"tokens": ["a", "c"], "token_logprobs": [-1, -1]}
    assert answer["usage"] == {"completion_tokens": 4} and answer["created"] == 5


def test_chat_deltas_fold_into_one_message() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    answer = assembled(
        [chunk({"role": "assistant", "content": "Hel"}), chunk({"content": "lo"}, "stop")]
    )
    assert answer["object"] == "chat.completion"
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]


def test_streamed_tool_calls_fold_into_whole_calls() -> None:
    """Parallel calls as vLLM streams them (its tool parsers): each call's id, type and name
    in its first piece, its arguments in pieces, every piece naming its call by `index`.
    The proxy kept only the last piece, so a non-streaming answer through it lost the
    arguments (issue 34)."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip

    def call(index: int, **fields: Any) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, **fields}]}

    answer = assembled([
        chunk({"role": "assistant", "content": ""}),
        chunk(call(0, id="t0", type="function", function={"name": "weather", "arguments": ""})),
        chunk(call(0, function={"arguments": '{"city": '})),
        chunk(call(1, id="t1", type="function", function={"name": "clock", "arguments": "{}"})),
        chunk(call(0, function={"arguments": '"Paris"}'})),
        chunk({}, "tool_calls"),
    ])  # fmt: skip
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,  # as OpenAI answers a message of calls alone
        "tool_calls": [
            {"id": "t0", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "t1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
        ],
    }  # fmt: skip
    legacy = assembled([chunk({"function_call": {"name": "f", "arguments": "{"}}),
                        chunk({"function_call": {"arguments": "}"}})])  # fmt: skip
    assert legacy["choices"][0]["message"]["function_call"] == {"name": "f", "arguments": "{}"}


def _stream(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    assembler = StreamAssembler()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", f"{server.url}{path}", json=stream_body, headers=HEADERS, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                assembler.add(json.loads(line[len("data: ") :]))
    return assembler.answer()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {
                "prompt": "The capital of France is",
                "max_tokens": 12,
                "logprobs": 2,
                "return_token_ids": True,
            },
        ),
        (
            "/v1/completions",
            {
                "prompt": "Once upon a time",
                "max_tokens": 10,
                "n": 2,
                "temperature": 0.9,
                "seed": 3,
                "logprobs": 1,
            },
        ),
        (
            "/v1/completions",
            {"prompt": "1, 2, 3,", "max_tokens": 16, "stop": ["L2"], "logprobs": 1},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": QUESTION,
                "max_tokens": 12,
                "logprobs": True,
                "top_logprobs": 2,
                "return_token_ids": True,
            },
        ),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "max_tokens": 10, "n": 2, "temperature": 0.9, "seed": 5},
        ),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "max_tokens": 24, "stop": ["{$i"], "logprobs": True},
        ),
    ],
    ids=[
        "completion-logprobs-ids",
        "completion-n2",
        "completion-stop",
        "chat-logprobs-ids",
        "chat-n2",
        "chat-stop",
    ],
)
def test_an_assembled_stream_equals_the_non_streaming_answer(
    server: Server, path: str, body: dict[str, Any]
) -> None:
    body = {"temperature": 0, **body}
    whole = httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=120).json()
    streamed = _stream(server, path, body)
    for answer in (whole, streamed):
        answer.pop("id"), answer.pop("created")
    assert streamed == whole
