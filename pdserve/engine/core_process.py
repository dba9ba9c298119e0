"""The engine process: owns the model and the KV pool, steps as fast as it can.

Why a separate process: a step holds the GIL for tens of milliseconds of Python and
kernel dispatch; in the HTTP process that would stall `/health` and every stream. Running
the engine in its own process (as vLLM and mini-sglang do) keeps the event loop free.

Life of the process:
    spawn → load model → send Ready → loop:
        drain every queued message (add / abort / free held / shutdown) without blocking
        while busy, or waiting up to IDLE_POLL_MS when idle;
        if requests are unfinished: step once, send StepOutputs (outputs + stats);
        else: tick the connector and send stats when they changed.
    Shutdown (or the API process gone) → abort everything → exit.
"""

from __future__ import annotations

import logging
import pickle
import signal
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve import envs, logs, reasoning
from pdserve.config import EngineConfig
from pdserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    FreeHeld,
    Ready,
    RequestError,
    Shutdown,
    StepOutputs,
)
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_connector import KVConnectorFactory
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.heap import freeze_startup_objects
from pdserve.outputs import RequestOutput
from pdserve.parent_watch import ParentWatch

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
TRANSFER_POLL_MS = 2


def engine_stats(engine: LLMEngine) -> EngineStats:
    sched = engine.scheduler
    return EngineStats(
        num_blocks=engine.kv.num_blocks,
        num_free_blocks=engine.kv.num_free_blocks,
        num_held_blocks=sum(len(engine.kv.block_ids(r)) for r in sched.held),
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_loading=len(sched.loading),
        num_preemptions=sched.num_preemptions,
        num_steps=engine.num_steps,
        num_prompt_tokens_computed=sched.num_prompt_tokens_computed,
        num_prompt_tokens_pending=sched.num_prompt_tokens_pending,
    )


def run_engine_process(
    config: EngineConfig,
    connector_factory: KVConnectorFactory | None,
    input_addr: str,
    output_addr: str,
) -> None:
    """Entry point of the child process (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    logs.configure(envs.log_level(), logs.ENGINE_FORMAT)  # the API process's level
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    parent = ParentWatch()
    try:
        engine = LLMEngine(config, connector_factory)
        engine.kv.pool.record_events = True  # the node's prefix index (prefix_summary.py)
        freeze_startup_objects()
        outbox.send(pickle.dumps(_ready(engine)))
        try:
            _loop(engine, inbox, outbox, parent)
        finally:
            engine.close()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _ready(engine: LLMEngine) -> Ready:
    return Ready(
        engine.config.model.model,
        engine.max_model_len,
        engine_stats(engine),
        engine.connector.handshake_info(),
        engine.runner.compute,
        engine.tokenizer is not None and reasoning.thinks(engine.tokenizer.chat_template),
    )


def _poll_ms(engine: LLMEngine) -> int:
    """How long to wait for messages: not at all while there is compute to do; briefly
    while remote loads or held blocks wait on the connector's threads; else idle."""
    sched = engine.scheduler
    if sched.has_runnable():
        return 0
    return TRANSFER_POLL_MS if sched.loading or sched.held else IDLE_POLL_MS


@dataclass
class _Replies:
    """What one loop iteration sends back in its `StepOutputs`."""

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    freed_held: list[str] = field(default_factory=list)


def _loop(engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, parent: ParentWatch) -> None:
    last_stats = None
    while True:
        if parent.parent_gone:
            # The API process died without a Shutdown (SIGKILL, crash). An orphaned engine
            # would keep pinning blocks and renewing leases: abort everything and exit.
            logger.error("the API process is gone: aborting all requests and exiting")
            engine.abort(list(engine.outputs.request_ids()))
            return
        replies = _Replies()
        if inbox.poll(_poll_ms(engine)) and not _drain_inbox(engine, inbox, replies):
            return
        replies.outputs += engine.step() if engine.has_unfinished() else engine.tick()
        stats = engine_stats(engine)
        connector_stats = engine.connector.take_stats()
        prefix_events = engine.kv.pool.take_events()
        if (
            replies.outputs
            or replies.errors
            or replies.freed_held
            or not connector_stats.is_empty
            or prefix_events
            or stats != last_stats
        ):
            message = StepOutputs(
                replies.outputs,
                replies.errors,
                stats,
                replies.freed_held,
                connector_stats,
                prefix_events,
            )
            outbox.send(pickle.dumps(message))
            last_stats = stats


def _drain_inbox(engine: LLMEngine, inbox: zmq.Socket, replies: _Replies) -> bool:
    """Apply every queued message without blocking; False once told to shut down (every
    request is aborted then)."""
    while True:
        try:
            message = pickle.loads(inbox.recv(zmq.NOBLOCK))
        except zmq.Again:
            return True
        if isinstance(message, Shutdown):
            engine.abort(list(engine.outputs.request_ids()))
            return False
        _handle(engine, message, replies)


def _handle(engine: LLMEngine, message: Any, replies: _Replies) -> None:
    """Apply one message. Aborted requests' final outputs and refusals go to the replies (a
    caller may still be waiting for them: the abort API aborts others' requests)."""
    if isinstance(message, AbortRequests):
        replies.outputs += engine.abort(list(message.request_ids))
    elif isinstance(message, FreeHeld):
        replies.freed_held += engine.free_held(list(message.request_ids))
    elif isinstance(message, AddRequest):
        _add(engine, message, replies.errors)
    else:
        logger.warning("ignoring unknown message %r", type(message).__name__)


def _add(engine: LLMEngine, message: AddRequest, errors: list[RequestError]) -> None:
    try:
        prompt = message.prompt
        if message.messages is not None:
            if engine.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: it cannot chat", param="messages"
                )
            prompt = engine.tokenizer.apply_chat_template(
                message.messages, tools=message.tools, template_kwargs=message.template_kwargs
            )
        if prompt is None:
            raise PdserveError("request without a prompt")
        engine.add_request(
            prompt, message.params, request_id=message.request_id, kv_transfer=message.kv_transfer
        )
    except PdserveError as e:
        errors.append(
            RequestError(message.request_id, e.http_status, e.message, e.error_type, e.param)
        )
