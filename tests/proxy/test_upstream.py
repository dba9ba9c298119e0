"""The proxy's hand-written HTTP/1.1 client (`pdserve/proxy/upstream.py`) against a raw TCP
node on loopback that answers with bytes the test writes: well-formed, chunked, malformed
and truncated answers, dead and stale connections, and the outstanding count of
`Backend.post_json` (no pdserve processes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.proxy.pool import Backend
from pdserve.proxy.upstream import (
    Node,
    Unreachable,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from tests.api.conftest import free_port

BODY = b'{"ok": true}'
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n" + BODY
TIMEOUT_S = 2.0


@dataclass
class RawNode:
    """Answers the n-th request on any connection with `replies[n]` (the last one again
    once they run out), then closes the connection if `close_after` says so."""

    replies: list[bytes]
    close_after: bool = False
    silent: bool = False
    """Read requests but never answer."""
    url: str = ""
    num_connections: int = 0
    requests: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while request := await _read_request(reader):
                self.requests.append(request)
                if self.silent:
                    await asyncio.sleep(3600)
                index = min(len(self.requests), len(self.replies)) - 1
                writer.write(self.replies[index])
                await writer.drain()
                if self.close_after:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")  # IncompleteReadError once the client left
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


@asynccontextmanager
async def raw_node(*replies: bytes, **options: bool) -> AsyncIterator[RawNode]:
    node = RawNode(list(replies), **options)
    server = await asyncio.start_server(node.handle, "127.0.0.1", 0)
    node.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield node
    finally:
        server.close()


async def post(node: Node, timeout_s: float = TIMEOUT_S) -> UpstreamResponse:
    return await node.post_json("/v1/completions", b"{}", {"x-request-id": "r1"}, timeout_s)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def chunked(*chunks: bytes, trailer: bytes = b"") -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    return head + b"\r\n" + body + b"0\r\n" + trailer + b"\r\n"


# -- well-formed answers -----------------------------------------------------------------


def test_a_content_length_body_is_read_and_its_connection_reused() -> None:
    async def main() -> None:
        async with raw_node(OK, OK) as raw:
            node = Node(raw.url)
            for _ in range(2):
                response = await post(node)
                assert (response.status, await response.read()) == (200, BODY)
                assert response.headers[b"content-type"] == b"application/json"
                response.close()
            assert raw.num_connections == 1
            assert raw.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"\r\nx-request-id: r1\r\n" in raw.requests[0]
            assert raw.requests[0].endswith(b"\r\n\r\n{}")
            node.close()

    run(main())


def test_a_chunked_stream_is_split_into_lines_whatever_the_chunk_boundaries() -> None:
    stream = chunked(b'data: {"a"', b": 1}\r\n\r\ndata: [DO", b"NE]\r\n\r\n", trailer=b"x-t: 1\r\n")

    async def main() -> None:
        async with raw_node(stream, OK) as raw:
            node = Node(raw.url)
            response = await post(node)
            lines = [line async for line in response.iter_lines()]
            assert lines == [b'data: {"a": 1}', b"", b"data: [DONE]", b""]
            response.close()
            again = await post(node)  # the trailer was consumed: the connection is clean
            assert await again.read() == BODY
            assert raw.num_connections == 1
            node.close()

    run(main())


def test_a_node_that_says_connection_close_gets_a_fresh_connection_next_time() -> None:
    closing = OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)

    async def main() -> None:
        async with raw_node(closing, close_after=True) as raw:
            node = Node(raw.url)
            for _ in range(2):
                response = await post(node)
                assert await response.read() == BODY
                response.close()
            assert raw.num_connections == 2

    run(main())


def test_a_stale_keep_alive_connection_is_retried_once_on_a_fresh_one() -> None:
    async def main() -> None:
        async with raw_node(OK, close_after=True) as raw:  # closes after every answer
            node = Node(raw.url)
            first = await post(node)
            assert await first.read() == BODY  # back in the idle list, closed by the node
            await asyncio.sleep(0.05)
            second = await post(node)
            assert (second.status, await second.read()) == (200, BODY)
            assert raw.num_connections == 2

    run(main())


# -- malformed and truncated answers -------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 abc OK\r\n\r\n",  # status is not a number
        b"hello\r\n\r\n",  # no status at all
    ],
)
def test_a_malformed_status_line_is_an_upstream_error(answer: bytes) -> None:
    async def main() -> None:
        async with raw_node(answer) as raw:
            with pytest.raises(UpstreamError, match="bad answer") as caught:
                await post(Node(raw.url))
            assert not isinstance(caught.value, Unreachable)  # it reached the node

    run(main())


@pytest.mark.parametrize(
    ("answer", "cut"),
    [
        (OK[:-4], True),  # a content-length body cut short
        (chunked(b"data: x\n")[:-12], True),  # a chunked body cut inside a chunk
        (chunked(b"data: x\n").replace(b"8;ext=1", b"zz"), False),  # chunk size not hex
        (b"HTTP/1.1 200 OK\r\ncontent-length: twelve\r\n\r\n" + BODY, False),
    ],
)
def test_a_truncated_or_malformed_body_is_an_upstream_error_and_drops_the_connection(
    answer: bytes, cut: bool
) -> None:
    async def main() -> None:
        async with raw_node(answer, OK, close_after=cut) as raw:
            node = Node(raw.url)
            response = await post(node)
            assert response.status == 200
            with pytest.raises(UpstreamError, match="broken answer"):
                await response.read()
            response.close()
            again = await post(node)  # never on the broken connection
            assert await again.read() == BODY
            assert raw.num_connections == 2

    run(main())


def test_a_node_that_closes_a_fresh_connection_without_answering() -> None:
    async def main() -> None:
        async with raw_node(b"", close_after=True) as raw:
            with pytest.raises(UpstreamError, match="without answering"):
                await post(Node(raw.url))

    run(main())


def test_a_silent_node_times_out_and_an_absent_one_is_unreachable() -> None:
    async def main() -> None:
        async with raw_node(OK, silent=True) as raw:
            with pytest.raises(UpstreamTimeout):
                await post(Node(raw.url), timeout_s=0.2)
        with pytest.raises(Unreachable):
            await post(Node(f"http://127.0.0.1:{free_port()}"))

    run(main())


def test_a_node_url_must_be_http_or_https_host_port() -> None:
    with pytest.raises(ValueError, match=r"http\(s\)://host:port"):
        Node("ftp://example.org")
    with pytest.raises(ValueError, match="host:port"):
        Node("http://")
    assert (Node("https://example.org").host, Node("https://example.org").port) == (
        "example.org", 443
    )  # fmt: skip


# -- the outstanding count -----------------------------------------------------------------


def test_a_backend_counts_a_leg_from_its_post_until_its_response_is_closed() -> None:
    async def main() -> None:
        async with raw_node(OK) as raw:
            backend = Backend(raw.url, "decode")
            response = await backend.post_json("/v1/completions", b"{}", {}, TIMEOUT_S)
            assert backend.num_outstanding == 1
            assert await response.read() == BODY
            assert backend.num_outstanding == 1  # read, not yet closed
            response.close()
            response.close()  # idempotent: counted down once
            assert backend.num_outstanding == 0
        gone = Backend(f"http://127.0.0.1:{free_port()}", "decode")
        with pytest.raises(Unreachable):
            await gone.post_json("/v1/completions", b"{}", {}, TIMEOUT_S)
        assert gone.num_outstanding == 0

    run(main())


def test_a_cancelled_post_is_not_left_outstanding() -> None:
    async def main() -> None:
        async with raw_node(OK, silent=True) as raw:
            backend = Backend(raw.url, "prefill")
            task = asyncio.ensure_future(backend.post_json("/v1/completions", b"{}", {}, TIMEOUT_S))
            while not raw.requests:
                await asyncio.sleep(0.01)
            assert backend.num_outstanding == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert backend.num_outstanding == 0

    run(main())
