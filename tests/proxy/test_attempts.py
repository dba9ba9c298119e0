"""Issue 56: every way a leg can end on a node, driven through the proxy's leg code
(`proxy/legs.py`) with nodes that end it so, and for each its three consequences checked:
the request's outcome metric, the release of the attempt's handoff, and what the node's
health learned. The expectations are the design's (docs/proxy.md, DESIGN §3), written out
here, not read from `attempts.CONSEQUENCES`: a change to the table that changes behaviour
fails here.

A fast unit test of one layer: the nodes are fakes (`post_json` answers as told), the rest
is the proxy's own state and leg code; the release is recorded instead of sent.
"""

from __future__ import annotations

import ast
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pdserve.config import ProxyConfig, RoutingPolicy
from pdserve.openai_api.caller import ClientGone
from pdserve.proxy import legs, request
from pdserve.proxy.client import Stage
from pdserve.proxy.state import ProxyState
from pdserve.proxy.upstream import Unreachable, UpstreamTimeout
from pdserve.tracing import NULL_SPAN

T = TypeVar("T")
PREFILL = ("http://p1", "http://p2")
DECODE = ("http://d1", "http://d2")
KV = {"do_remote_prefill": True, "remote_request_id": "h-1", "release_token": "t" * 32}


class FakeResponse:
    def __init__(self, status: int, lines: list[bytes] | None = None, body: bytes = b"") -> None:
        self.status, self._lines, self._body = status, lines or [], body
        self.headers = {b"content-type": b"text/event-stream" if lines else b"application/json"}
        self.node_url = "fake"

    async def read(self) -> bytes:
        return self._body

    async def iter_lines(self) -> AsyncIterator[bytes]:
        for line in self._lines:
            if line == b"BREAK":
                raise UpstreamTimeout("silent past the decode timeout")
            yield line

    def close(self) -> None:
        pass


def _sse(*events: dict[str, Any]) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() for e in events] + [b"data: [DONE]"]


GOOD = _sse({"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
ANSWERS: dict[str, Any] = {
    "ok": lambda: FakeResponse(200, body=json.dumps({"kv_transfer_params": KV}).encode()),
    "ok-stream": lambda: FakeResponse(200, GOOD),
    "refused": lambda: FakeResponse(400, body=b'{"error": {"message": "bad"}}'),
    "failed": lambda: FakeResponse(503, body=b'{"error": {"message": "busy"}}'),
    "broken": UpstreamTimeout("no answer within the timeout"),
    "unreachable": Unreachable("connection refused"),
    "gone": ClientGone(),
    "event-error": lambda: FakeResponse(200, _sse({"error": {"message": "drained", "code": 503}})),
    "mid-stream-break": lambda: FakeResponse(200, [*GOOD[:1], b"BREAK"]),
}


class FakeClient:
    request_id = "req-1"
    span = NULL_SPAN
    stage = Stage.PREFILL
    gone = False

    def __init__(self, gone_on: set[str]) -> None:
        self.gone_on = gone_on
        self.request = self

    async def is_disconnected(self) -> bool:
        return False

    async def unless_gone(self, work: Awaitable[T]) -> T:
        return await work


class Nodes:
    """The fake nodes' answers by URL, and what the proxy did to them."""

    def __init__(self, state: ProxyState, answers: dict[str, list[str]]) -> None:
        self.health: list[tuple[str, str, bool]] = []
        self.releases: list[tuple[str, str, str | None]] = []
        for pool in (state.prefill, state.decode):
            for backend in pool.backends:
                queue = list(answers.get(backend.url, ["unreachable"]))
                backend.post_json = self._post(queue)  # type: ignore[method-assign]
                backend.record_leg = lambda ok, u=backend.url: self.health.append((u, "leg", ok))  # type: ignore[method-assign]
                backend.record = lambda ok, u=backend.url: self.health.append((u, "check", ok))  # type: ignore[method-assign]

    @staticmethod
    def _post(queue: list[str]) -> Any:
        async def post(*args: Any, **kwargs: Any) -> FakeResponse:
            answer = ANSWERS[queue.pop(0)]
            if isinstance(answer, BaseException):
                raise answer
            return answer()  # type: ignore[no-any-return]

        return post


def _run(answers: dict[str, list[str]], stream: bool = False) -> tuple[Any, Nodes, ProxyState]:
    """One P/D request through the leg code against nodes that answer as told: (the
    response or the exception it raised, the nodes' record, the proxy's state)."""
    # Least loaded, every node idle: the first in its list, then the next one.
    policy = RoutingPolicy.LEAST_LOADED
    state = ProxyState(ProxyConfig(prefill_urls=PREFILL, decode_urls=DECODE, model=None,
                                   prefill_routing=policy, decode_routing=policy))  # fmt: skip
    nodes = Nodes(state, answers)

    async def recorded_release(state: Any, backend: Any, request_id: str, token: Any) -> None:
        nodes.releases.append((backend.url, request_id, token))

    async def go() -> Any:
        original, request.release = request.release, recorded_release
        try:
            client = FakeClient(set())
            body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
            req = request.ProxyRequest(state, client, "/v1/completions", body, None)  # type: ignore[arg-type]
            try:
                response: Any = await legs._both_legs(req)
                if stream:  # drain the relayed stream: its end is settled there
                    async for _ in response.body_iterator:
                        pass
            except ClientGone as e:
                response = e
            await asyncio.gather(*state.background)  # the releases sent in the background
            return response
        finally:
            request.release = original

    return asyncio.run(go()), nodes, state


def _outcomes(state: ProxyState) -> dict[str, float]:
    counter = state.metrics.requests
    return {s.labels["outcome"]: s.value for m in counter.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}  # fmt: skip


CASES = [
    # prefill answers, decode answers, stream, expected: outcome, releases, health records
    pytest.param({"http://p1": ["ok"], "http://d1": ["ok-stream"]}, False, "ok", [],
                 [("http://p1", "leg", True), ("http://d1", "leg", True)], id="ok"),
    pytest.param({"http://p1": ["refused"]}, False, "upstream_error", [],
                 [("http://p1", "leg", True)], id="prefill-refused: no retry"),
    pytest.param({"http://p1": ["failed"], "http://p2": ["ok"], "http://d1": ["ok-stream"]},
                 False, "ok", [], [("http://p1", "leg", False), ("http://p2", "leg", True),
                                   ("http://d1", "leg", True)], id="prefill-failed: retried"),
    pytest.param({"http://p1": ["broken"], "http://p2": ["ok"], "http://d1": ["ok-stream"]},
                 False, "ok", [("http://p1", "req-1", "token")],
                 [("http://p1", "leg", False), ("http://p2", "leg", True),
                  ("http://d1", "leg", True)], id="prefill-broken: released by token, retried"),
    pytest.param({"http://p1": ["unreachable"], "http://p2": ["unreachable"]}, False,
                 "upstream_error", [], [("http://p1", "leg", False), ("http://p1", "check", False),
                                        ("http://p2", "leg", False), ("http://p2", "check", False)],
                 id="prefill-unreachable everywhere"),
    pytest.param({"http://p1": ["gone"]}, False, None, [("http://p1", "req-1", "token")], [],
                 id="prefill-client-gone: released by token"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["refused"]}, False, "upstream_error",
                 [("http://p1", "h-1", KV["release_token"])],
                 [("http://p1", "leg", True), ("http://d1", "leg", True)], id="decode-refused"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["failed"]}, False, "upstream_error",
                 [("http://p1", "h-1", KV["release_token"])],
                 [("http://p1", "leg", True), ("http://d1", "leg", False)], id="decode-failed"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["broken"]}, False, "upstream_error",
                 [("http://p1", "h-1", KV["release_token"])],
                 [("http://p1", "leg", True), ("http://d1", "leg", False)], id="decode-broken"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["unreachable"], "http://d2": ["ok-stream"]},
                 False, "ok", [], [("http://p1", "leg", True), ("http://d1", "leg", False),
                                   ("http://d1", "check", False), ("http://d2", "leg", True)],
                 id="decode-unreachable: the handoff kept for another"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["unreachable"],
                  "http://d2": ["unreachable"]}, False, "upstream_error",
                 [("http://p1", "h-1", KV["release_token"])],
                 [("http://p1", "leg", True), ("http://d1", "leg", False),
                  ("http://d1", "check", False), ("http://d2", "leg", False),
                  ("http://d2", "check", False)], id="decode-unreachable everywhere: released"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["gone"]}, False, None,
                 [("http://p1", "h-1", KV["release_token"])], [("http://p1", "leg", True)],
                 id="decode-client-gone: released"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["event-error"]}, False, "upstream_error", [],
                 [("http://p1", "leg", True), ("http://d1", "leg", True)],
                 id="answer-error-event"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["mid-stream-break"]}, False,
                 "upstream_error", [("http://p1", "h-1", KV["release_token"])],
                 [("http://p1", "leg", True), ("http://d1", "leg", True),
                  ("http://d1", "leg", False)], id="answer-broken: released"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["mid-stream-break"]}, True,
                 "upstream_error", [("http://p1", "h-1", KV["release_token"])],
                 [("http://p1", "leg", True), ("http://d1", "leg", True),
                  ("http://d1", "leg", False)], id="answer-broken, streamed: released"),
    pytest.param({"http://p1": ["ok"], "http://d1": ["ok-stream"]}, True, "ok", [],
                 [("http://p1", "leg", True), ("http://d1", "leg", True)], id="ok, streamed"),
]  # fmt: skip


@pytest.mark.parametrize(("answers", "stream", "outcome", "releases", "health"), CASES)
def test_each_end_has_its_metric_release_and_health_record(
    answers: dict[str, list[str]],
    stream: bool,
    outcome: str | None,
    releases: list[tuple[str, str, str]],
    health: list[tuple[str, str, bool]],
) -> None:
    result, nodes, state = _run(answers, stream)
    if outcome is None:
        assert isinstance(result, ClientGone)  # serve_request counts it and the departure
        assert _outcomes(state) == {}
    else:
        assert _outcomes(state) == {outcome: 1.0}, result
    expected = [(url, rid, None if token == "token" else token) for url, rid, token in releases]
    assert [(u, r, None if r == "req-1" else t) for u, r, t in nodes.releases] == expected
    assert all(t for u, r, t in nodes.releases)  # by a token: the attempt's, or the handoff's
    assert nodes.health == health


def test_the_legs_code_has_no_function_over_40_lines() -> None:
    root = Path(__file__).resolve().parents[2] / "pdserve" / "proxy"
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in (root / "legs.py", root / "answers.py", root / "attempts.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 40
    ]
    assert not long, long
