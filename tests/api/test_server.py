"""The OpenAI API of one node, driven with the official `openai` client over loopback."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from pdserve import SamplingParams
from tests.api.conftest import API_KEY, Server, kv_counters


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_models(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == ["default"]
    import torch

    from pdserve.model import cpu_isa, cpu_kernels

    build = cpu_kernels.build_for(torch.float32, cpu_isa.effective())
    unavailable = build is None or cpu_kernels.unavailable_reason(torch.float32)
    card = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    compute = card.json()["data"][0]["compute"]
    assert compute["dtype"] == "float32" and compute["dtype_reason"] == "asked"
    assert compute["device"] == "cpu" and compute["cpu_level"] == cpu_isa.describe()
    assert compute["ops"] == ("torch" if unavailable else f"cpu-kernels ({build.isa.label})")
    assert kv_counters(server)["compute"] == compute


def test_completion_greedy_equals_offline_engine(client: openai.OpenAI, smollm2_llm: Any) -> None:
    prompt = "The capital of France is"
    got = client.completions.create(model="default", prompt=prompt, max_tokens=16, temperature=0)
    offline = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    assert got.choices[0].text == offline[0].outputs[0].text
    assert got.usage is not None and got.usage.prompt_tokens == len(offline[0].prompt_token_ids)
    assert got.usage.completion_tokens == len(offline[0].outputs[0].token_ids)


def test_chat_stream_with_usage_in_final_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    whole = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert whole.choices[0].message.content == text


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="default", prompt="def fibonacci(n):", max_tokens=20, temperature=0
    )
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


def test_n2_and_seeded_sampling_reproducible(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="default", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=2
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # each sample has its own seed


def test_stop_string(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=16, temperature=0
    ).choices[0]
    assert "." in full.text
    stopped = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=16, temperature=0, stop=["."]
    ).choices[0]
    assert stopped.text == full.text.split(".")[0]
    assert stopped.finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    ).choices[0]
    assert got.logprobs is not None and len(got.logprobs.token_logprobs or []) == 3
    assert "".join(got.logprobs.tokens or []) == got.text
    assert all(len(top) == 2 for top in got.logprobs.top_logprobs or [])


def _post(server: Server, path: str, body: Any, key: str | None = API_KEY, **kw: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30, **kw)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30, **kw)


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]
NESTED = b'{"a":' * 5000 + b"1" + b"}" * 5000
"""5,000 nested objects: Python's json gives up at ~1,000 levels (a 500 before the cap)."""
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _chat(*messages: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": list(messages), **extra}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (COMPLETIONS, b"{not json", 400, None),
        (COMPLETIONS, b"[1, 2]", 400, None),
        (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
        (COMPLETIONS, {"prompt": "hi", "n": 1000}, 400, "n"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi " * 3000}, 400, "prompt"),
        (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
        (COMPLETIONS, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "model": "gpt-9"}, 404, None),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        (CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p"),
        (CHAT, {"messages": HELLO, "stream": True, "max_tokens": 10**6}, 400, "max_tokens"),
        (COMPLETIONS, NESTED, 400, None),
        (CHAT, NESTED, 400, None),
        ("/v1/abort_requests", NESTED, 400, None),
        (CHAT, _chat({"role": "user"}), 400, "messages[0].content"),
        (CHAT, _chat(HELLO[0], {"role": "assistant"}), 400, "messages[1].content"),
        (CHAT, _chat({"role": "system", "content": None}), 400, "messages[0].content"),
        (CHAT, _chat({"content": "hi"}), 400, "messages[0].role"),
        (CHAT, _chat("hi"), 400, "messages[0]"),
        (CHAT, _chat({"role": "user", "content": 5}), 400, "messages[0].content"),
        (CHAT, _chat({"role": "user", "content": []}), 400, "messages[0].content"),
        (CHAT, _chat({"role": "user", "content": [IMAGE]}), 400, "messages[0].content[0].type"),
        (
            CHAT,
            _chat({"role": "user", "content": [{"type": "text"}]}),
            400,
            "messages[0].content[0].text",
        ),
        (CHAT, _chat({**HELLO[0], "name": 5}), 400, "messages[0].name"),
        (CHAT, _chat({"role": "tool", "content": "42"}), 400, "messages[0].tool_call_id"),
        (
            CHAT,
            _chat(HELLO[0], {"role": "assistant", "tool_calls": [{"id": "c1"}]}),
            400,
            "messages[1].tool_calls[0]",
        ),
        (CHAT, _chat({**HELLO[0], "tool_calls": [CALL]}), 400, "messages[0].tool_calls"),
        (CHAT, _chat(HELLO[0], tools=[{"type": "retrieval"}]), 400, "tools[0].type"),
        (CHAT, _chat(HELLO[0], tool_choice="auto"), 400, "tool_choice"),
        (CHAT, _chat(HELLO[0], tools=[TOOL], tool_choice={"type": "function"}), 400, "tool_choice"),
        (CHAT, _chat(HELLO[0], functions=[TOOL["function"]]), 400, "functions"),
        (CHAT, _chat(HELLO[0], response_format={"type": "xml"}), 400, "response_format"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_schema(
    server: Server, path: str, body: Any, status: int, param: str | None
) -> None:
    _assert_error(_post(server, path, body), status, param)


def test_chat_takes_openai_message_shapes(client: openai.OpenAI) -> None:
    """Text parts, `developer`, `name`, an assistant's refusal part and the no-op tool
    fields are accepted; parts read as the joined string would."""

    def greedy(messages: list[dict[str, Any]], **extra: Any) -> str:
        answer = client.chat.completions.create(
            model="default", messages=messages, max_tokens=8, temperature=0, **extra
        )
        return str(answer.choices[0].message.content)

    plain = greedy(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    )
    parts = greedy(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            {
                "role": "user",
                "name": "ann",
                "content": [{"type": "text", "text": "Name a colour."}],
            },
        ],
        tool_choice="none",
        tools=[],
        response_format={"type": "text"},
    )
    assert parts == plain
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    assert greedy([HELLO[0], refusal, {"role": "user", "content": "Why?"}])


def test_huge_body_is_413(server: Server) -> None:
    _assert_error(_post(server, COMPLETIONS, b"x" * (5 << 20)), 413)


def test_unknown_route_is_404(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    _assert_error(httpx.get(f"{server.url}/v1/nothing", headers=headers, timeout=5), 404)


def test_auth(server: Server) -> None:
    _assert_error(_post(server, COMPLETIONS, {"prompt": "hi"}, key=None), 401)
    _assert_error(_post(server, COMPLETIONS, {"prompt": "hi"}, key="wrong"), 401)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # open
    _assert_error(httpx.get(f"{server.url}/admin/kv", timeout=5), 401)


def test_request_id_is_echoed_and_never_a_key(server: Server) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "same-id"}
    a = httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers=headers, timeout=30)
    b = httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers=headers, timeout=30)
    assert a.status_code == b.status_code == 200
    assert a.headers["x-request-id"] == "same-id"
    assert a.json()["id"] != b.json()["id"]


def _wait_idle(server: Server, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        kv = kv_counters(server)
        if kv["num_free_blocks"] == kv["num_blocks"] and kv["num_running"] == 0:
            return time.monotonic() - start
        time.sleep(0.005)
    raise AssertionError(f"blocks not freed: {kv_counters(server)}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_blocks(server: Server, stream: bool) -> None:
    body = {
        "prompt": "Write a long story.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{server.url}{COMPLETIONS}", json=body, headers=headers) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{server.url}{COMPLETIONS}", json=body, headers=headers, timeout=1.5)
    busy = kv_counters(server)
    assert busy["num_running"] == 1 or busy["num_free_blocks"] == busy["num_blocks"]
    _wait_idle(server)


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text format."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    ]
    assert values, f"{name} missing"
    return sum(values)


def test_metrics_use_vllm_names_and_count_tokens(server: Server, client: openai.OpenAI) -> None:
    before = httpx.get(f"{server.url}/metrics", timeout=5)
    assert before.status_code == 200  # open without the API key
    client.completions.create(model="default", prompt="Hello there", max_tokens=5, temperature=0)
    after = httpx.get(f"{server.url}/metrics", timeout=5).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "pdserve_kv_blocks_free",
    ):
        _metric(after, name)
    for phase in ("queue", "prefill", "decode"):  # one more finished request in each
        name = f"vllm:request_{phase}_time_seconds_count"
        assert _metric(after, name) == _metric(before.text, name) + 1
    gained = _metric(after, "vllm:generation_tokens_total") - _metric(
        before.text, "vllm:generation_tokens_total"
    )
    assert gained == 5
    assert _metric(after, 'pdserve_requests_total{model_name="default",outcome="finished"}') >= 1


def test_prefix_cache_summary_names_the_blocks_a_prompt_left(server: Server) -> None:
    """What the proxy routes by: after a prompt ran, the node's summary holds its full
    blocks, hashed from token ids as the proxy hashes them, and no more."""
    from pdserve.kv_cache.prefix_summary import parse_summary, prompt_chain
    from pdserve.model.files import load_tokenizer

    tokenizer = load_tokenizer("default")
    assert tokenizer is not None
    prompt = "A prefix summary test. " * 40  # several 64-token blocks
    ids = tokenizer.encode(prompt)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/admin/prefix_cache"
    assert _post(server, COMPLETIONS, {"prompt": prompt, "max_tokens": 1}).status_code == 200
    summary = httpx.get(url, headers=headers, timeout=5).json()
    cached = parse_summary(summary)
    full_blocks = (len(ids) - 1) // cached.block_size
    assert cached.num_cached_tokens(prompt_chain(ids, cached.block_size)) == (
        full_blocks * cached.block_size
    )
    other = tokenizer.encode("Nothing like it was ever sent. " * 20)
    assert cached.num_cached_tokens(prompt_chain(other, cached.block_size)) == 0
    again = httpx.get(url, params={"since": summary["version"]}, headers=headers, timeout=5)
    assert again.json() == {"version": summary["version"], "unchanged": True}
    _assert_error(httpx.get(url, params={"since": "x"}, headers=headers, timeout=5), 400, "since")
    _assert_error(httpx.get(url, timeout=5), 401)


# -- /tokenize and /detokenize ------------------------------------------------------------


def test_tokenize_counts_what_a_completion_and_a_chat_compute(
    server: Server, client: openai.OpenAI
) -> None:
    prompt = "The capital of France is"
    tokens = _post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    done = client.completions.create(model="default", prompt=prompt, max_tokens=1)
    assert done.usage is not None and tokens["count"] == done.usage.prompt_tokens
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 2048
    back = _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": prompt}
    chat = _post(server, "/tokenize", {"messages": HELLO}).json()
    answered = client.chat.completions.create(model="default", messages=HELLO, max_tokens=1)  # type: ignore[arg-type]
    assert answered.usage is not None and chat["count"] == answered.usage.prompt_tokens
    assert chat["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": HELLO}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, None),
        ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
        (
            "/tokenize",
            {"messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages[0].tool_call_id",
        ),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenize_bodies_are_4xx(
    server: Server, path: str, body: Any, status: int, param: str | None
) -> None:
    _assert_error(_post(server, path, body), status, param)
