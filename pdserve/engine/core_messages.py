"""Messages between the API process and the engine process (pickled over ZMQ IPC).

API → engine: `AddRequest`, `AbortRequests`, `Shutdown`.
Engine → API: `Ready` once, then `StepOutputs` (outputs of one step, the request errors
since the last message, and a snapshot of the engine's counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages: the engine renders the model's chat template."""


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_held_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_steps: int = 0


@dataclass(frozen=True)
class RequestError:
    request_id: str
    status: int
    message: str
    error_type: str
    param: str | None = None


@dataclass(frozen=True)
class Ready:
    model_name: str
    max_model_len: int
    stats: EngineStats


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
