"""No request field is silently ignored: every field of the `openai` SDK's chat and
completions requests (and of vLLM's extensions) is honoured, refused with a 400 naming it,
or a label that changes no output (docs/api.md); an unknown field is a 400. Walked from the
SDK's own request types, against a real node."""

from __future__ import annotations

import typing
from typing import Any

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from pdserve.openai_api import fields
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tests.api.conftest import API_KEY, Server

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]
IM_START = 1
"""SmolLM2's `<|im_start|>`: a special token, skipped when decoding unless asked."""

SDK_FIELDS = {
    CHAT: set(typing.get_type_hints(chat_create_params.CompletionCreateParamsBase)) | {"stream"},
    COMPLETIONS: set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))
    | {"stream"},
}
MODELS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}

ASKS_FOR_SOMETHING: dict[str, Any] = {
    # A value each field might be sent with that asks for more than nothing.
    "audio": {"voice": "alloy", "format": "wav"},
    "best_of": 3,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "Paris"},
    "reasoning_effort": "high",
    "response_format": {"type": "json_object"},
    "store": True,
    "suffix": " and that is all.",
    "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni"},
    "prompt_cache_options": {"ttl": "5m"},
    # labels (no effect)
    "user": "user-1",
    "metadata": {"team": "a"},
    "safety_identifier": "hash-1",
    "service_tier": "default",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "parallel_tool_calls": False,
    # honoured
    "echo": False,
    "frequency_penalty": 0.5,
    "logit_bias": {"13": 5},
    "logprobs": 2,
    "max_completion_tokens": 2,
    "max_tokens": 2,
    "n": 2,
    "presence_penalty": 0.5,
    "seed": 7,
    "stop": ["."],
    "stream": False,
    "stream_options": None,
    "temperature": 0.5,
    "top_logprobs": 2,
    "top_p": 0.9,
}


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _base(path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_tokens": 2}
    return {**body, "messages": HELLO} if path == CHAT else {**body, "prompt": "hi"}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_sdk_field_is_honoured_refused_or_a_label(path: str) -> None:
    """A field the SDK gains later fails here until it is given one of the three fates."""
    served = set(MODELS[path].model_fields)
    undecided = SDK_FIELDS[path] - served - set(fields.NOT_SERVED) - set(fields.NO_EFFECT)
    unrecognized = {"moderation", "prompt_cache_options"} & SDK_FIELDS[path]  # refused as unknown
    assert undecided == unrecognized, undecided
    assert not served & set(fields.NOT_SERVED), "a field is both served and refused"


@pytest.mark.parametrize(
    ("path", "name"),
    [
        (path, name)
        for path in (CHAT, COMPLETIONS)
        for name in sorted(SDK_FIELDS[path] - {"messages", "prompt", "model"})  # in every body
    ],
)
def test_walking_the_sdk_schema_each_field_works_or_is_a_400_naming_it(
    server: Server, path: str, name: str
) -> None:
    value = True if (path, name) == (CHAT, "logprobs") else ASKS_FOR_SOMETHING[name]
    needs = {"tools": ASKS_FOR_SOMETHING["tools"]} if name == "tool_choice" else {}
    response = _post(server, path, {**_base(path), **needs, name: value})
    if name in MODELS[path].model_fields or name in fields.NO_EFFECT:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"], error
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_fields_not_served_pass_only_when_they_ask_for_nothing(server: Server, path: str) -> None:
    nothing = {"best_of": 1, "suffix": "", "store": False, "priority": 0,
               "response_format": {"type": "text"}, "use_beam_search": False,
               "bad_words": [], "prompt_logprobs": None}  # fmt: skip
    if path == CHAT:  # completions have no tools: there they are unknown fields
        nothing |= {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none"}
    response = _post(server, path, {**_base(path), **nothing})
    assert response.status_code == 200, response.text
    for name, value in (("priority", 1), ("guided_json", {"type": "object"}), ("best_of", 2)):
        response = _post(server, path, {**_base(path), name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_unknown_field_is_a_400_in_openais_words(server: Server, path: str) -> None:
    response = _post(server, path, {**_base(path), "temprature": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "Unrecognized request argument supplied: temprature"
    assert error["param"] == "temprature"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _greedy(client: openai.OpenAI, **extra: Any) -> Any:
    return client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=4, temperature=0, **extra
    ).choices[0]


def test_logit_bias_steers_and_bans_tokens(client: openai.OpenAI) -> None:
    plain = _greedy(client, extra_body={"return_token_ids": True})
    first = plain.token_ids[0]
    banned = _greedy(client, logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    assert banned.token_ids[0] != first
    forced = _greedy(
        client,
        logit_bias={str(IM_START): 100},
        extra_body={"return_token_ids": True, "skip_special_tokens": False},
    )
    assert forced.token_ids == [IM_START] * 4
    assert forced.text == "<|im_start|>" * 4
    skipped = _greedy(client, logit_bias={str(IM_START): 100})
    assert skipped.text == ""


@pytest.mark.parametrize(
    ("bias", "message"),
    [({"x": 1}, "token ids"), ({"13": 101}, "[-100, 100]"), ({"10000000": 1}, "vocabulary")],
)
def test_a_bad_logit_bias_is_a_400(client: openai.OpenAI, bias: Any, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message.replace("[", r"\[")) as caught:
        _greedy(client, logit_bias=bias)
    assert caught.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    prompt = "The capital of France is Paris. The capital of Spain is"
    kwargs: dict[str, Any] = dict(model="default", prompt=prompt, max_tokens=24, temperature=0)
    cut = client.completions.create(**kwargs, stop=["."]).choices[0]
    kept = client.completions.create(
        **kwargs, stop=["."], extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + "."
