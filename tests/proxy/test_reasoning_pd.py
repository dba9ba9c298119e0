"""A thinking model's chat (issue 54): `<think>` reasoning as `reasoning_content`, streamed
and not, on one node and through P/D; `chat_template_kwargs` reaching its template.

The model is the tiny chat model (Qwen3's shape) with Qwen3's generation prompt: with
`enable_thinking: false` it closes an empty `<think></think>` itself. Random weights
write no tags: a regex (`structured_outputs`) makes its answer think first.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.launch import stop_all
from tests.api.conftest import API_KEY, Server, start_servers
from tests.proxy.conftest import save_byte_tokenizer, start_proxy

pytestmark = pytest.mark.timeout(180)

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
THINK_THEN_ANSWER = {"structured_outputs": {"regex": r"<think>[a-z]{4,8}</think>[a-z]{2,5}"}}


@pytest.fixture(scope="module")
def thinking(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(proxy, a node that serves whole requests) on the thinking model."""
    path = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    shutil.copytree(tiny_model_dir("qwen3"), path, dirs_exist_ok=True)
    save_byte_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": QWEN3_TEMPLATE})
    )
    args = ["--model", str(path), "--dtype", "float32", "--api-key", API_KEY,
            "--num-kv-blocks", "128", "--max-model-len", "1024"]  # fmt: skip
    prefill, decode = start_servers([*args, "--role", "prefill"], [*args, "--role", "decode"])
    try:
        proxy = start_proxy([prefill.url], [decode.url])
    except BaseException:
        stop_all([prefill, decode])
        raise
    yield proxy, decode
    stop_all([proxy, prefill, decode])


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("where", ["node", "proxy"])
def test_reasoning_comes_apart_from_the_answer(thinking: Any, where: str) -> None:
    proxy, node = thinking
    client = _client(proxy if where == "proxy" else node)
    messages = [{"role": "user", "content": "think first"}]
    for seed in range(3):
        done = client.chat.completions.create(
            model=None, messages=messages, max_tokens=40, seed=seed,  # type: ignore[arg-type]
            extra_body=THINK_THEN_ANSWER,
        )  # fmt: skip
        message = done.choices[0].message
        thought = message.model_extra["reasoning_content"]  # type: ignore[index]
        assert thought.isalpha() and 4 <= len(thought) <= 8, message
        assert message.content is not None and message.content.isalpha(), message
        stream = client.chat.completions.create(
            model=None, messages=messages, max_tokens=40, seed=seed, stream=True,  # type: ignore[arg-type]
            extra_body=THINK_THEN_ANSWER,
        )  # fmt: skip
        deltas = [c.choices[0].delta for c in stream if c.choices]
        streamed_thought = "".join(
            (d.model_extra or {}).get("reasoning_content") or "" for d in deltas
        )
        streamed = "".join(d.content or "" for d in deltas)
        assert (streamed_thought, streamed) == (thought, message.content)


def test_enable_thinking_false_reaches_the_template(thinking: Any) -> None:
    """`chat_template_kwargs` reach the template (the prompt closes an empty think block),
    on /tokenize and in a chat, whose answer then has no reasoning."""
    proxy, node = thinking
    headers = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "user", "content": "hi"}]

    def prompt(kwargs: dict[str, Any] | None) -> str:
        body = {"messages": messages, "return_token_strs": True, "chat_template_kwargs": kwargs}
        r = httpx.post(f"{node.url}/tokenize", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return "".join(r.json()["token_strs"])

    assert "</think>" not in prompt(None) and "</think>" in prompt({"enable_thinking": False})
    done = _client(proxy).chat.completions.create(
        model=None, messages=messages, max_tokens=8,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert done.choices[0].message.model_extra["reasoning_content"] is None  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        _client(node).chat.completions.create(
            model=None, messages=messages, max_tokens=2,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": {"messages": []}},
        )  # fmt: skip
