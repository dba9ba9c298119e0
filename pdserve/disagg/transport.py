"""Engine process: the KV data plane, a node's KV tensor registered once, and READs of a
peer's blocks.

Both nodes of a P/D pair create one transport over their own KV tensor. The prefill node
(the *owner*) only serves: it publishes `info()` in the node handshake and keeps polling so
that its peers' READs can progress. The decode node (the *reader*) calls `read()` to copy
some of the owner's blocks into some of its own.

Block addressing (the tensor is contiguous and block-major, `kv_cache[num_blocks, ...]`):

    base_addr
    │◀── block_bytes ──▶│
    ├───────────────────┼───────────────────┼─────┼───────────────────┤
    │      block 0      │      block 1      │ ... │  block n-1        │
    block i = bytes [base_addr + i * block_bytes, base_addr + (i + 1) * block_bytes)

`NixlTransport` (`nixl_transport.py`) is the real one; its docstring narrates its life.

`InProcessTransport` is a fake for unit tests that honours the same `read()` contract.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import logging
import math
import operator
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class TransportInfo:
    """What a reader needs to read an owner's blocks; sent in the node handshake (JSON-able
    except agent_metadata, which the caller base64-encodes: see `to_json_dict`)."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-able dict, `agent_metadata` base64-encoded."""
        metadata = base64.b64encode(self.agent_metadata).decode("ascii")
        return {**dataclasses.asdict(self), "agent_metadata": metadata}

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> TransportInfo:
        """Inverse of `to_json_dict`; raises KeyError/ValueError/TypeError on a bad dict."""
        kwargs = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        kwargs["agent_metadata"] = base64.b64decode(data["agent_metadata"], validate=True)
        info = cls(**kwargs)
        numbers = (info.base_addr, info.block_bytes, info.num_blocks, info.device_id)
        if not all(type(n) is int for n in numbers):
            raise TypeError(f"TransportInfo fields must be integers: {numbers}")
        return info


@dataclass(frozen=True)
class ReadResult:
    """How a read ended. `num_bytes` is what the READ copied: 0 unless `ok`. `seconds` runs
    from the `read()` call to the end (queueing and connection setup included)."""

    ok: bool
    num_bytes: int
    seconds: float
    error: str = ""


@dataclass(frozen=True)
class ReadRequest:
    peer: TransportInfo
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    timeout_s: float
    future: Future[ReadResult]
    start_s: float

    @property
    def deadline_s(self) -> float:
        return self.start_s + self.timeout_s

    def __str__(self) -> str:  # for log lines
        return f"READ of {len(self.local_block_ids)} blocks from {self.peer.agent_name}"


def completed_future(result: ReadResult) -> Future[ReadResult]:
    future: Future[ReadResult] = Future()
    future.set_result(result)
    return future


def _block_ids(ids: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        return tuple(operator.index(i) for i in ids)
    except TypeError:
        raise ValueError(f"{what} must be integers, got {list(ids)!r}") from None


class KVTransport(abc.ABC):
    """Moves KV blocks between nodes. One per node, over the node's whole KV tensor."""

    def __init__(self, agent_name: str, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (block-major [num_blocks, ...])")
        if kv_cache.dim() < 1 or kv_cache.shape[0] < 1 or kv_cache.numel() == 0:
            raise ValueError(f"kv_cache has no blocks: shape {tuple(kv_cache.shape)}")
        self.agent_name = agent_name
        self.kv_cache = kv_cache
        self.num_blocks = int(kv_cache.shape[0])
        # == stride(0) * element_size() for a contiguous tensor, also when num_blocks == 1
        # (where torch may report any stride for dim 0).
        self.block_bytes = math.prod(kv_cache.shape[1:]) * kv_cache.element_size()
        self.base_addr = int(kv_cache.data_ptr())
        self.mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.device_id = int(kv_cache.get_device()) if kv_cache.is_cuda else 0
        self._submit_lock = threading.Lock()
        self._closed = False

    def info(self) -> TransportInfo:
        """What a peer needs to read this node's blocks."""
        return TransportInfo(
            agent_name=self.agent_name,
            agent_metadata=self._agent_metadata(),
            base_addr=self.base_addr,
            block_bytes=self.block_bytes,
            num_blocks=self.num_blocks,
            mem_type=self.mem_type,
            device_id=self.device_id,
        )

    def read(
        self,
        peer: TransportInfo,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout_s: float,
    ) -> Future[ReadResult]:
        """READ `peer`'s blocks `remote_block_ids[k]` into this node's `local_block_ids[k]`.

        Called by the decode node, from any thread; returns at once. The contract:

        - Programming errors raise ValueError: unequal or empty id lists, local ids out of
          range or repeated, ids that are not integers, `timeout_s` not positive.
        - Everything about the peer or the transfer is reported, never raised: a peer whose
          block size differs or whose ids are out of range, an unknown memory type, a closed
          transport, a dead or unreachable owner, any NIXL exception. These give a future
          whose result has `ok=False` and a readable `error` (already completed when the
          problem is found before anything is posted).
        - The future completes only when the READ has ended: NIXL reported DONE or ERR,
          raised, or the transport was closed (its agent destroyed). Only then may the
          caller reuse the local blocks (free, reallocate, recompute into them). Passing
          `timeout_s` does not end a READ: a released or disconnected tcp READ still
          lands when a stalled owner resumes, so a late READ stays in flight until NIXL
          reports its end (an owner that dies ends it). A caller that must move on sooner
          can stop waiting and recompute into *other* blocks, freeing these from the
          future's done-callback. The future cannot be cancelled.
        - `ok=True` only if DONE was observed within `timeout_s` of this call. Choose
          `timeout_s` to end before the owner's claim deadline, and a successful read
          never read blocks that the owner might already have freed. A READ that ends
          late gives `ok=False`, even though its data arrived.
        - Done-callbacks run on the transport's thread: keep them short (what
          `asyncio.wrap_future` adds is fine).
        """
        remote, local = self._check_args(remote_block_ids, local_block_ids, timeout_s)
        error = self._peer_error(peer, remote)
        if error:
            logger.warning("read from %s refused: %s", peer.agent_name, error)
            return completed_future(ReadResult(ok=False, num_bytes=0, seconds=0.0, error=error))
        future: Future[ReadResult] = Future()
        future.set_running_or_notify_cancel()  # RUNNING: cancel() now returns False
        request = ReadRequest(peer, remote, local, timeout_s, future, time.monotonic())
        with self._submit_lock:  # close() flips _closed under it: nothing is queued after
            if self._closed:
                future.set_result(ReadResult(False, 0, 0.0, "transport is closed"))
            else:
                self._submit(request)
        return future

    @abc.abstractmethod
    def forget_peer(self, agent_name: str) -> None:
        """Drop the connection to a peer (dead, restarted under a new name, or done with).
        Reads already in flight to it still end normally first. Unknown names are ignored."""

    def set_serving(self, serving: bool) -> None:
        """Whether peers may be reading this node's blocks now (it holds handoffs): a
        transport that must progress the owner's side of a read stays prompt while True."""
        return  # the in-process copies need no progress

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the transport; in-flight reads end as described in `read`. Idempotent.
        The KV tensor may be freed once this returns."""

    @abc.abstractmethod
    def _agent_metadata(self) -> bytes: ...

    @abc.abstractmethod
    def _submit(self, request: ReadRequest) -> None:
        """Start a validated read; called with the submit lock held, never after close."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_args(
        self, remote_block_ids: Sequence[int], local_block_ids: Sequence[int], timeout_s: float
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        remote = _block_ids(remote_block_ids, "remote_block_ids")
        local = _block_ids(local_block_ids, "local_block_ids")
        if len(remote) != len(local):
            raise ValueError(f"{len(remote)} remote block ids but {len(local)} local ones")
        if not local:
            raise ValueError("read of zero blocks")
        if not all(0 <= i < self.num_blocks for i in local):
            raise ValueError(f"local block ids out of range [0, {self.num_blocks}): {local}")
        if len(set(local)) != len(local):
            raise ValueError(f"local block ids repeat (two blocks into one): {local}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        return remote, local

    def _peer_error(self, peer: TransportInfo, remote: tuple[int, ...]) -> str:
        if peer.agent_name == self.agent_name:
            return f"peer has this transport's own agent name {peer.agent_name!r}"
        if peer.block_bytes != self.block_bytes:
            return (
                f"block size mismatch: peer {peer.block_bytes} bytes, local "
                f"{self.block_bytes} bytes (different model, block size or dtype?)"
            )
        if peer.mem_type not in MEM_TYPES:
            return f"peer has unknown memory type {peer.mem_type!r}"
        bad = [i for i in remote if not 0 <= i < peer.num_blocks]
        if bad:
            return f"remote block ids out of the peer's range [0, {peer.num_blocks}): {bad}"
        return ""


# --- NIXL --------------------------------------------------------------------------------


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class InProcessTransport(KVTransport):
    """Fake for unit tests only: peers are other InProcessTransport objects in this process.

    A read copies the blocks' bytes with torch on a background thread, after `delay_s`.
    `fail_next_reads` makes the next reads fail without copying. Like a released NIXL READ,
    a read that outlives its timeout still copies, then completes with `ok=False`: the
    future never completes before the copy has ended.
    """

    _registry: ClassVar[dict[str, InProcessTransport]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, agent_name: str, kv_cache: torch.Tensor) -> None:
        super().__init__(agent_name, kv_cache)
        self.fail_next_reads = 0
        self.delay_s = 0.0
        self.forgotten_peers: list[str] = []
        self._threads: list[threading.Thread] = []
        with self._registry_lock:
            if agent_name in self._registry:
                raise ValueError(f"an InProcessTransport named {agent_name!r} is open")
            self._registry[agent_name] = self

    def forget_peer(self, agent_name: str) -> None:
        self.forgotten_peers.append(agent_name)

    def close(self) -> None:
        with self._submit_lock:
            already_closed, self._closed = self._closed, True
        if not already_closed:
            with self._registry_lock:
                if self._registry.get(self.agent_name) is self:
                    del self._registry[self.agent_name]
        for thread in list(self._threads):
            thread.join()

    def _agent_metadata(self) -> bytes:
        return f"inprocess:{self.agent_name}:{id(self)}".encode()

    def _submit(self, request: ReadRequest) -> None:
        inject_failure = self.fail_next_reads > 0
        if inject_failure:
            self.fail_next_reads -= 1
        thread = threading.Thread(
            target=self._copy, args=(request, self.delay_s, inject_failure), daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _copy(self, request: ReadRequest, delay_s: float, inject_failure: bool) -> None:
        try:
            time.sleep(delay_s)
            error = "injected failure" if inject_failure else self._copy_blocks(request)
            seconds = time.monotonic() - request.start_s
            if not error and seconds > request.timeout_s:
                error = f"READ completed after the deadline ({request.timeout_s:.3f}s)"
            num_bytes = 0 if error else len(request.local_block_ids) * self.block_bytes
            request.future.set_result(ReadResult(not error, num_bytes, seconds, error))
        finally:
            self._threads.remove(threading.current_thread())

    def _copy_blocks(self, request: ReadRequest) -> str:
        try:
            return self._copy_blocks_or_raise(request)
        except Exception as e:  # the future must complete whatever happens
            return f"copy failed: {error_text(e)}"

    def _copy_blocks_or_raise(self, request: ReadRequest) -> str:
        with self._registry_lock:
            owner = self._registry.get(request.peer.agent_name)
        if owner is None or owner._agent_metadata() != request.peer.agent_metadata:
            return f"peer {request.peer.agent_name!r} not found"
        src = _as_block_bytes(owner.kv_cache)[list(request.remote_block_ids)]
        _as_block_bytes(self.kv_cache)[list(request.local_block_ids)] = src.to(self.kv_cache.device)
        return ""


def _as_block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor as raw bytes, [num_blocks, block_bytes], sharing storage."""
    import torch  # only the engine process, which holds the cache, gets here

    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
