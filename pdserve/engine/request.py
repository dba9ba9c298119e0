"""A request inside the engine, and its states.

    WAITING ──scheduled──▶ RUNNING ──stop / length──▶ FINISHED_STOPPED | FINISHED_LENGTH
       │  ▲                   ▲  │
       │  └── PREEMPTED ◀─────┼──┘  (blocks ran out: freed, recomputed later from its tokens)
       │                      │
       └─▶ WAITING_FOR_REMOTE_KV   (blocks allocated; the KV connector fills them from a
                 │                  remote node; RUNNING when the load ends)
                 └── load failed, policy `fail` ──▶ FINISHED_ERROR

    any non-finished state ──abort──▶ FINISHED_ABORTED

`token_ids` is prompt + output so far; `num_computed_tokens` of them have their KV in the
cache. The next step feeds `token_ids[num_computed_tokens:]` (or a chunk of it).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from pdserve.engine.kv_types import KVTransferSpec, RemoteToken
from pdserve.outputs import RequestTimes, TokenLogprob
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        kv_transfer: KVTransferSpec | None = None,
    ) -> None:
        self.request_id = request_id
        self.kv_transfer = kv_transfer
        """What the KV connector should do with this request's KV (`pdserve.disagg.params`:
        hold it for a remote decode, or load it from a remote prefill). Opaque to the
        scheduler."""
        self.held_block_ids: tuple[int, ...] = ()
        """Blocks the connector kept pinned when the request finished."""
        self.error: str | None = None
        """Why the request ended in FINISHED_ERROR."""
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.eos_token_ids = eos_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at first scheduling."""
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        """With `params.prompt_logprobs`: one entry per prompt token, None for the first
        (nothing precedes it) and for those not computed yet; set by position, so a
        preempted request's recompute writes the same entries again."""
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.admitted_time: float | None = None
        """First left the waiting queue (blocks allocated); preemption does not reset it."""
        self.loaded_time: float | None = None
        """Its remote KV load ended."""
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            import torch  # here: the API process makes no Request and never imports torch

            self.generator = torch.Generator().manual_seed(params.seed)
        self.grammar: Any = None
        """The llguidance matcher of a request with `params.grammar`, once built; the
        sampler masks with it and the scheduler advances it with each token."""
        self.grammar_pending: Future[Any] | None = None
        """Its matcher being built (`structured.Grammars`); not scheduled until it is."""
        self.num_remote_draws = 0
        """Draws another node made from this request's seed (its first token), which the
        sampler skips on `generator` before its own draw, so the draws that follow are the
        ones a single node would make."""

    def accept_remote_token(self, token: RemoteToken) -> None:
        """The node the prompt's KV came from sampled this request's next token (the
        scheduler appends it): keep its logprob entry and account for its draw."""
        if self.params.logprobs is not None and token.logprob is not None:
            self.logprobs.append(token.logprob)
        if not self.params.greedy:
            self.num_remote_draws += 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def times(self) -> RequestTimes | None:
        """The phases of a request that produced a token and ended (an abort truncates
        `decode_s`); None otherwise."""
        admitted, first, end = self.admitted_time, self.first_token_time, self.finished_time
        if admitted is None or first is None or end is None:
            return None
        loaded = self.loaded_time if self.loaded_time is not None else admitted
        return RequestTimes(admitted - self.arrival_time, loaded - admitted, first - loaded,
                            end - first)  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
