"""What the engine hands back to callers, one `RequestOutput` per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import RequestTimes, TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """`stop`, `length`, `abort`, or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, if any."""
    delta_text: str = ""
    """Text produced since this request's previous output (for streaming)."""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    held_block_ids: tuple[int, ...] = ()
    """When finished: blocks the KV connector kept pinned (a prefill leg's prompt KV)."""
    error: str | None = None
    """Set when the request failed inside the engine (e.g. a remote KV load, policy `fail`)."""
    times: RequestTimes | None = None
    """When finished with a token: where its time went in the engine (the last of its
    samples to finish)."""

    @property
    def aborted(self) -> bool:
        """The engine aborted it (any sample): its outputs are not a completion."""
        return any(c.finish_reason == "abort" for c in self.outputs)
