"""A lean HTTP/1.1 client for the proxy's legs: keep-alive connections per node, JSON
bodies out, `Content-Length` or chunked bodies in, SSE lines streamed.

Why not httpx: its async client's pool scans and locks cost far more CPU per request than
a bare asyncio connection's round trip (docs/benchmarks.md, "Proxy overhead"), and the
proxy makes two upstream requests per client request, so this is its hot path.

Life of a connection: opened on demand (a failure to connect is `Unreachable`: the
request never reached the node, so it may go elsewhere) → one request at a time → back to
the node's idle list when its response was read to the end, else closed. A reused
connection that the node had already closed (EOF before any byte of the answer) is
retried once on a fresh one: the node never saw that request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
MAX_IDLE_PER_NODE = 512
MAX_HEADER_LINES = 100


class UpstreamError(Exception):
    """The node could not be talked to, or broke the protocol mid-answer."""


class Unreachable(UpstreamError):
    """No connection could be made: the request never reached the node."""


class UpstreamTimeout(UpstreamError):
    pass


async def _within(timeout_s: float | None, work: Awaitable[T]) -> T:
    if timeout_s is None:
        return await work
    try:
        return await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError as e:
        raise UpstreamTimeout(f"no answer within {timeout_s} s") from e


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    def __init__(
        self,
        node: Node,
        conn: _Connection,
        status: int,
        headers: dict[bytes, bytes],
        timeout_s: float | None,
    ) -> None:
        self.status = status
        self.headers = headers
        self._node, self._conn, self._timeout_s = node, conn, timeout_s
        self._done = False
        self._on_close: Callable[[], None] | None = None

    @property
    def node_url(self) -> str:
        return self._node.url

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        parts = [chunk async for chunk in self._chunks()]
        return b"".join(parts)

    async def iter_lines(self) -> AsyncIterator[bytes]:
        """The body line by line (without line ends), as it arrives."""
        pending = b""
        async for chunk in self._chunks():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if pending:
            yield pending

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, at the first `close()`."""
        self._on_close = callback

    def close(self) -> None:
        """Drop the connection unless the body was read to the end (then it is reused).
        Idempotent."""
        if not self._done:
            self._conn.close()
            self._done = True
        callback, self._on_close = self._on_close, None
        if callback is not None:
            callback()

    async def _readline(self) -> bytes:
        return await _within(self._timeout_s, self._conn.reader.readline())

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        try:
            if self.headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                while size := int((await self._readline()).split(b";")[0], 16):
                    chunk = await _within(self._timeout_s, reader.readexactly(size + 2))
                    yield chunk[:-2]  # without the CRLF that ends each chunk
                while (await self._readline()) not in (b"\r\n", b""):
                    pass  # trailers
            else:
                length = int(self.headers.get(b"content-length", b"0"))
                if length:
                    yield await _within(self._timeout_s, reader.readexactly(length))
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            self.close()
            raise UpstreamError(f"broken answer from {self._node.url}: {type(e).__name__}") from e
        except BaseException:
            self.close()
            raise
        self._done = True
        self._node.give_back(self._conn, self.headers)


class Node:
    """Keep-alive connections to one node (`http://host:port` or `https://host:port`; an
    https node's certificate is verified with `ssl_context`, default: the system's CAs)."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"node URL must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if https else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if https else None
        self._idle: list[_Connection] = []
        self._host_header = f"{self.host}:{self.port}".encode()

    async def post_json(
        self, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None
    ) -> UpstreamResponse:
        """POST a JSON body; returns once the status line and headers have arrived."""
        head = [
            b"POST ",
            path.encode(),
            b" HTTP/1.1\r\nhost: ",
            self._host_header,
            b"\r\ncontent-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for name, value in headers.items():
            head += [name.encode(), b": ", value.encode(), b"\r\n"]
        request = b"".join([*head, b"\r\n", body])
        while self._idle:  # a reused connection may have been closed by the node meanwhile
            conn = self._idle.pop()
            try:
                return await self._exchange(conn, request, timeout_s)
            except _StaleConnection:
                continue
        try:
            reader, writer = await _within(
                timeout_s, asyncio.open_connection(self.host, self.port, ssl=self._ssl)
            )
        except (OSError, UpstreamTimeout) as e:  # ssl.SSLError (a bad certificate) too
            raise Unreachable(f"cannot connect to {self.url}: {e}") from e
        try:
            return await self._exchange(_Connection(reader, writer), request, timeout_s)
        except _StaleConnection as e:
            raise UpstreamError(f"{self.url} closed the connection without answering") from e

    async def _exchange(
        self, conn: _Connection, request: bytes, timeout_s: float | None
    ) -> UpstreamResponse:
        try:
            conn.writer.write(request)
            status_line = await _within(timeout_s, conn.reader.readline())
            if not status_line:
                conn.close()
                raise _StaleConnection
            status = int(status_line.split(b" ", 2)[1])
            headers: dict[bytes, bytes] = {}
            for _ in range(MAX_HEADER_LINES):
                line = await _within(timeout_s, conn.reader.readline())
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        except (ConnectionResetError, BrokenPipeError) as e:
            conn.close()
            raise _StaleConnection from e
        except (OSError, ValueError, IndexError) as e:
            conn.close()
            raise UpstreamError(f"bad answer from {self.url}: {type(e).__name__}") from e
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, conn, status, headers, timeout_s)

    def give_back(self, conn: _Connection, headers: dict[bytes, bytes]) -> None:
        closing = headers.get(b"connection", b"").lower() == b"close"
        if closing or len(self._idle) >= MAX_IDLE_PER_NODE:
            conn.close()
        else:
            self._idle.append(conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class _StaleConnection(Exception):
    pass
