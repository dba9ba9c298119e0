"""The KV data plane: a node's KV tensor, registered once, and READs of a peer's blocks.

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

Life of a `NixlTransport`:
1. `__init__` creates the NIXL agent (UCX backend, no NIXL progress thread, which would
   busy-spin a core), registers the whole tensor once, and starts one daemon thread, the
   *progress thread*. From then on that thread makes every NIXL call (multi-threaded use of
   one agent is unverified). It polls about every millisecond; each loop it also calls
   `get_new_notifs()`, which is what lets the owner side answer tcp READs and connection
   wireup, so the thread runs even on a node that never reads.
2. `read()` validates, queues a command and returns a future at once.
3. The progress thread runs the command through these states:

       queued ──add peer, post READ──▶ in flight ──DONE / ERR / NIXL raised──▶ ended
         │                               │  ▲
         │ deadline passed first         │  │ still polled: only NIXL can end it
         ▼                               ▼  │
       ended (nothing posted)          past deadline (warned; ends with ok=False)

   The future completes on reaching *ended*, never earlier. A READ cannot be cancelled:
   over tcp, an owner that stalls (SIGSTOP) past the deadline and resumes seconds later
   still delivers the data into the destination blocks, even after the reader released
   the handle or dropped the peer (`remove_remote_agent`, which even makes NIXL report
   NOT_FOUND at once). So a late READ is left in flight and polled until NIXL reports its
   end; an owner that dies ends it with an error.
4. `forget_peer()` drops a peer's connection once no read to it is in flight.
5. `close()` fails queued reads, gives in-flight ones `close_timeout_s` to end, then the
   thread drops the peers, deregisters the tensor and destroys the agent. Destroying the
   UCX worker is the one fence that stops a stuck READ, so their futures complete only
   after it. Free the tensor only after `close()`.

UCX reads its environment once per process, so set `UCX_NET_DEVICES`, `UCX_MODULES` and
`UCX_TLS` before the first `NixlTransport` is created.

`InProcessTransport` is a fake for unit tests that honours the same `read()` contract.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import logging
import math
import operator
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
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
class _ReadRequest:
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


def _completed(result: ReadResult) -> Future[ReadResult]:
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
            return _completed(ReadResult(ok=False, num_bytes=0, seconds=0.0, error=error))
        future: Future[ReadResult] = Future()
        future.set_running_or_notify_cancel()  # RUNNING: cancel() now returns False
        request = _ReadRequest(peer, remote, local, timeout_s, future, time.monotonic())
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

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the transport; in-flight reads end as described in `read`. Idempotent.
        The KV tensor may be freed once this returns."""

    @abc.abstractmethod
    def _agent_metadata(self) -> bytes: ...

    @abc.abstractmethod
    def _submit(self, request: _ReadRequest) -> None:
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


def _import_nixl() -> Any:
    try:
        # Not `import nixl`: that meta-package picks a CUDA build by probing torch.
        from nixl_cu12 import _api
    except ImportError as e:
        raise RuntimeError(
            "NixlTransport needs NIXL: pip install nixl-cu12==1.5.1 --no-deps "
            "(--no-deps avoids pulling CUDA wheels)"
        ) from e
    return _api


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass
class _Peer:
    metadata: bytes
    num_in_flight: int = 0


@dataclass(frozen=True)
class _ForgetRequest:
    agent_name: str


@dataclass(eq=False)  # identity: `in` and `remove` must not compare fields
class _InFlightRead:
    request: _ReadRequest
    peer: _Peer  # the connection it was posted on (a re-added peer is a new _Peer)
    handle: Any  # nixl_xfer_handle
    warned_late: bool = False


class NixlTransport(KVTransport):
    """The real data plane over NIXL/UCX. See the module docstring for its life."""

    def __init__(
        self,
        agent_name: str,
        kv_cache: torch.Tensor,
        *,
        poll_s: float = 0.001,
        close_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(agent_name, kv_cache)
        if not (poll_s > 0 and close_timeout_s >= 0):
            raise ValueError(
                f"need poll_s > 0 and close_timeout_s >= 0: {poll_s}, {close_timeout_s}"
            )
        api = _import_nixl()
        self.poll_s = poll_s
        self.close_timeout_s = close_timeout_s
        # Progress thread off: the library's own thread busy-spins (pthrDelay is fixed at 0).
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(agent_name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL could not create its UCX backend (see NIXL's log)")
        nbytes = self.num_blocks * self.block_bytes
        region = [(self.base_addr, nbytes, self.device_id, "")]
        self._registration = self._agent.register_memory(region, self.mem_type)
        self._metadata: bytes = self._agent.get_agent_metadata()
        # Owned by the progress thread (and by close() once that thread has stopped).
        self._commands: queue.SimpleQueue[_ReadRequest | _ForgetRequest] = queue.SimpleQueue()
        self._waiting: list[_ReadRequest | _ForgetRequest] = []
        self._in_flight: list[_InFlightRead] = []
        self._peers: dict[str, _Peer] = {}
        self._num_notif_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-{agent_name}", daemon=True)
        self._thread.start()
        logger.info(
            "NIXL transport %s: %d blocks x %d bytes (%s)",
            agent_name,
            self.num_blocks,
            self.block_bytes,
            self.mem_type,
        )

    def forget_peer(self, agent_name: str) -> None:
        with self._submit_lock:
            if not self._closed:
                self._commands.put(_ForgetRequest(agent_name))

    def close(self) -> None:
        with self._submit_lock:
            self._closed = True
        self._stop.set()
        # The progress thread itself does the cleanup, so close() is safe from a future's
        # done-callback (those run on that thread) and every NIXL call stays on one thread.
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _agent_metadata(self) -> bytes:
        return self._metadata

    def _submit(self, request: _ReadRequest) -> None:
        self._commands.put(request)

    # --- the progress thread ---------------------------------------------------------

    def _run(self) -> None:
        unfinished: list[_ReadRequest] = []
        try:
            while not self._stop.is_set():
                self._step()
                self._stop.wait(self.poll_s)
            unfinished = self._drain_on_close()
        except BaseException:
            logger.exception("NIXL %s: progress thread died", self.agent_name)
            with self._submit_lock:
                self._closed = True
            unfinished = self._take_unfinished()
        finally:
            self._destroy_agent()
            # Only now: with the UCX worker gone, nothing can land in their blocks.
            for request in unfinished:
                if not request.future.done():
                    self._finish(request, False, "transport closed before the READ ended")

    def _step(self) -> None:
        self._take_commands()
        if self._waiting:
            self._start_waiting()
        if self._in_flight:
            self._poll_in_flight()
        self._poll_notifs()

    def _take_commands(self) -> None:
        while True:
            try:
                self._waiting.append(self._commands.get_nowait())
            except queue.Empty:
                return

    def _start_waiting(self) -> None:
        # Commands for one peer run in arrival order; a blocked one holds back the later ones.
        blocked: set[str] = set()
        still_waiting: list[_ReadRequest | _ForgetRequest] = []
        for command in self._waiting:
            name = (
                command.peer.agent_name if isinstance(command, _ReadRequest) else command.agent_name
            )
            if isinstance(command, _ReadRequest) and time.monotonic() > command.deadline_s:
                self._finish(command, False, "timed out before the READ was posted")
            elif name in blocked or not self._try_start(command):
                blocked.add(name)
                still_waiting.append(command)
        self._waiting = still_waiting

    def _try_start(self, command: _ReadRequest | _ForgetRequest) -> bool:
        """Start a command; False if it must wait for the peer's in-flight reads to end.
        Never remove a peer under them: NIXL would report them failed (NOT_FOUND) while
        their data can still land."""
        if isinstance(command, _ForgetRequest):
            peer = self._peers.get(command.agent_name)
            if peer is not None and peer.num_in_flight:
                return False
            self._remove_peer(command.agent_name)
            return True
        peer = self._peers.get(command.peer.agent_name)
        if peer is not None and peer.metadata != command.peer.agent_metadata:
            if peer.num_in_flight:
                return False
            # Same name, new metadata: re-adding without removing would merge, not replace.
            self._remove_peer(command.peer.agent_name)
        self._post(command)
        return True

    def _post(self, request: _ReadRequest) -> None:
        peer = request.peer
        try:
            self._ensure_peer(peer)
            local = _block_descs(
                self.base_addr, self.block_bytes, request.local_block_ids, self.device_id
            )
            remote = _block_descs(
                peer.base_addr, peer.block_bytes, request.remote_block_ids, peer.device_id
            )
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self.mem_type),
                self._agent.get_xfer_descs(remote, peer.mem_type),
                peer.agent_name,
            )
        except Exception as e:
            self._finish(request, False, f"could not set up the READ: {_error_text(e)}")
            return
        read = _InFlightRead(request, self._peers[peer.agent_name], handle)
        read.peer.num_in_flight += 1
        try:
            state = self._agent.transfer(handle)  # with cma the whole copy runs in here
        except Exception as e:
            self._end(read, False, f"transfer failed: {_error_text(e)}")
            return
        self._in_flight.append(read)
        if state != "PROC":
            self._settle(read, state)

    def _ensure_peer(self, peer: TransportInfo) -> None:
        if peer.agent_name in self._peers:
            return
        loaded = self._agent.add_remote_agent(peer.agent_metadata)
        # add_remote_agent returns bytes although NIXL documents str.
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != peer.agent_name:
            if loaded_name not in self._peers:
                self._agent.remove_remote_agent(loaded_name)
            raise ValueError(f"metadata is for agent {loaded_name!r}")
        self._peers[peer.agent_name] = _Peer(peer.agent_metadata)
        logger.debug("NIXL %s: added peer %s", self.agent_name, peer.agent_name)

    def _remove_peer(self, agent_name: str) -> None:
        if self._peers.pop(agent_name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as e:
            logger.warning(
                "NIXL %s: removing peer %s failed: %s", self.agent_name, agent_name, _error_text(e)
            )
        logger.debug("NIXL %s: removed peer %s", self.agent_name, agent_name)

    def _poll_in_flight(self) -> None:
        for read in list(self._in_flight):
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as e:
                self._end(read, False, f"READ failed: {_error_text(e)}")
                continue
            self._settle(read, state)

    def _settle(self, read: _InFlightRead, state: str) -> None:
        """Act on a polled state: end the read, or note that it is past its deadline."""
        late = time.monotonic() > read.request.deadline_s
        if state == "DONE":
            self._end(read, not late, "READ completed after the deadline" if late else "")
        elif state != "PROC":
            self._end(read, False, f"READ ended in state {state}")
        elif late and not read.warned_late:
            read.warned_late = True
            logger.warning(
                "NIXL %s: %s is past its deadline; its blocks stay busy until it ends",
                self.agent_name,
                read.request,
            )

    def _end(self, read: _InFlightRead, ok: bool, error: str) -> None:
        try:
            read.handle.release()
        except Exception as e:
            logger.warning(
                "NIXL %s: releasing an ended READ failed: %s", self.agent_name, _error_text(e)
            )
        if read in self._in_flight:
            self._in_flight.remove(read)
        read.peer.num_in_flight -= 1
        self._finish(read.request, ok, error)

    def _finish(self, request: _ReadRequest, ok: bool, error: str) -> None:
        seconds = time.monotonic() - request.start_s
        num_bytes = len(request.local_block_ids) * self.block_bytes if ok else 0
        request.future.set_result(ReadResult(ok, num_bytes, seconds, error))
        if ok:
            logger.debug("NIXL %s: %s took %.1f ms", self.agent_name, request, seconds * 1e3)
        else:
            logger.warning(
                "NIXL %s: %s failed after %.3f s: %s", self.agent_name, request, seconds, error
            )

    def _poll_notifs(self) -> None:
        # Besides fetching notifications, this call is the owner's progress: it serves
        # peers' tcp READs and connection wireup.
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:
            self._num_notif_errors += 1
            if self._num_notif_errors % 1000 == 1:  # it runs every millisecond: don't flood
                logger.warning(
                    "NIXL %s: get_new_notifs failed (%d times): %s",
                    self.agent_name,
                    self._num_notif_errors,
                    _error_text(e),
                )
            return
        if notifs:
            logger.debug("NIXL %s: ignoring notifications %s", self.agent_name, notifs)

    def _drain_on_close(self) -> list[_ReadRequest]:
        """Fail what has not started; give in-flight reads `close_timeout_s` to end.
        Returns the reads still in flight, to be failed once the agent is destroyed."""
        self._take_commands()  # those queued before close() flipped _closed: not started
        for command in self._waiting:
            if isinstance(command, _ReadRequest):
                self._finish(command, False, "transport closed before the READ was posted")
        self._waiting = []
        deadline_s = time.monotonic() + self.close_timeout_s
        while self._in_flight and time.monotonic() < deadline_s:
            time.sleep(self.poll_s)
            self._poll_in_flight()
            self._poll_notifs()
        return self._take_unfinished()

    def _take_unfinished(self) -> list[_ReadRequest]:
        self._take_commands()
        unfinished = [c for c in self._waiting if isinstance(c, _ReadRequest)]
        unfinished += [read.request for read in self._in_flight]
        if self._in_flight:
            logger.error(
                "NIXL %s: closing with %d READs still in flight: destroying the agent under them",
                self.agent_name,
                len(self._in_flight),
            )
        self._waiting, self._in_flight = [], []  # drops their handles before the agent
        return unfinished

    def _destroy_agent(self) -> None:
        for name in list(self._peers):
            self._remove_peer(name)
        try:
            self._agent.deregister_memory(self._registration)
        except Exception as e:
            logger.warning("NIXL %s: deregister failed: %s", self.agent_name, _error_text(e))
        # Handles keep the C++ agent alive; they were dropped above, so this destroys it
        # and its UCX worker: its connections close and no progress runs any more.
        self._agent = None
        logger.info("NIXL transport %s closed", self.agent_name)


def _block_descs(
    base_addr: int, block_bytes: int, block_ids: Sequence[int], device_id: int
) -> np.ndarray:
    """One NIXL descriptor row (addr, len, device) per block."""
    descs = np.empty((len(block_ids), 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.asarray(block_ids, dtype=np.uint64) * block_bytes
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


# --- the in-process fake -----------------------------------------------------------------


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

    def _submit(self, request: _ReadRequest) -> None:
        inject_failure = self.fail_next_reads > 0
        if inject_failure:
            self.fail_next_reads -= 1
        thread = threading.Thread(
            target=self._copy, args=(request, self.delay_s, inject_failure), daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _copy(self, request: _ReadRequest, delay_s: float, inject_failure: bool) -> None:
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

    def _copy_blocks(self, request: _ReadRequest) -> str:
        try:
            return self._copy_blocks_or_raise(request)
        except Exception as e:  # the future must complete whatever happens
            return f"copy failed: {_error_text(e)}"

    def _copy_blocks_or_raise(self, request: _ReadRequest) -> str:
        with self._registry_lock:
            owner = self._registry.get(request.peer.agent_name)
        if owner is None or owner._agent_metadata() != request.peer.agent_metadata:
            return f"peer {request.peer.agent_name!r} not found"
        src = _as_block_bytes(owner.kv_cache)[list(request.remote_block_ids)]
        _as_block_bytes(self.kv_cache)[list(request.local_block_ids)] = src.to(self.kv_cache.device)
        return ""


def _as_block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor as raw bytes, [num_blocks, block_bytes], sharing storage."""
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


def create_transport(kind: str, agent_name: str, kv_cache: torch.Tensor) -> KVTransport:
    """`kind` is "nixl" (the real data plane) or "inprocess" (the unit-test fake)."""
    if kind == "nixl":
        return NixlTransport(agent_name, kv_cache)
    if kind == "inprocess":
        return InProcessTransport(agent_name, kv_cache)
    raise ValueError(f"unknown transport kind {kind!r}: expected 'nixl' or 'inprocess'")
