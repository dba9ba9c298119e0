"""A completions call with several prompts (lm-eval's batches, OpenAI's legacy API): one
engine request per prompt (`ID-i`, aborted by the call's id too), run together. Prompt
`i`'s choices are numbered from `i * n`; a whole answer sums the usage and carries each
prompt's ids on its choices (`merge_answers`); a stream interleaves the prompts' chunks as
they come, then one usage chunk with the sums."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.api.live import abort_on_disconnect
from pdserve.api.pd_legs import last_output
from pdserve.errors import PdserveError
from pdserve.openai_api.caller import (
    ClientGone,
    client_request_id,
    request_span,
    unless_gone,
    wait_disconnect,
)
from pdserve.openai_api.errors import error_body, from_exception
from pdserve.openai_api.responses import ChoiceBuilder, Echo, merge_answers
from pdserve.openai_api.streams import interleaved, with_prompt_ids
from pdserve.outputs import RequestOutput

if TYPE_CHECKING:
    from pdserve.api.state import ServerState

Outputs = AsyncGenerator[RequestOutput, None]
T = TypeVar("T")


async def generate_many(
    state: ServerState,
    request: Request,
    inputs: list[dict[str, Any]],
    builder: ChoiceBuilder,
    echoes: list[Echo] | None,
    stream: bool,
) -> Response:
    caller_id = client_request_id(request.headers)
    ids = [f"{builder.request_id}-{i}" for i in range(len(inputs))]
    for sub in ids:
        state.live.add(sub, caller_id)
        state.live.add(sub, builder.request_id)
    runs = [
        state.metrics.track(
            state.client.generate(sub, builder.params, **one), request_span(request, sub)
        )
        for sub, one in zip(ids, inputs, strict=True)
    ]
    builders = [builder.for_prompt(i, echoes[i] if echoes else None) for i in range(len(ids))]

    def unregister() -> None:
        for sub in ids:
            state.live.remove(sub, caller_id)
            state.live.remove(sub, builder.request_id)

    if stream:
        watcher = asyncio.create_task(abort_on_disconnect(request, state.client, ids))

        def finish_stream() -> None:
            watcher.cancel()
            unregister()

        return StreamingResponse(
            _sse(state, builders, runs),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(finish_stream),
        )
    try:
        finals = await _all_finished(request, runs)
    except ClientGone:
        return Response(status_code=499)
    except PdserveError as e:
        state.metrics.request_failed(f"http_{e.http_status}")
        return from_exception(e)
    finally:
        unregister()
    answers = [b.full_response(final) for b, final in zip(builders, finals, strict=True)]
    return JSONResponse(merge_answers(answers, builder.params.n))


async def _all_finished(request: Request, runs: list[Outputs]) -> list[RequestOutput]:
    """Each run's finished output; closes every run (aborting what still runs) when the
    client leaves (ClientGone) or one fails (its PdserveError)."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    waits = [asyncio.ensure_future(last_output(run)) for run in runs]
    try:
        return await unless_gone(asyncio.gather(*waits), gone)
    finally:
        gone.cancel()
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        for run in runs:
            await run.aclose()


async def _sse(
    state: ServerState, builders: list[ChoiceBuilder], runs: list[Outputs]
) -> AsyncGenerator[str, None]:
    """The prompts' chunks as their outputs come, then one usage chunk (when asked) with
    the sums; an error in any ends the stream with an error event (as one prompt's does)
    and aborts the others. Closing this generator (client gone) aborts them all."""
    seen: set[int] = set()
    try:
        async with aclosing(interleaved(runs)) as outputs:  # closed with this generator
            async for i, output in outputs:
                for chunk in builders[i].stream_chunks(output):
                    ids = chunk.pop("prompt_token_ids", None) or output.prompt_token_ids
                    with_prompt_ids(chunk, ids if builders[i].return_token_ids else None, seen)
                    yield f"data: {json.dumps(chunk)}\n\n"
        usages = [u for u in (b.usage_chunk() for b in builders) if u is not None]
        if usages:  # usage chunks have no choices: merged, their usage is summed
            yield f"data: {json.dumps(merge_answers(usages, 1))}\n\n"
    except PdserveError as e:
        state.metrics.request_failed(f"http_{e.http_status}")
        yield f"data: {json.dumps(error_body(e))}\n\n"
    yield "data: [DONE]\n\n"
