"""A real `pdserve proxy` process in front of the P/D test cluster, a stub node whose
answers a test sets (for upstream errors and hung or broken nodes), and a tiny model that
can chat (a byte-level tokenizer: random weights write any bytes, split UTF-8 included)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from pdserve.launch import NodeError, launch, stop_all, wait_healthy
from tests.api.conftest import API_KEY, Server, free_port, start_servers, stop_server
from tests.disagg.conftest import cluster  # noqa: F401  (the shared session fixture)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_byte_tokenizer(path: Path) -> None:
    """One token per byte (ids 0-255), ChatML's markers (256, 257: the end of a turn) and
    a ChatML template, for the tiny models' vocabulary of 320."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    # The model ends a turn with <|im_end|> too, not with the byte that has its config's id
    # (a grammar would let that byte through as text while the engine stopped on it).
    for name in ("config.json", "generation_config.json"):
        if (path / name).is_file():
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = tok.token_to_id("<|im_end|>")
            (path / name).write_text(json.dumps(config))


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a byte-level tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_model_dir("llama"), path, dirs_exist_ok=True)
    save_byte_tokenizer(path)
    return path


def start_proxy(prefill: list[str], decode: list[str], *extra: str) -> Server:
    args = ["--api-key", API_KEY, "--health-interval-s", "0.2"]
    args += [a for url in prefill for a in ("--prefill", url)]
    args += [a for url in decode for a in ("--decode", url)]
    proxy = launch([*args, *extra], env={"PDSERVE_LOG_LEVEL": "WARNING"}, command="proxy")
    try:
        return wait_healthy(proxy, timeout_s=60)
    except NodeError:
        stop_server(proxy)
        raise


def agent_node_args(chat_model_dir: Path, role: str) -> list[str]:
    """A node of the agent APIs' tests: the tiny chat model, served as `default`."""
    return ["--model", str(chat_model_dir), "--dtype", "float32", "--api-key", API_KEY,
            "--num-kv-blocks", "256", "--max-model-len", "2048", "--block-size", "16",
            "--served-model-name", "default", "--role", role]  # fmt: skip


@pytest.fixture(scope="package")
def agent_nodes(chat_model_dir: Path) -> Iterator[tuple[Server, Server]]:
    """(prefill, decode) for the agent APIs' tests (`test_responses_api.py`,
    `test_messages_api.py`, `test_response_store_pg.py`)."""
    prefill, decode = start_servers(
        agent_node_args(chat_model_dir, "prefill"), agent_node_args(chat_model_dir, "decode")
    )
    yield prefill, decode
    stop_all([prefill, decode])


def start_agent_proxy(
    nodes: tuple[Server, Server],
    store: Path | str,
    *extra: str,
    more_prefill: tuple[Server, ...] = (),
) -> Server:
    """A proxy in front of `agent_nodes` (and `more_prefill` nodes) that asks clients for no
    key (each client's key names its stored responses), storing responses in `store`."""
    prefill, decode = nodes
    args = ["--node-api-key", API_KEY, "--health-interval-s", "0.2", "--decode", decode.url,
            "--response-store", str(store), *extra]  # fmt: skip
    args += [a for node in (prefill, *more_prefill) for a in ("--prefill", node.url)]
    return wait_healthy(launch(args, env={"PDSERVE_LOG_LEVEL": "WARNING"}, command="proxy"), 60)


@pytest.fixture
def proxy_for() -> Iterator[Any]:
    """Start proxies for a test (stopped afterwards): `proxy_for(prefill_urls, decode_urls)`."""
    started: list[Server] = []

    def start(prefill: list[str], decode: list[str], *extra: str) -> Server:
        started.append(start_proxy(prefill, decode, *extra))
        return started[-1]

    yield start
    stop_all(started)


@dataclass
class Stub:
    """A node that answers every completion with `status` and `body` (after `delay_s`), and
    /health with 200. `calls` records the bodies it received. With a `summary`, it serves
    that as its prefix cache (`num_summaries`: how many times it did)."""

    url: str = ""
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    delay_s: float = 0.0
    calls: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    num_summaries: int = 0


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()

    async def completion(request: Request) -> Response:
        state.calls.append(await request.json())
        if state.delay_s:
            await asyncio.sleep(state.delay_s)
        return JSONResponse(state.body, status_code=state.status)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def prefix_cache(request: Request) -> Response:
        if state.summary is None:
            return JSONResponse({}, status_code=404)
        state.num_summaries += 1
        return JSONResponse(state.summary)

    app = Starlette(
        routes=[
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/health", health),
            Route("/admin/prefix_cache", prefix_cache),
            Route("/v1/abort_requests", health, methods=["POST"]),
        ]
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    state.url = f"http://127.0.0.1:{port}"
    yield state
    server.should_exit = True
    thread.join(timeout=5)


@dataclass
class SlowLink:
    """A TCP relay to a node that holds each chunk of the node's replies for `delay_s`: a
    slow link from the node back to the proxy, so a test can leave while an answer the
    node already sent is still on its way."""

    url: str
    delay_s: float


@pytest.fixture
def slow_link() -> Iterator[Any]:
    """`slow_link(node_url, delay_s)` → a SlowLink whose `url` reaches the node (closed
    afterwards)."""
    listeners: list[socket.socket] = []

    def pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                time.sleep(delay_s)
                sink.sendall(chunk)
        for s in (source, sink):  # one side ended: end the other
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve(listener: socket.socket, upstream: tuple[str, int], delay_s: float) -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = listener.accept()
                far = socket.create_connection(upstream)
                threading.Thread(target=pump, args=(near, far, 0.0), daemon=True).start()
                threading.Thread(target=pump, args=(far, near, delay_s), daemon=True).start()

    def start(node_url: str, delay_s: float) -> SlowLink:
        host, port = node_url.removeprefix("http://").rsplit(":", 1)
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)
        threading.Thread(
            target=serve, args=(listener, (host, int(port)), delay_s), daemon=True
        ).start()
        return SlowLink(f"http://127.0.0.1:{listener.getsockname()[1]}", delay_s)

    yield start
    for listener in listeners:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
        listener.close()
