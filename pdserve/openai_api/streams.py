"""Streams of a completions call with several prompts, as a node and the proxy both serve
them: the prompts' chunks as they come (`interleaved`), each choice's prompt ids on its
first chunk (`with_prompt_ids`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


async def interleaved(
    sources: Sequence[AsyncIterable[T]],
) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several async iterators as they come, each with its source's index,
    until all have ended; an exception in one is raised here. Closing this (or that
    exception) stops and closes them all: a run's close aborts it, a relay's closes its
    leg."""
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterable[T]) -> None:
        try:
            async for item in source:
                await queue.put((i, item))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        running = len(sources)
        while running:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
                continue
            yield i, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for source in sources:
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()


def with_prompt_ids(chunk: dict[str, Any], ids: list[int] | None, seen: set[int]) -> None:
    """A chunk of a stream with several prompts: its prompt's ids (`return_token_ids`) go
    on each choice's first chunk, as a whole answer has them on each choice, not at the
    top where they would name one prompt."""
    for choice in chunk.get("choices") or []:
        if ids is not None and choice.get("index") not in seen:
            choice["prompt_token_ids"] = list(ids)
        seen.add(choice.get("index"))
