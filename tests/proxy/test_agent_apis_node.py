"""The agent APIs on one node (no proxy), paced at 20 ms a token so that a request is still
running when its client leaves or cancels it: whichever way it ends, the engine holds
nothing of it afterwards (nothing running, every KV block back in the pool)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.conftest import API_KEY, Server, kv_counters, start_server, stop_server

pytestmark = pytest.mark.timeout(180)

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"type": "object", "required": ["s"], "additionalProperties": False,
        "properties": {"s": {"type": "string", "minLength": 1500}}}  # fmt: skip
"""An output of at least 1,500 tokens (one per byte): 30 s at the node's pace, unless cut."""


def paced_node(chat_model_dir: Path, store: Path) -> Server:
    return start_server(
        "--model", str(chat_model_dir), "--dtype", "float32", "--api-key", API_KEY,
        "--served-model-name", "default", "--max-model-len", "2048",
        "--debug-step-delay-s", "0.02", "--response-store", str(store),
    )  # fmt: skip


@pytest.fixture(scope="module")
def node(chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = paced_node(chat_model_dir, tmp_path_factory.mktemp("store") / "r.sqlite3")
    yield server
    assert stop_server(server) == 0


def wait_idle(node: Server) -> None:
    """Until the engine runs and holds nothing (prefix-cached blocks count as free)."""
    deadline = time.monotonic() + 10
    while True:
        kv = kv_counters(node)
        if (
            kv["num_running"] == kv["num_waiting"] == 0
            and kv["num_free_blocks"] == kv["num_blocks"]
        ):
            return
        assert time.monotonic() < deadline, kv
        time.sleep(0.02)


def long_response(**extra: Any) -> dict[str, Any]:
    fmt = {"type": "json_schema", "name": "long", "schema": LONG, "strict": True}
    return {"model": "default", "input": "go", "text": {"format": fmt},
            "max_output_tokens": 1900, **extra}  # fmt: skip


def test_cancelling_a_background_response_releases_it(node: Server) -> None:
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key=API_KEY, max_retries=0)
    started = client.post("/responses", cast_to=object, body=long_response(background=True))
    response_id = started["id"]  # type: ignore[index]
    wait_running(node)  # it runs after its answer came
    cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled"
    wait_idle(node)
    assert client.responses.retrieve(response_id).status == "cancelled"
    again = client.responses.cancel(response_id)  # an ended response is returned as it is
    assert again.status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only background responses are cancelled
        done = client.responses.create(model="default", input="x", max_output_tokens=1)
        client.responses.cancel(done.id)


def wait_running(node: Server) -> None:
    deadline = time.monotonic() + 10
    while kv_counters(node)["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_node_that_stops_ends_its_background_responses_as_cancelled(
    chat_model_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "r.sqlite3"
    server = paced_node(chat_model_dir, store)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        started = client.post("/responses", cast_to=object, body=long_response(background=True))
        wait_running(server)
    finally:
        assert stop_server(server) == 0
    with sqlite3.connect(store) as db:
        [row] = db.execute("SELECT response FROM pdserve_responses").fetchall()
    stored = json.loads(row[0])
    assert stored["id"] == started["id"] and stored["status"] == "cancelled"  # type: ignore[index]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_stream_whose_client_leaves_releases_it(node: Server, api: str) -> None:
    if api == "responses":
        path, body = "/v1/responses", long_response(stream=True, store=False)
    else:
        path = "/v1/messages"
        body = {"model": "default", "max_tokens": 1900, "stream": True,
                "messages": [{"role": "user", "content": "go"}],
                "output_config": {"format": {"type": "json_schema", "schema": LONG}}}  # fmt: skip
    with httpx.stream("POST", f"{node.url}{path}", json=body, headers=HEADERS, timeout=30) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and "delta" in json.loads(line[6:])["type"]:
                deltas += 1
                if deltas == 5:
                    break  # leave mid-stream
    wait_idle(node)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_waiting_client_that_leaves_releases_it(node: Server, api: str) -> None:
    if api == "responses":
        path, body = "/v1/responses", long_response()
    else:
        path = "/v1/messages"
        body = {"model": "default", "max_tokens": 1900,
                "messages": [{"role": "user", "content": "go"}],
                "output_config": {"format": {"type": "json_schema", "schema": LONG}}}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{node.url}{path}", json=body, headers=HEADERS, timeout=1.0)
    wait_idle(node)
