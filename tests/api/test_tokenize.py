"""`/tokenize` counts what the engine computes, also for a tokenizer that adds BOS (the
default model's does not, so the server tests cannot see it): a prompt and a rendered
chat both start with the model's BOS, once."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from pdserve.api.tokenize import Tokenization
from pdserve.model.tokenizer import Tokenizer
from tests.engine.test_detokenizer import make_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
"""A template that writes no BOS of its own: the engine's encode adds it."""


def _client() -> tuple[TestClient, Tokenizer]:
    plain = make_tokenizer()
    bos = plain.eos_token_ids[0]  # the tiny vocabulary's one special token serves as BOS
    tok = Tokenizer(plain._tok, eos_token_ids=[bos], bos_token_id=bos, add_bos_token=True,
                    chat_template=TEMPLATE)  # fmt: skip
    tokenization = Tokenization("unused", "tiny")
    tokenization._tokenizer = tok

    async def tokenize(request: Request) -> Response:
        return await tokenization.tokenize(request, 64)

    app = Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"])])
    return TestClient(app), tok


def _tokens(client: TestClient, body: dict[str, Any]) -> list[int]:
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def test_prompts_and_chats_get_the_bos_the_engine_adds_once() -> None:
    client, tok = _client()
    bos = tok.bos_token_id
    prompt = _tokens(client, {"prompt": "hello world"})
    assert prompt == tok.encode("hello world") and prompt[0] == bos and prompt[1] != bos
    messages = [{"role": "user", "content": "hello"}]
    chat = _tokens(client, {"messages": messages})
    rendered = tok.apply_chat_template(messages)
    assert chat == tok.encode(rendered) and chat[0] == bos and chat[1] != bos
    bare = _tokens(client, {"prompt": "hello world", "add_special_tokens": False})
    assert bare == prompt[1:]
