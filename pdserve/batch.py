"""The contract between the scheduler (`engine/`) and the model runner (`model/`): one step's
batch. It lives below both, so the model layer never imports the engine.

`ScheduledRequest` is generic in the request it carries: the engine schedules its own
`engine.request.Request`s (`SchedulerOutput[Request]`), and the model reads only what
`SequenceState` names of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from pdserve.sampling_params import SamplingParams


class SequenceState(Protocol):
    """What the model runner and the sampler read of a scheduled request."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def output_token_ids(self) -> list[int]: ...

    grammar: Any
    """An llguidance matcher (`pdserve.structured`) the next token must fit, or None."""
    num_remote_draws: int
    """Draws another node made from this request's seed; the sampler skips them, then
    sets this to 0."""


R = TypeVar("R", bound=SequenceState, covariant=True)


@dataclass(frozen=True)
class ScheduledRequest(Generic[R]):
    request: R
    num_new_tokens: int
    num_context_tokens: int
    """Tokens already in the cache before this step's `num_new_tokens`."""
    block_ids: tuple[int, ...]
    samples: bool
    """This step reaches the end of the request's known tokens, so it samples a token
    (unless the request asked for none: `max_tokens=0`). Fixed when scheduled: the
    request's token count changes once the token is appended."""


@dataclass(frozen=True)
class SchedulerOutput(Generic[R]):
    scheduled: tuple[ScheduledRequest[R], ...]
    """Single-token entries (decodes) first, then multi-token prefill chunks."""
    num_decodes: int
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
