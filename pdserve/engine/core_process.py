"""The engine process: owns the model and the KV pool, steps as fast as it can.

Why a separate process: a step holds the GIL for tens of milliseconds of Python and
kernel dispatch; in the HTTP process that would stall `/health` and every stream. Running
the engine in its own process (as vLLM and mini-sglang do) keeps the event loop free.

Life of the process:
    spawn → load model → send Ready → loop:
        drain every queued message (add / abort / shutdown) without blocking while busy,
        or waiting up to IDLE_POLL_MS when idle;
        if requests are unfinished: step once, send StepOutputs (outputs + stats);
        else: tick the connector and send stats when they changed.
    Shutdown (or the API process gone) → abort everything → exit.
"""

from __future__ import annotations

import logging
import pickle
import signal
from typing import Any

import zmq

from pdserve.config import EngineConfig
from pdserve.engine.core_messages import (
    AbortRequests,
    AddRequest,
    EngineStats,
    Ready,
    RequestError,
    Shutdown,
    StepOutputs,
)
from pdserve.engine.engine import LLMEngine
from pdserve.errors import PdserveError

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50


def engine_stats(engine: LLMEngine) -> EngineStats:
    sched = engine.scheduler
    return EngineStats(
        num_blocks=engine.kv.num_blocks,
        num_free_blocks=engine.kv.num_free_blocks,
        num_held_blocks=sum(len(engine.kv.block_ids(r)) for r in sched.held),
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_preemptions=sched.num_preemptions,
        num_steps=engine.num_steps,
    )


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the child process (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    try:
        engine = LLMEngine(config)
        name = config.model.model
        outbox.send(pickle.dumps(Ready(name, engine.max_model_len, engine_stats(engine))))
        _loop(engine, inbox, outbox)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _loop(engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
    last_stats = None
    while True:
        busy = engine.has_unfinished()
        errors: list[RequestError] = []
        if inbox.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    message = pickle.loads(inbox.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(message, Shutdown):
                    engine.abort(list(engine.outputs.request_ids()))
                    return
                errors.extend(_handle(engine, message))
        outputs = engine.step() if engine.has_unfinished() else []
        if not outputs:
            engine.scheduler.tick()
        stats = engine_stats(engine)
        if outputs or errors or stats != last_stats:
            outbox.send(pickle.dumps(StepOutputs(outputs, errors, stats)))
            last_stats = stats


def _handle(engine: LLMEngine, message: Any) -> list[RequestError]:
    if isinstance(message, AbortRequests):
        engine.abort(list(message.request_ids))
        return []
    if not isinstance(message, AddRequest):
        logger.warning("ignoring unknown message %r", type(message).__name__)
        return []
    try:
        prompt = message.prompt
        if message.messages is not None:
            if engine.tokenizer is None:
                raise PdserveError("this model has no tokenizer for chat")
            prompt = engine.tokenizer.apply_chat_template(message.messages)
        if prompt is None:
            raise PdserveError("request without a prompt")
        engine.add_request(prompt, message.params, request_id=message.request_id)
    except PdserveError as e:
        return [RequestError(message.request_id, e.http_status, e.message, e.error_type, e.param)]
    return []
