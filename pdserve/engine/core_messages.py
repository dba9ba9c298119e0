"""Messages between the API process and the engine process (pickled over ZMQ IPC).

API → engine: `AddRequest`, `AbortRequests`, `FreeHeld`, `Shutdown`.
Engine → API: `Ready` once, then `StepOutputs` (outputs of one step, the request errors
since the last message, and a snapshot of the engine's counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.kv_types import NO_STATS, KVConnectorStats, KVHandshakeInfo, KVTransferSpec
from pdserve.outputs import ComputeInfo, RequestOutput
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages: the engine renders the model's chat template."""
    tools: list[dict[str, Any]] | None = None
    """A chat's tools (OpenAI's `tools`), rendered with its messages."""
    template_kwargs: dict[str, Any] | None = None
    """A chat's `chat_template_kwargs` (Qwen3's `enable_thinking`), for its template."""
    kv_transfer: KVTransferSpec | None = None
    """`RemoteDecode` / `RemotePrefill` (pdserve.disagg.params) for a P/D leg."""


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class FreeHeld:
    """Free the blocks held for these finished requests (user request ids): their owner
    (a prefill node's handoff table) is done with them. Ids not held are ignored; the
    freed ones come back in `StepOutputs.freed_held`."""

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
    num_loading: int = 0
    """Requests waiting for a remote KV load (decode nodes)."""
    num_preemptions: int = 0
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    """Prompt tokens the model ran on since start: prefix-cache hits and tokens read from
    a prefill node are not computed (what cache-aware routing saves)."""
    num_prompt_tokens_pending: int = 0
    """Prompt tokens waiting or admitted, not computed yet (`Scheduler`)."""


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
    kv_handshake: KVHandshakeInfo | None = None
    """What the KV connector publishes for peers (P/D nodes: the KV layout they must
    match and the transport address decode nodes read from)."""
    compute: ComputeInfo | None = None
    thinks: bool = False
    """The model writes `<think>` reasoning (its chat template does: `reasoning.thinks`)."""


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    freed_held: list[str] = field(default_factory=list)
    """User request ids whose held blocks were freed since the last message."""
    connector_stats: KVConnectorStats = NO_STATS
    """What the KV connector counted since the last message (KV reads completed)."""
    prefix_events: list[tuple[bool, bytes]] = field(default_factory=list)
    """Block hashes that entered (True) or left the prefix cache, in order
    (`kv_cache/prefix_summary.py`)."""
