"""What the engine hands back to callers, one `RequestOutput` per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestTimes:
    """Where a finished request's time went inside the engine (seconds; the node's
    `vllm:request_*_time_seconds` histograms)::

        arrival ─queued─▶ admitted ─kv_load─▶ loaded ─prefill─▶ first token ─decode─▶ end

    `kv_load_s` is 0 unless a decode node read the prompt's KV from a prefill node (its
    handshake, claim and read); `prefill_s` then covers only the first token's step."""

    queued_s: float
    kv_load_s: float
    prefill_s: float
    decode_s: float


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The `logprobs` most likely (token id, logprob) pairs at this position."""
    decoded: dict[int, str] = field(default_factory=dict)
    """Text of the chosen and top tokens, filled in by the output processor."""


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
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With `prompt_logprobs`, once the prompt is computed: an entry per prompt token (None
    for the first, which nothing predicts)."""
    times: RequestTimes | None = None
    """When finished with a token: where its time went in the engine (the last of its
    samples to finish)."""

    @property
    def aborted(self) -> bool:
        """The engine aborted it (any sample): its outputs are not a completion."""
        return any(c.finish_reason == "abort" for c in self.outputs)


@dataclass(frozen=True)
class ComputeInfo:
    """What the model computes with, and why: reported by /v1/models and /admin/kv."""

    dtype: str
    dtype_reason: str
    device: str
    ops: str
    """The backend that runs the hot operations, with its CPU level (`cpu-kernels (avx2)`)."""
    cpu_level: str | None
    """The CPU level in use and where it came from; None on a GPU."""
    quantization: str = "none"
    """How the weights are kept, and their bytes in memory (loader.plan_quantization)."""
    kv_cache_dtype: str = "bfloat16"
    """The KV cache's format (kv_format.py)."""
