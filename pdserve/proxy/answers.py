"""What the client gets back from the decode leg: its stream relayed (usage merged with the
prefill leg's), or one answer assembled from it; and upstream errors in the OpenAI schema."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from pdserve.openai_api.errors import error_response
from pdserve.proxy.assembler import StreamAssembler
from pdserve.proxy.attempts import End, request_outcome
from pdserve.proxy.client import Client, Stage
from pdserve.proxy.pool import Backend
from pdserve.proxy.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from pdserve.tracing import Span

if TYPE_CHECKING:
    from pdserve.proxy.state import ProxyState


async def read_answer(response: UpstreamResponse) -> dict[str, Any] | StreamAssembler:
    """The answer from an SSE body (the assembler itself if an error event ended it), or
    from one JSON body (a node that does not stream); UpstreamError if neither parses."""
    if not streamed(response):
        return json_object(await response.read(), response)
    assembler = StreamAssembler()
    async for line in response.iter_lines():  # to the end: the connection is then reused
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            assembler.add(json_object(line[len(b"data: ") :], response))
    return assembler if assembler.error is not None else assembler.answer()


def streamed(response: UpstreamResponse) -> bool:
    return response.headers.get(b"content-type", b"").startswith(b"text/event-stream")


def json_object(content: bytes, response: UpstreamResponse) -> dict[str, Any]:
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UpstreamError(f"{response.node_url} answered with bad JSON: {e}") from e
    if not isinstance(data, dict):
        raise UpstreamError(f"{response.node_url} answered with JSON that is not an object")
    return data


def stream_error(error: dict[str, Any]) -> Response:
    """An error event, as the error answer a non-streaming leg would have been."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return JSONResponse({"error": error}, status_code=status)


async def relay_stream(
    state: ProxyState,
    client: Client,
    response: UpstreamResponse,
    prefill_usage: dict[str, Any],
    started: float,
    span: Span,
    settle: Callable[[End], None],
) -> AsyncIterator[bytes]:
    """The decode node's SSE lines, usage chunks rewritten. Closing this generator (the
    client left) closes the decode leg's connection, which aborts it on the node. A stream
    the node ended with an error event (aborted mid-stream: drain timeout, operator) is
    relayed as it came. The stream's end is settled (`settle`: `attempts.CONSEQUENCES`) and
    counted as the request's outcome; ends the leg's `span` and the request's."""
    end = End.CLIENT_GONE
    failed = False
    try:
        async for line in response.iter_lines():
            if line.startswith(b"data: {") and b'"usage"' in line:
                line = _with_merged_usage(line, prefill_usage)
            failed = failed or line.startswith(b'data: {"error"')
            yield line + b"\n"
        end = End.FAILED if failed else End.OK
    except UpstreamError as e:  # the node died mid-stream: end the stream with an error
        end = End.BROKEN
        error = {"message": f"decode node {response.node_url}: {e}", "type": "upstream_error",
                 "param": None, "code": 502}  # fmt: skip
        yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
    finally:
        response.close()
        state.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - started)
        settle(end)  # no await here: anyio cancels each one once the client has left
        state.metrics.requests.labels(request_outcome(end)).inc()
        if end is End.CLIENT_GONE:
            state.record_departure(client.request_id, Stage.STREAMING)
        span.set("pdserve.outcome", request_outcome(end))
        span.end()
        client.span.end()


def _with_merged_usage(line: bytes, prefill_usage: dict[str, Any]) -> bytes:
    try:
        chunk = json.loads(line[len(b"data: ") :])
    except json.JSONDecodeError:
        return line
    if not isinstance(chunk, dict) or not isinstance(chunk.get("usage"), dict):
        return line
    chunk["usage"] = merge_usage(prefill_usage, chunk["usage"])
    return b"data: " + json.dumps(chunk).encode()


def merge_usage(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """Prompt and cached tokens from the prefill leg (which computed the prompt), completion
    tokens from the decode leg."""
    prompt = int(prefill.get("prompt_tokens", decode.get("prompt_tokens", 0)))
    completion = int(decode.get("completion_tokens", 0))
    usage = {
        **decode,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = prefill.get("prompt_tokens_details")
    if isinstance(details, dict):
        usage["prompt_tokens_details"] = details
    return usage


def forward_error(status: int, content: bytes) -> Response:
    """An upstream error, as the same status in the OpenAI schema."""
    try:
        data = json.loads(content)
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return JSONResponse(data, status_code=status)
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    text = content[:200].decode("utf-8", "replace") or f"HTTP {status}"
    return error_response(status, f"upstream node: {text}", "upstream_error")


def upstream_failure(backend: Backend, e: UpstreamError) -> Response:
    status = 504 if isinstance(e, UpstreamTimeout) else 502
    return error_response(status, f"{backend.role} node {backend.url}: {e}", "upstream_error")
