"""A completions call with several prompts through the proxy: each prompt routed as a call
of its own (its legs, its retries, its releases), all at once, and the answers merged as a
node merges them (`api.responses.merge_answers`: prompt `i`'s choices numbered from
`i * n`, the usage summed). A stream interleaves the prompts' chunks, renumbered, then one
usage chunk with the sums and one `[DONE]`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.openai_api.errors import error_response
from pdserve.openai_api.protocol import MAX_PROMPTS
from pdserve.openai_api.responses import merge_answers
from pdserve.openai_api.streams import interleaved, with_prompt_ids
from pdserve.proxy.client import Client

if TYPE_CHECKING:
    from pdserve.proxy.state import ProxyState

Route = Callable[["ProxyState", Client, str, dict[str, Any]], Awaitable[Response]]


def several_prompts(body: dict[str, Any]) -> list[Any] | None:
    """A completions call's prompts when it has more than one (strings or token lists)."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[0], (str, list)):
        return raw
    return None


async def route_each(
    state: ProxyState,
    client: Client,
    path: str,
    body: dict[str, Any],
    prompts: list[Any],
    route: Route,
) -> Response:
    """Each prompt through `route` at once; the merged answer or stream, or the first
    error (the other prompts' streams closed: their legs end and release)."""
    if len(prompts) > MAX_PROMPTS:
        why = f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}"
        return error_response(400, why, "invalid_request_error", param="prompt")
    done = await asyncio.gather(
        *(route(state, client, path, {**body, "prompt": p}) for p in prompts),
        return_exceptions=True,
    )
    answers = [a for a in done if isinstance(a, Response)]
    failed: BaseException | Response | None = next(
        (a for a in done if isinstance(a, BaseException)), None
    ) or next((a for a in answers if a.status_code != 200), None)
    n = body.get("n") or 1
    streams = [a for a in answers if isinstance(a, StreamingResponse)]
    if failed is not None:
        for stream in streams:
            await _close(stream)
        if isinstance(failed, BaseException):
            raise failed  # the client left: each route let go of what it held
        return failed
    if streams:
        return StreamingResponse(
            _merged(streams, n), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )  # fmt: skip
    return JSONResponse(merge_answers([json.loads(bytes(a.body)) for a in answers], n))


async def _merged(streams: list[StreamingResponse], n: int) -> AsyncIterator[bytes]:
    """The prompts' SSE events as they come, choices renumbered; their usage chunks held
    back and sent summed, then one `[DONE]`. Closing it closes every prompt's stream."""
    usages: list[dict[str, Any]] = []
    prompt_ids: dict[int, list[int]] = {}
    seen: set[int] = set()
    async with aclosing(interleaved([s.body_iterator for s in streams])) as pieces:
        async for i, piece in pieces:
            data = piece if isinstance(piece, bytes) else str(piece).encode()
            for line in data.splitlines():
                if not line.startswith(b"data: {"):
                    continue  # blank separators and each prompt's [DONE]: ours come below
                event = json.loads(line[len(b"data: ") :])
                if isinstance(event.get("usage"), dict) and not event.get("choices"):
                    usages.append(event)
                    continue
                for choice in event.get("choices") or []:
                    choice["index"] = i * n + int(choice.get("index", 0))
                if "prompt_token_ids" in event:
                    prompt_ids[i] = event.pop("prompt_token_ids")
                with_prompt_ids(event, prompt_ids.get(i), seen)
                yield b"data: " + json.dumps(event).encode() + b"\n\n"
    if usages:  # usage chunks have no choices: merged, their usage is summed
        yield b"data: " + json.dumps(merge_answers(usages, n)).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _close(stream: StreamingResponse) -> None:
    close = getattr(stream.body_iterator, "aclose", None)
    if close is not None:
        await close()
