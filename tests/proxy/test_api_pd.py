"""The newer API surface through the proxy, split across a prefill and a decode node, on the
tiny chat model (random weights, a byte-level tokenizer):
- structured outputs and forced tool calls: the prefill leg carries no grammar, the decode
  node samples every token under it (its first one too), so the output fits what was asked
  only because the grammar makes it;
- evaluation completions (several prompts, echo, prompt logprobs, max_tokens 0): a
  completion scoring its prompt runs whole on the prefill node."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.launch import stop_all
from tests.api.conftest import API_KEY, Server, start_servers
from tests.api.test_structured import drawn_models, parse_each
from tests.proxy.conftest import start_proxy

pytestmark = pytest.mark.timeout(180)


class Item(BaseModel):
    label: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)
    ok: bool


@pytest.fixture(scope="module")
def proxy(chat_model_dir: Path) -> Iterator[Server]:
    args = ["--model", str(chat_model_dir), "--dtype", "float32", "--api-key", API_KEY,
            "--num-kv-blocks", "256", "--max-model-len", "2048"]  # fmt: skip
    prefill, decode = start_servers([*args, "--role", "prefill"], [*args, "--role", "decode"])
    try:
        front = start_proxy([prefill.url], [decode.url])
    except BaseException:
        stop_all([prefill, decode])
        raise
    yield front
    stop_all([front, prefill, decode])


def test_parse_and_constraints_through_p_d(proxy: Server) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "an item"}]
    for seed in range(3):  # sampled: a different path through the grammar each time
        done = client.chat.completions.parse(
            model=None,
            messages=messages,
            response_format=Item,
            max_tokens=80,
            seed=seed,  # type: ignore[arg-type]
        )
        assert isinstance(done.choices[0].message.parsed, Item), done
    stream = client.chat.completions.create(
        messages=messages, max_tokens=40, stream=True, model=None,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"regex": r"[a-z]{3,6}-[0-9]{2}"}},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", text), text
    done = client.completions.create(
        model=None, prompt="x", max_tokens=60,  # type: ignore[arg-type]
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(done.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError, match="strnig"):
        client.chat.completions.create(
            model=None, messages=messages, max_tokens=4,  # type: ignore[arg-type]
            extra_body={"structured_outputs": {"json": {"type": "strnig"}}},
        )  # fmt: skip


def test_sdk_parse_of_20_generated_schemas_through_p_d(proxy: Server) -> None:
    """Issue 34's acceptance through P/D (tests/api/test_structured.py on one node)."""
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)
    parse_each(client, drawn_models(), None)


def test_forced_tool_calls_through_p_d(proxy: Server) -> None:
    """The prefill leg renders the same prompt (tools included) under tool_choice none; the
    decode node samples the calls under the grammar. Streamed and assembled by the proxy."""
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)
    tool = {"type": "function", "function": {"name": "put", "parameters": Item.model_json_schema()}}
    named = {"type": "function", "function": {"name": "put"}}
    for stream in (False, True):
        for seed in range(2):
            done = client.chat.completions.create(
                model=None, messages=[{"role": "user", "content": "put one"}],  # type: ignore[arg-type]
                tools=[tool], tool_choice=named, parallel_tool_calls=False,  # type: ignore[list-item]
                max_tokens=120, seed=seed, stream=stream,
            )  # fmt: skip
            if stream:
                chunks = [c.choices[0] for c in done if c.choices]  # type: ignore[union-attr]
                calls = [t for c in chunks for t in c.delta.tool_calls or []]
                finish = chunks[-1].finish_reason
            else:
                calls = done.choices[0].message.tool_calls or []  # type: ignore[union-attr]
                finish = done.choices[0].finish_reason  # type: ignore[union-attr]
                assert done.choices[0].message.content is None  # type: ignore[union-attr]
            assert finish == "tool_calls" and len(calls) == 1
            assert calls[0].function.name == "put"  # type: ignore[union-attr]
            Item.model_validate_json(calls[0].function.arguments)  # type: ignore[union-attr]


def _prefill_only_count(proxy: Server) -> float:
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    found = re.search(r'pdserve_proxy_disaggregation_total\{path="prefill_only"\} (\S+)', text)
    assert found, text
    return float(found.group(1))


def test_evaluation_completions_through_p_d(proxy: Server) -> None:
    """lm-eval's loglikelihood through the proxy: the prompt's logprobs, scored whole on the
    prefill node, equal those the P/D legs sampled the same tokens with; several prompts in
    one call answer as one call each."""
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)
    prompts = ["abc", "hello there"]
    ids = {"return_token_ids": True}

    def greedy(prompt: str) -> Any:
        return client.completions.create(model=None, prompt=prompt, max_tokens=5,  # type: ignore[arg-type]
                                         temperature=0, logprobs=1, extra_body=ids)  # fmt: skip

    sampled = [greedy(p) for p in prompts]
    # Token ids, as lm-eval sends them: a random model's bytes need not read back the same.
    wholes = [d.model_extra["prompt_token_ids"] + d.choices[0].token_ids for d in sampled]  # type: ignore[index, attr-defined]
    before = _prefill_only_count(proxy)
    scored = client.completions.create(
        model=None, prompt=wholes, max_tokens=1, temperature=0, logprobs=1, echo=True,  # type: ignore[arg-type]
    )  # fmt: skip
    assert _prefill_only_count(proxy) == before + 2
    assert [c.index for c in scored.choices] == [0, 1]
    for done, whole, choice in zip(sampled, wholes, scored.choices, strict=True):
        lp, expected = choice.logprobs, done.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and expected is not None
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(whole) + 1
        echoed = lp.token_logprobs[len(whole) - 5 : len(whole)]
        assert echoed == pytest.approx(expected.token_logprobs, abs=1e-4)
    nothing = client.completions.create(model=None, prompt="abc", max_tokens=0, echo=True)  # type: ignore[arg-type]
    assert nothing.choices[0].text == "abc" and nothing.usage.completion_tokens == 0  # type: ignore[union-attr]
    echoed = client.completions.create(model=None, prompt="abc", max_tokens=3, echo=True)  # type: ignore[arg-type]
    assert echoed.choices[0].text.startswith("abc")  # through both legs: the decode leg echoes
    usage_too = {"include_usage": True}
    streamed = client.completions.create(model=None, prompt=prompts, max_tokens=4, stream=True,  # type: ignore[arg-type]
                                         temperature=0, stream_options=usage_too)  # fmt: skip
    texts, usage = ["", ""], None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    whole = client.completions.create(model=None, prompt=prompts, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert texts == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 8  # type: ignore[union-attr]
