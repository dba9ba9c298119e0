"""The newer API surface through the proxy, split across a prefill and a decode node, on the
tiny chat model (random weights, a byte-level tokenizer):
- structured outputs and forced tool calls: the prefill leg carries no grammar, the decode
  node samples every token under it (its first one too), so the output fits what was asked
  only because the grammar makes it;
- evaluation completions (several prompts, echo, prompt logprobs, max_tokens 0): a
  completion scoring its prompt runs whole on the prefill node."""

from __future__ import annotations

import copy
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
def nodes(chat_model_dir: Path) -> Iterator[tuple[Server, Server, Server]]:
    """(proxy, prefill node, decode node)."""
    args = ["--model", str(chat_model_dir), "--dtype", "float32", "--api-key", API_KEY,
            "--num-kv-blocks", "256", "--max-model-len", "2048"]  # fmt: skip
    prefill, decode = start_servers([*args, "--role", "prefill"], [*args, "--role", "decode"])
    try:
        front = start_proxy([prefill.url], [decode.url])
    except BaseException:
        stop_all([prefill, decode])
        raise
    yield front, prefill, decode
    stop_all([front, prefill, decode])


@pytest.fixture(scope="module")
def proxy(nodes: tuple[Server, Server, Server]) -> Server:
    return nodes[0]


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


# -- issue 52: every field of a completion, through the proxy, as one node gives it ---------
#
# The proxy reads every leg as a stream and assembles a non-streaming client's answer from
# it, and it takes some calls down paths of their own (prompt scoring whole on a prefill
# node, several prompts routed one by one). A field that one of those paths loses shows only
# when the answer is compared with a node's field by field, on every combination: the
# hand-picked checks above never asked for prompt logprobs with `max_tokens: 0`, the one
# shape whose node stream carried no logprobs (its chunk had no new token).

NOT_COMPARED = {"id", "created", "cached_tokens"}
"""Per request (ids, clock), or per node state: the prefix cache a node holds decides
`cached_tokens`, and the proxy's count is the prefill leg's."""


def field_differences(expected: Any, got: Any, path: str = "") -> list[str]:
    """Each place where `got` lacks, adds or changes a field of `expected` (floats within
    1e-4: a prefix-cache hit may move a float32 logprob's last bits)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        keys = (set(expected) | set(got)) - NOT_COMPARED
        return [
            d
            for k in sorted(keys)
            for d in (
                [f"{path}.{k}: missing"] if k not in got
                else [f"{path}.{k}: not in the node's answer"] if k not in expected
                else field_differences(expected[k], got[k], f"{path}.{k}")
            )
        ]  # fmt: skip
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return [f"{path}: {len(got)} items, expected {len(expected)}"]
        return [d for i, (e, g) in enumerate(zip(expected, got, strict=True)) for d in
                field_differences(e, g, f"{path}[{i}]")]  # fmt: skip
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return [] if abs(expected - got) <= 1e-4 else [f"{path}: {got!r}, expected {expected!r}"]
    return [] if expected == got else [f"{path}: {got!r:.80}, expected {expected!r:.80}"]


def assemble_stream(lines: list[str]) -> dict[str, Any]:
    """A completions stream as the answer it stands for, assembled here (not by the proxy's
    code under test): texts joined, logprobs' lists concatenated, the last finish and stop
    reasons, the usage chunk's usage. `num_pieces`: the most chunks one choice came in."""
    choices: dict[int, dict[str, Any]] = {}
    answer: dict[str, Any] = {}
    pieces: dict[int, int] = {}
    for line in lines:
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[len("data: ") :])
        for key in ("object", "model"):
            answer.setdefault(key, event[key])
        if event.get("usage"):
            answer["usage"] = event["usage"]
        for piece in event["choices"]:
            choice = choices.setdefault(piece["index"], {"index": piece["index"], "text": ""})
            pieces[piece["index"]] = pieces.get(piece["index"], 0) + 1
            choice["text"] += piece["text"]
            for key in ("finish_reason", "stop_reason"):
                if piece.get(key) is not None or key not in choice:
                    choice[key] = piece.get(key)
            lp = piece.get("logprobs")
            if lp is not None:
                old = choice.get("logprobs") or {k: [] for k in lp}
                choice["logprobs"] = {k: old[k] + lp[k] for k in lp}
            else:
                choice.setdefault("logprobs", None)
    answer["num_pieces"] = max(pieces.values(), default=0)
    return {**answer, "choices": [choices[i] for i in sorted(choices)]}


def _completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer to `body` at `url`, assembled here when it streams."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:  # fmt: skip
        r.read()
        assert r.status_code == 200, r.text
        if not body.get("stream"):
            return r.json()  # type: ignore[no-any-return]
        return assemble_stream(r.text.splitlines())


SCORING_PROMPTS = ["The capital of France is", "Two plus two is"]


def _combinations() -> Iterator[dict[str, Any]]:
    for echo in (False, True):
        for logprobs in (None, 0, 2):
            for max_tokens in (0, 1, 8):
                for prompt in (SCORING_PROMPTS[0], SCORING_PROMPTS):
                    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "echo": echo}  # fmt: skip
                    yield body if logprobs is None else {**body, "logprobs": logprobs}


def test_completion_fields_through_the_proxy_equal_one_nodes(
    nodes: tuple[Server, Server, Server],
) -> None:
    """Issue 52: every combination of echo, logprobs, max_tokens in {0, 1, n} and one or
    several prompts, streamed and not, through the proxy and as a node's own stream: the
    same fields as the node's non-streaming answer (text, logprobs with their tokens, top
    logprobs and text offsets, finish and stop reasons, usage)."""
    proxy, _, node = nodes
    failures, num_pieces = [], 0
    for body in _combinations():
        expected = _completion(node.url, body)
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        for where, url, ask in (("proxy", proxy.url, body), ("proxy, streamed", proxy.url,
                                streamed), ("node, streamed", node.url, streamed)):  # fmt: skip
            got = _completion(url, ask)
            num_pieces = max(num_pieces, got.pop("num_pieces", 0))
            if differences := field_differences(expected, got):
                failures.append(f"{where} {json.dumps(body)}: {differences}")
    assert not failures, "\n".join(failures)
    # Answers that came in one chunk would not test how the chunks' fields are joined
    # (a held-back UTF-8 character merges a random model's chunks): some must come in many.
    assert num_pieces >= 4, num_pieces
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0)
    scored = client.completions.create(model=None, prompt=SCORING_PROMPTS, echo=True,  # type: ignore[arg-type]
                                       max_tokens=0, logprobs=1)  # fmt: skip
    for choice, prompt in zip(scored.choices, SCORING_PROMPTS, strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert len(choice.logprobs.token_logprobs) == len(prompt.encode())  # a byte a token


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def test_field_comparison_catches_any_one_field_dropped(
    nodes: tuple[Server, Server, Server],
) -> None:
    """The comparison above is only as good as the fields it walks: an answer missing any
    one field of a node's answer (a key deleted, or a value nulled) is reported."""
    _, _, node = nodes
    body = {"prompt": SCORING_PROMPTS, "max_tokens": 2, "temperature": 0, "echo": True,
            "logprobs": 2}  # fmt: skip
    expected = _completion(node.url, body)
    paths = [p for p in _leaves(expected) if not NOT_COMPARED & set(map(str, p))]
    assert len(paths) > 50, paths
    for path in paths:
        for keep_key in (False, True):
            dropped = copy.deepcopy(expected)
            parent = dropped
            for step in path[:-1]:
                parent = parent[step]
            if keep_key:
                parent[path[-1]] = None
            elif isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
            if expected_value_is_none := keep_key and _at(expected, path) is None:
                continue
            assert field_differences(expected, dropped), (path, keep_key, expected_value_is_none)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value
