"""Completions as evaluation harnesses send them (lm-eval's `local-completions`): several
prompts in one call, `echo`, `max_tokens: 0`, and the prompt's logprobs in OpenAI's legacy
shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). Through the `openai`
SDK against a node on the default model in float32."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from pdserve.proxy.assembler import StreamAssembler
from tests.api.conftest import API_KEY, Server, kv_counters

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _offsets_follow_tokens(logprobs: Any) -> None:
    offsets, tokens = logprobs.text_offset, logprobs.tokens
    assert offsets[0] == 0
    for k in range(1, len(tokens)):
        assert offsets[k] == offsets[k - 1] + len(tokens[k - 1])


def _scoring_tolerance(server: Server) -> float:
    """How far a prompt's logprobs may sit from the ones sampling saw on this node. On the
    AVX2 float32 kernels over GGUF blocks, a one-row step (sampling) takes x split into
    fixed point 2^-14 below each block's largest while a prompt's rows (scoring) widen the
    blocks (quant_linear.h): up to 1.2e-3 apart here (AVX2 class, 2026-12-07), and
    test_quant bounds that path's distance to HF by 1e-2 for the same reason. Everywhere
    else both widen the same blocks: float32 rounding."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    compute = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10).json()
    compute = compute["data"][0]["compute"]
    splits_x = "(avx2" in compute["ops"] and not compute["quantization"].startswith("none")
    return 1e-2 if splits_x and compute["dtype"] == "float32" else 1e-4


def test_echoed_prompt_logprobs_are_what_sampling_saw(
    client: openai.OpenAI, server: Server
) -> None:
    """The prompt's logprobs of a text equal the logprobs its tokens had when the model
    sampled them: lm-eval's loglikelihood reads exactly these (`token_logprobs[ctx:-1]`)."""
    atol = _scoring_tolerance(server)
    done = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    sampled = done.choices[0]
    prompt_ids = done.model_extra["prompt_token_ids"]  # type: ignore[index]
    whole = prompt_ids + sampled.token_ids  # type: ignore[attr-defined]
    for max_tokens in (0, 1):
        scored = client.completions.create(
            model="default", prompt=whole, max_tokens=max_tokens, temperature=0, logprobs=2,
            echo=True,
        ).choices[0]  # fmt: skip
        lp = scored.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.tokens or []) == len(whole) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert scored.text.startswith(PROMPT + sampled.text)
        context = len(prompt_ids)
        echoed = lp.token_logprobs[context : len(whole)]
        assert echoed == pytest.approx(sampled.logprobs.token_logprobs, abs=atol)  # type: ignore[union-attr]
        assert [len(top) for top in lp.top_logprobs[1:]] == [2] * (len(lp.tokens or []) - 1)
        _offsets_follow_tokens(lp)
    assert scored.finish_reason == "length"


def test_several_prompts_in_one_call(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "One, two, three,", "Water boils at"]
    alone = [
        client.completions.create(model="default", prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    batched = client.completions.create(
        model="default", prompt=prompts, max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in batched.choices] == [0, 1, 2, 3, 4, 5]
    assert [c.text for c in batched.choices] == [t for t in alone for _ in range(2)]
    single = client.completions.create(model="default", prompt=prompts[0], max_tokens=5)
    assert batched.usage is not None and single.usage is not None
    assert batched.usage.completion_tokens == 30
    assert batched.usage.prompt_tokens > 3 * 3
    ids = client.completions.create(
        model="default", prompt=[[504, 2988], [30, 30, 30]], max_tokens=1, echo=True, logprobs=0
    )
    assert [len(c.logprobs.tokens or []) for c in ids.choices] == [3, 4]  # type: ignore[union-attr]


def test_an_echoed_stream_is_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "default", "prompt": PROMPT, "max_tokens": 8,
                              "temperature": 0, "echo": True, "logprobs": 1}  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    text, tokens, token_logprobs, offsets = "", [], [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                token_logprobs += choice.logprobs.token_logprobs or []
                offsets += choice.logprobs.text_offset or []
    assert whole.logprobs is not None
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert token_logprobs == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_several_prompts_stream_as_their_whole_answer(server: Server) -> None:
    body = {"prompt": [PROMPT, "One, two, three,"], "max_tokens": 6, "temperature": 0, "n": 2,
            "logprobs": 1, "echo": True, "return_token_ids": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assembler = StreamAssembler()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=streamed, headers=headers,
                      timeout=60) as events:  # fmt: skip
        lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assembler.add(json.loads(line[len("data: ") :]))
    answer, expected = assembler.answer(), whole.json()
    assert answer["usage"] == expected["usage"]
    # Equal but for the last bits of logprobs: a step's rows depend on what shares it.
    for got, want in zip(answer["choices"], expected["choices"], strict=True):
        got_lp, want_lp = got.pop("logprobs"), want.pop("logprobs")
        assert got == want
        assert got_lp["tokens"] == want_lp["tokens"]
        assert got_lp["text_offset"] == want_lp["text_offset"]
        assert got_lp["token_logprobs"] == pytest.approx(want_lp["token_logprobs"], abs=1e-4)


def test_a_client_leaving_a_stream_of_several_prompts_aborts_them_all(server: Server) -> None:
    body = {"prompt": [PROMPT, "Once upon a time"], "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers,
                      timeout=60) as events:  # fmt: skip
        for line in events.iter_lines():
            if line.startswith("data: {"):
                break  # both are running now; leave
    deadline = time.monotonic() + 10
    while kv_counters(server)["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_counters(server)["num_running"] == 0
    assert time.monotonic() < deadline


def test_max_tokens_zero_answers_nothing(client: openai.OpenAI) -> None:
    done = client.completions.create(model="default", prompt=PROMPT, max_tokens=0)
    assert done.choices[0].text == "" and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 0
    echoed = client.completions.create(model="default", prompt=PROMPT, max_tokens=0, echo=True)
    assert echoed.choices[0].text == PROMPT and echoed.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [PROMPT, ""]}, "prompt"),
        ({"prompt": [PROMPT] * 257}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_what_cannot_be_served_is_a_400(server: Server, body: dict[str, Any], param: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
