"""The API process's handle on the engine process.

`AsyncEngineClient.start()` spawns the engine process and waits for `Ready`. Each
`generate()` call sends an `AddRequest` and yields that request's `RequestOutput`s from a
queue that a single reader task fills from the engine's output socket. Leaving the
iterator early (client gone, error, cancellation) aborts the request in the engine, so
its KV blocks are freed within one engine step.

A request the server aborts while its caller still iterates (a drain, an operator's abort)
ends that iteration with the error given to `abort()`: the engine's aborted output (no or
some tokens, finish_reason "abort") is never yielded as if it were a completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import tempfile
from collections.abc import AsyncGenerator, Callable
from typing import Any

import zmq
import zmq.asyncio

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
from pdserve.engine.kv_connector import KVConnectorFactory
from pdserve.engine.kv_types import KVConnectorStats, KVHandshakeInfo, KVTransferSpec
from pdserve.errors import KVTransferError, PdserveError, RequestAbortedError, StatusError
from pdserve.kv_cache.prefix_summary import PrefixIndex
from pdserve.outputs import ComputeInfo, RequestOutput
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


def _engine_process_main(*args: Any) -> None:
    """The engine process's entry: `run_engine_process`, imported there and only there (it
    imports torch and the model; the API process needs neither)."""
    from pdserve.engine.core_process import run_engine_process

    run_engine_process(*args)


class EngineDeadError(PdserveError):
    http_status = 503
    error_type = "service_unavailable"


def request_failed(error: RequestError) -> StatusError:
    """The engine refused a request: relay its status and error type."""
    return StatusError(
        error.message, status=error.status, error_type=error.error_type, param=error.param
    )


class AsyncEngineClient:
    def __init__(
        self, config: EngineConfig, connector_factory: KVConnectorFactory | None = None
    ) -> None:
        """`connector_factory`: the KV connector the engine process builds (P/D nodes)."""
        self.config = config
        self.connector_factory = connector_factory
        self.model_name = config.model.model
        self.max_model_len = 0
        self.compute: ComputeInfo | None = None
        self.thinks = False
        """The model writes `<think>` reasoning (`Ready.thinks`)."""
        """What the engine computes with (dtype and why, kernels, CPU level)."""
        self.stats = EngineStats()
        self.prefix_index = PrefixIndex(config.cache.block_size)
        """The engine's prefix cache, as `GET /admin/prefix_cache` tells the proxy."""
        self._queues: dict[str, asyncio.Queue[RequestOutput | RequestError]] = {}
        self._abort_errors: dict[str, PdserveError] = {}
        """What `generate()` raises for a request the server aborted, until it has."""
        self._dir = tempfile.mkdtemp(prefix="pdserve-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._process: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.dead = False
        self.kv_handshake: KVHandshakeInfo | None = None
        """What the engine's KV connector publishes for peers (P/D nodes)."""
        self.on_freed_held: Callable[[list[str]], None] | None = None
        """Called with user request ids whose held blocks the engine just freed."""
        self.on_connector_stats: Callable[[KVConnectorStats], None] | None = None
        """Called with what the engine's KV connector counted (KV reads completed)."""

    async def start(self) -> None:
        input_addr = f"ipc://{self._dir}/input"
        output_addr = f"ipc://{self._dir}/output"
        self._to_engine.bind(input_addr)
        self._from_engine.bind(output_addr)
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=_engine_process_main,
            args=(self.config, self.connector_factory, input_addr, output_addr),
            name="pdserve-engine",
            daemon=True,
        )
        self._process.start()
        ready = await self._wait_ready()
        self.model_name, self.max_model_len, self.stats = (
            ready.model_name,
            ready.max_model_len,
            ready.stats,
        )
        self.kv_handshake = ready.kv_handshake
        self.compute = ready.compute
        self.thinks = ready.thinks
        self._reader = asyncio.create_task(self._read_outputs())

    async def _wait_ready(self) -> Ready:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while loop.time() < deadline:
            if await self._from_engine.poll(500):
                message = pickle.loads(await self._from_engine.recv())
                if isinstance(message, Ready):
                    return message
            if not self._process.is_alive():
                raise EngineDeadError(f"engine process {self._exit()}")
        raise EngineDeadError("engine process did not become ready in time")

    async def _read_outputs(self) -> None:
        while True:
            if not await self._from_engine.poll(1000):
                if not self._process.is_alive():
                    # The log says how (a signal: killed, or a crash in a kernel); clients
                    # get the 503 without it.
                    logger.error("engine process %s; failing its requests", self._exit())
                    self._fail_all("engine process died")
                    return
                continue
            message: StepOutputs = pickle.loads(await self._from_engine.recv())
            self.stats = message.stats
            self.prefix_index.apply(message.prefix_events)
            for error in message.errors:
                self._deliver(error.request_id, error)
            for output in message.outputs:
                self._deliver(output.request_id, output)
            if message.freed_held and self.on_freed_held is not None:
                self.on_freed_held(message.freed_held)
            stats = message.connector_stats
            if not stats.is_empty and self.on_connector_stats is not None:
                self.on_connector_stats(stats)

    def _deliver(self, request_id: str, item: RequestOutput | RequestError) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _exit(self) -> str:
        """How the engine process ended: its exit status, or the signal that ended it."""
        code = self._process.exitcode
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                return f"was ended by {signal.Signals(-code).name}"
        return f"exited ({code})"

    def _fail_all(self, reason: str) -> None:
        self.dead = True
        for request_id in list(self._queues):
            self._deliver(request_id, RequestError(request_id, 503, reason, "service_unavailable"))

    async def generate(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        kv_transfer: KVTransferSpec | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes; abort it if the caller stops early."""
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        queue: asyncio.Queue[RequestOutput | RequestError] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send(
                AddRequest(
                    request_id, params, prompt, messages, tools, template_kwargs, kv_transfer
                )
            )
            while True:
                item = await queue.get()
                if isinstance(item, RequestError):
                    finished = True
                    raise request_failed(item)
                finished = item.finished
                if item.error is not None:  # failed inside the engine (a remote KV load)
                    raise KVTransferError(item.error)
                if item.aborted:
                    raise self._abort_errors.get(request_id) or RequestAbortedError(
                        "the request was aborted by the server"
                    )
                yield item
                if finished:
                    return
        finally:
            del self._queues[request_id]
            self._abort_errors.pop(request_id, None)
            if not finished:
                await self.abort([request_id])

    async def abort(self, request_ids: list[str], error: PdserveError | None = None) -> None:
        """Abort requests in the engine (unknown or finished ids are ignored there).

        `error`: what the callers still iterating over these requests' `generate()` get
        instead of the aborted output; for the server's own aborts (drain, operator).
        None where nobody waits for the answer (the caller left)."""
        if error is not None:
            for request_id in request_ids:
                if request_id in self._queues:
                    self._abort_errors[request_id] = error
        if not self.dead:
            await self._send(AbortRequests(tuple(request_ids)))

    async def free_held(self, request_ids: list[str]) -> None:
        """Free the blocks the engine holds for these finished requests (a prefill node's
        handoffs ended); the engine reports the ids it freed through `on_freed_held`."""
        if not self.dead:
            await self._send(FreeHeld(tuple(request_ids)))

    async def _send(self, message: object) -> None:
        await self._to_engine.send(pickle.dumps(message))

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._send(Shutdown())
            await asyncio.to_thread(self._process.join, timeout_s)
            if self._process.is_alive():
                self._process.kill()
        if self._reader is not None:
            self._reader.cancel()
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        for name in ("input", "output"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)
