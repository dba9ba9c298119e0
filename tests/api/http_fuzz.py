"""Property-based checks of pdserve's HTTP surface (nodes and proxy): the Hypothesis
strategies that make requests, and the invariants every answer must keep.

Bodies are mostly well-formed, so that requests get past the first check and reach the
engine, the handoff table and the legs; any field may instead be any JSON value (NaN and
infinities included), and whole bodies may be deep nesting or bytes that are not JSON.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

from tests.api.conftest import API_KEY, Server
from tests.disagg.conftest import kv_state, wait_idle

VOCAB_SIZE = 320
"""The tiny test models' vocabulary."""
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "wizard")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
url_paths = st.text("abcdefghijklmnopqrstuvwxyz0123456789/-_.~", max_size=20).map(
    lambda p: "/" + p.lstrip("/")
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly `valid`, sometimes any JSON value."""
    return st.one_of(valid, valid, valid, json_values)


def some_of(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with any subset of these fields (each mostly valid), plus a stray one."""
    known = st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in fields.items()})
    stray = st.dictionaries(st.text(max_size=10), json_values, max_size=1)
    return st.builds(lambda a, b: {**b, **a}, known, stray)


token_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)
small_floats = st.one_of(st.sampled_from([0, 0.0, 0.5, 1.0, 2.0, -1.0]), st.floats(-3, 3))
SAMPLING = {
    "max_tokens": st.integers(-1, 12) | st.sampled_from([10**6, 2**63]),
    "temperature": small_floats | st.floats(),
    "top_p": small_floats,
    "top_k": st.integers(-2, VOCAB_SIZE + 10),
    "min_p": small_floats,
    "seed": st.integers(-(2**64), 2**64),
    "n": st.integers(0, 3),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, VOCAB_SIZE + 10), max_size=3),
    "presence_penalty": small_floats,
    "frequency_penalty": small_floats,
    "repetition_penalty": small_floats,
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(-1, 12),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "return_token_ids": st.booleans(),
    "user": st.text(max_size=8),
}
prompts = st.one_of(
    token_ids,
    st.lists(st.integers(-3, VOCAB_SIZE + 80), max_size=8),
    st.text(max_size=30),
    st.lists(st.text(max_size=10), max_size=2),
    st.lists(token_ids, max_size=2),
)


def perturbed(
    core: dict[str, st.SearchStrategy[Any]], fields: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid core, with up to three fields set or replaced (each mostly valid, sometimes
    any JSON value) and now and then a stray one: most bodies differ from a valid one in a
    field or two, so each check is reached with everything else right."""
    keys = sorted({*core, *fields})
    every = {**fields, **core}
    change = st.sampled_from(keys).flatmap(lambda k: maybe(every[k]).map(lambda v: (k, v)))
    stray = st.tuples(st.text(max_size=10), json_values)
    changes = st.lists(st.one_of(change, change, change, stray), max_size=3)
    return st.builds(
        lambda base, pairs: {**base, **dict(pairs)}, st.fixed_dictionaries(core), changes
    )


completion_bodies = perturbed(
    {"prompt": token_ids, "max_tokens": st.integers(1, 8)},
    {"prompt": prompts, "logprobs": st.integers(-1, 25), "echo": st.booleans(), **SAMPLING},
)
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    min_size=1,
    max_size=2,
)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": st.text(max_size=20) | text_parts,
        }
    ),
    min_size=1,
    max_size=3,
)
content_parts = st.lists(
    some_of(
        type=st.sampled_from(["text", "image_url", "refusal", "input_audio"]),
        text=st.text(max_size=10),
        refusal=st.text(max_size=5),
        image_url=st.fixed_dictionaries({"url": st.text(max_size=10)}),
    ),
    max_size=3,
)
messages = st.lists(
    some_of(
        role=st.sampled_from(ROLES),
        content=st.text(max_size=20) | content_parts,
        name=st.text(max_size=6),
        tool_calls=st.lists(json_values, max_size=1),
        tool_call_id=st.text(max_size=4),
    ),
    max_size=3,
)
chat_bodies = perturbed(
    {"messages": valid_messages, "max_tokens": st.integers(1, 8)},
    {
        "messages": messages,
        "max_completion_tokens": st.integers(-1, 12),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 25),
        "tools": st.lists(json_values, max_size=1),
        "tool_choice": st.sampled_from(["none", "auto", "required"]),
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object"])}
        ),
        **SAMPLING,
    },
)


items = st.lists(
    some_of(
        type=st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                              "input_image", "item_reference"]),
        role=st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
        content=st.text(max_size=10) | content_parts | json_values,
        call_id=st.text(max_size=4) | json_values,
        name=st.text(max_size=4),
        arguments=st.text(max_size=6),
        output=st.text(max_size=6) | json_values,
    ),
    max_size=3,
)  # fmt: skip
responses_bodies = perturbed(
    {"input": st.text(min_size=1, max_size=20), "max_output_tokens": st.integers(1, 8)},
    {
        "input": items | json_values,
        "instructions": st.text(max_size=8) | json_values,
        "tools": st.lists(json_values | st.fixed_dictionaries(
            {"type": st.just("function"), "name": st.text(max_size=4)}), max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | json_values,
        "text": some_of(format=json_values | some_of(type=st.sampled_from(
            ["text", "json_object", "json_schema", "x"]), schema=json_values)),
        "reasoning": some_of(effort=st.sampled_from(["none", "high"]) | json_values),
        "previous_response_id": st.text(max_size=8),
        "store": st.booleans(),
        "background": st.booleans(),
        "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4)) | json_values,
        "include": st.lists(st.text(max_size=6), max_size=2),
        "top_logprobs": st.integers(-1, 25),
        "stream": st.booleans(),
        "temperature": small_floats,
        "top_p": small_floats,
    },
)  # fmt: skip
blocks = st.lists(
    some_of(
        type=st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]),
        text=st.text(max_size=8) | json_values,
        id=st.text(max_size=4),
        name=st.text(max_size=4),
        input=json_values,
        tool_use_id=st.text(max_size=4) | json_values,
        content=st.text(max_size=6) | json_values,
    ),
    max_size=3,
)
messages_bodies = perturbed(
    {
        "model": st.just("MODEL"),
        "max_tokens": st.integers(1, 8),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                   "content": st.text(max_size=12)}), min_size=1, max_size=2),
    },
    {
        "messages": st.lists(some_of(role=st.sampled_from(["user", "assistant", "system"]),
                                     content=st.text(max_size=8) | blocks | json_values),
                             max_size=3) | json_values,
        "system": st.text(max_size=6) | blocks | json_values,
        "tools": st.lists(json_values | some_of(name=st.text(max_size=4),
                                                input_schema=json_values), max_size=2),
        "tool_choice": some_of(type=st.sampled_from(["auto", "any", "tool", "none", "x"]),
                               name=st.text(max_size=4)) | json_values,
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | json_values,
        "thinking": some_of(type=st.sampled_from(["enabled", "disabled"])) | json_values,
        "output_config": some_of(format=json_values, effort=json_values) | json_values,
        "metadata": some_of(user_id=json_values) | json_values,
        "stream": st.booleans(),
        "temperature": small_floats,
        "top_k": st.integers(-2, 50),
    },
)  # fmt: skip


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity as Python writes them


raw_bodies = st.one_of(
    st.binary(max_size=48),
    st.integers(10, 3000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    st.integers(10, 3000).map(lambda depth: b"[" * depth + b"]" * depth),
    json_values.map(encode),
    completion_bodies.map(lambda b: encode(b)[: len(encode(b)) // 2]),  # cut short
)


@dataclass
class Call:
    """One HTTP request: a method, a path, a body, headers."""

    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def headers(api_key: str) -> st.SearchStrategy[dict[str, str]]:
    """The API key, mostly; sometimes none or a wrong one; a client's X-Request-Id and an
    odd Content-Type now and then."""
    auth = st.sampled_from([f"Bearer {api_key}"] * 6 + ["", "Bearer wrong", "Basic x"])
    return st.builds(
        lambda a, rid, kind: {
            k: v
            for k, v in (("authorization", a), ("x-request-id", rid), ("content-type", kind))
            if v
        },
        auth,
        st.none() | printable.map(str.strip),  # h11 refuses a value that starts with a space
        st.sampled_from(["application/json"] * 4 + ["", "text/plain", "application/x-ndjson"]),
    )


def post_calls(
    paths: list[str], bodies: st.SearchStrategy[dict[str, Any]], api_key: str
) -> st.SearchStrategy[Call]:
    """POSTs of `bodies` (sometimes raw bytes instead) to one of `paths`."""
    body_bytes = st.one_of(bodies.map(encode), bodies.map(encode), raw_bodies)
    return st.builds(Call, st.just("POST"), st.sampled_from(paths), body_bytes, headers(api_key))


def any_route_calls(paths: list[str], api_key: str) -> st.SearchStrategy[Call]:
    """Any method on a known path or a made-up one, with a small body."""
    path = st.sampled_from(paths) | url_paths
    return st.builds(Call, st.sampled_from(METHODS), path, raw_bodies, headers(api_key))


# -- the invariants ----------------------------------------------------------------------

REQUEST_BOUND_S = 15.0
IDLE_BOUND_S = 1.0
"""Well under the prefill node's 2 s lease: what was freed, was freed by the cleanup."""
ADMIN = {"authorization": f"Bearer {API_KEY}"}
OPENAI_PATHS = ["/v1/completions", "/v1/chat/completions"]
_HTTP = httpx.Client(timeout=REQUEST_BOUND_S)


def send(url: str, call: Call) -> httpx.Response:
    """The request, its answer read to the end (a stream included)."""
    with _HTTP.stream(
        call.method, f"{url}{call.path}", content=call.body or None, headers=call.headers
    ) as response:
        response.read()
    return response


def assert_answered(response: httpx.Response, call: Call) -> None:
    """No 5xx, in the status or in a stream's error event; a 4xx in the OpenAI schema."""
    what = f"{call.method} {call.path} {call.body[:300]!r} → {response.status_code}"
    assert response.status_code < 500, f"{what}: {response.text[:500]}"
    kind = response.headers.get("content-type", "")
    if response.status_code >= 400 and call.method != "HEAD":
        error = response.json().get("error")
        assert isinstance(error, dict), what
        assert set(error) == {"message", "type", "param", "code"}, f"{what}: {error}"
    if kind.startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith('data: {"error"'):
                code = json.loads(line[len("data: ") :])["error"].get("code")
                assert not (isinstance(code, int) and code >= 500), f"{what}: {line}"


def assert_settled(*nodes: Server) -> None:
    """Healthy and holding nothing."""
    for node in nodes:
        assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200, node.url
        wait_idle(node, IDLE_BOUND_S)


@contextlib.contextmanager
def cleanup(prefill: Server) -> Iterator[None]:
    """`release_all` after the example, whether it passed or not (a failing example must not
    leave handoffs that the next one would find)."""
    try:
        yield
    finally:
        release_all(prefill)


def release_all(prefill: Server) -> None:
    """The cleanup a proxy and a decode node would do for every handoff still live: `failed`
    for a claimed one (its reader is gone), a release for the others."""
    for handoff in kv_state(prefill)["handoffs"]:
        handoff_id = handoff["handoff_id"]
        if handoff["state"] == "claimed":
            ref = {"handoff_id": handoff_id, "release_token": _TOKENS.get(handoff_id, "?")}
            _HTTP.post(f"{prefill.url}/kv/failed", json=ref, headers=ADMIN)
        _HTTP.post(
            f"{prefill.url}/v1/abort_requests", json={"request_ids": [handoff_id]}, headers=ADMIN
        )


_TOKENS: dict[str, str] = {}
"""Release tokens of the handoffs this module made (the admin view does not show them)."""


def make_handoff(prefill: Server, prompt: list[int], client_id: str = "") -> dict[str, Any]:
    """A real prefill leg: its answer's kv_transfer_params (the handoff is HELD)."""
    token = secrets.token_urlsafe(24)
    body = {
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "return_token_ids": True,
        "kv_transfer_params": {"do_remote_decode": True, "release_token": token},
    }
    headers = {**ADMIN, "x-request-id": client_id} if client_id else ADMIN
    response = _HTTP.post(f"{prefill.url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    kv: dict[str, Any] = response.json()["kv_transfer_params"]
    _TOKENS[kv["remote_request_id"]] = token
    return kv
