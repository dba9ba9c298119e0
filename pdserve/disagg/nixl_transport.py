"""Engine process: the NIXL data plane, a `KVTransport` over NIXL (UCX backend), host or
device memory.

Life of a `NixlTransport`:
1. `__init__` creates the NIXL agent (UCX backend, no NIXL progress thread, which would
   busy-spin a core), registers the whole tensor once, and starts one daemon thread, the
   *progress thread*. From then on that thread makes every NIXL call (multi-threaded use of
   one agent is unverified). Each loop it also calls `get_new_notifs()`, which is what
   lets the owner side answer tcp READs and connection wireup, so the thread runs even on
   a node that never reads. It loops about every millisecond while it has work: reads
   queued or in flight, or blocks peers may be reading (`set_serving(True)`, which the
   prefill connector keeps while it holds a handoff). Otherwise it waits `IDLE_WAIT_S`
   (an idle node spent 3-4% of a core polling; a new read wakes it at once).
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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.disagg.transport import (
    KVTransport,
    ReadRequest,
    ReadResult,
    TransportInfo,
    error_text,
)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02


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


@dataclass
class _Peer:
    metadata: bytes
    num_in_flight: int = 0


@dataclass(frozen=True)
class _ForgetRequest:
    agent_name: str


@dataclass(eq=False)  # identity: `in` and `remove` must not compare fields
class _InFlightRead:
    request: ReadRequest
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
        self._commands: queue.SimpleQueue[ReadRequest | _ForgetRequest] = queue.SimpleQueue()
        self._waiting: list[ReadRequest | _ForgetRequest] = []
        self._in_flight: list[_InFlightRead] = []
        self._peers: dict[str, _Peer] = {}
        self._num_notif_errors = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by a new command and by close()
        self._serving = False
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
                self._wake.set()

    def set_serving(self, serving: bool) -> None:
        self._serving = serving
        if serving:
            self._wake.set()

    def close(self) -> None:
        with self._submit_lock:
            self._closed = True
        self._stop.set()
        self._wake.set()
        # The progress thread itself does the cleanup, so close() is safe from a future's
        # done-callback (those run on that thread) and every NIXL call stays on one thread.
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _agent_metadata(self) -> bytes:
        return self._metadata

    def _submit(self, request: ReadRequest) -> None:
        self._commands.put(request)
        self._wake.set()

    # --- the progress thread ---------------------------------------------------------

    def _run(self) -> None:
        unfinished: list[ReadRequest] = []
        try:
            while not self._stop.is_set():
                self._step()
                self._wake.wait(self.wait_s())
                self._wake.clear()
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

    def wait_s(self) -> float:
        """How long the progress thread sleeps between loops: `poll_s` with work to
        progress, else `IDLE_WAIT_S`."""
        busy = self._serving or self._waiting or self._in_flight or not self._commands.empty()
        return self.poll_s if busy else IDLE_WAIT_S

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
        still_waiting: list[ReadRequest | _ForgetRequest] = []
        for command in self._waiting:
            name = (
                command.peer.agent_name if isinstance(command, ReadRequest) else command.agent_name
            )
            if isinstance(command, ReadRequest) and time.monotonic() > command.deadline_s:
                self._finish(command, False, "timed out before the READ was posted")
            elif name in blocked or not self._try_start(command):
                blocked.add(name)
                still_waiting.append(command)
        self._waiting = still_waiting

    def _try_start(self, command: ReadRequest | _ForgetRequest) -> bool:
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

    def _post(self, request: ReadRequest) -> None:
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
            self._finish(request, False, f"could not set up the READ: {error_text(e)}")
            return
        read = _InFlightRead(request, self._peers[peer.agent_name], handle)
        read.peer.num_in_flight += 1
        try:
            state = self._agent.transfer(handle)  # with cma the whole copy runs in here
        except Exception as e:
            self._end(read, False, f"transfer failed: {error_text(e)}")
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
                "NIXL %s: removing peer %s failed: %s", self.agent_name, agent_name, error_text(e)
            )
        logger.debug("NIXL %s: removed peer %s", self.agent_name, agent_name)

    def _poll_in_flight(self) -> None:
        for read in list(self._in_flight):
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as e:
                self._end(read, False, f"READ failed: {error_text(e)}")
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
                "NIXL %s: releasing an ended READ failed: %s", self.agent_name, error_text(e)
            )
        if read in self._in_flight:
            self._in_flight.remove(read)
        read.peer.num_in_flight -= 1
        self._finish(read.request, ok, error)

    def _finish(self, request: ReadRequest, ok: bool, error: str) -> None:
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
                    error_text(e),
                )
            return
        if notifs:
            logger.debug("NIXL %s: ignoring notifications %s", self.agent_name, notifs)

    def _drain_on_close(self) -> list[ReadRequest]:
        """Fail what has not started; give in-flight reads `close_timeout_s` to end.
        Returns the reads still in flight, to be failed once the agent is destroyed."""
        self._take_commands()  # those queued before close() flipped _closed: not started
        for command in self._waiting:
            if isinstance(command, ReadRequest):
                self._finish(command, False, "transport closed before the READ was posted")
        self._waiting = []
        deadline_s = time.monotonic() + self.close_timeout_s
        while self._in_flight and time.monotonic() < deadline_s:
            time.sleep(self.poll_s)
            self._poll_in_flight()
            self._poll_notifs()
        return self._take_unfinished()

    def _take_unfinished(self) -> list[ReadRequest]:
        self._take_commands()
        unfinished = [c for c in self._waiting if isinstance(c, ReadRequest)]
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
            logger.warning("NIXL %s: deregister failed: %s", self.agent_name, error_text(e))
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
