"""Engine process: the KV connectors of P/D nodes, what the role-agnostic scheduler calls
on a prefill or a decode node. Both own their process's `KVTransport`; the launcher picks
one through `connector_factory`.

Prefill node (`PrefillConnector`): a prefill leg (`RemoteDecode`) that finishes normally
keeps its blocks pinned; the handoff table in the API process decides when they go (read
done, release, abort, lease or claim deadline) and says so with a `FreeHeld` message,
which `on_free_held` grants at once. An aborted prefill leg holds nothing (S2).

Decode node (`DecodeConnector`), for a request carrying `RemotePrefill`:

    added ──▶ PENDING (lease renewed every lease/4 by the renew thread)
                │ admitted with blocks
                ▼
              LOADING (worker thread: handshake → claim → NIXL READ → done/failed)
                │ the read has ended (or never started)
                ▼
              ENDED ──▶ LoadResult to the scheduler (ok / recompute / error)

What is read: the KV of every prompt position, and the request continues from the token the
prefill leg sampled (`RemotePrefill.first_token`), so it computes exactly what one node
computes (design §8). Without that token (a vLLM prefill node), the last prompt position is
left out of the read and recomputed here, as vLLM's decode does.

    aborted while PENDING: release the handoff, free the blocks at once (S5).
    aborted while LOADING: blocks stay held until the read has ended, then freed (S6).

The decode node never reads before a successful claim, and stops trusting a read a
margin before the claim deadline (invariant 3); a refused claim, an unreachable prefill
node or a failed read means recompute (policy `recompute`) or fail (policy `fail`). A
request loads at most once: after a preemption it recomputes locally (S21).
"""

from __future__ import annotations

import enum
import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.disagg.config import KVLoadFailurePolicy, KVTransferConfig, KVTransportKind, Role
from pdserve.disagg.control import ControlClient, ControlError
from pdserve.disagg.messages import Handshake, Outcome, ReleaseReason
from pdserve.disagg.params import (
    KVLayout,
    NodeKVInfo,
    RemoteDecode,
    RemotePrefill,
    model_fingerprint,
)
from pdserve.disagg.renewer import LeaseRenewer
from pdserve.disagg.transport import InProcessTransport, KVTransport, ReadResult
from pdserve.engine.kv_connector import KVConnector, KVConnectorFactory
from pdserve.engine.kv_types import (
    NO_EVENTS,
    ConnectorEvents,
    KVConnectorStats,
    LoadResult,
    RemoteToken,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.seams import NO_SEAMS, Seams

if TYPE_CHECKING:
    import torch

    from pdserve.batch import SchedulerOutput
    from pdserve.model.loader import LoadedModel

logger = logging.getLogger(__name__)

CLAIM_MARGIN_S = 1.0
"""The decode node gives up on a read this long before the prefill node's claim deadline,
so it never uses blocks the prefill node may already have freed."""
NUM_LOAD_WORKERS = 4


class PrefillConnector(KVConnector):
    def __init__(self, transport: KVTransport, layout: KVLayout) -> None:
        self.transport = transport
        self.layout = layout
        self._held: set[str] = set()  # while any: decode nodes may be reading our blocks

    def on_request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        finished_normally = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        )
        hold = (
            isinstance(request.kv_transfer, RemoteDecode) and finished_normally and bool(block_ids)
        )
        if hold:
            self._held.add(request.request_id)
            self.transport.set_serving(True)
        return hold

    def on_free_held(self, request_ids: Sequence[str]) -> Sequence[str]:
        # Nothing here writes into held blocks: the decode node only reads them, and the
        # handoff table frees them only once no claimed read can still be running.
        self._held.difference_update(request_ids)
        self.transport.set_serving(bool(self._held))
        return request_ids

    def handshake_info(self) -> NodeKVInfo:
        return NodeKVInfo(self.layout, self.transport.info())

    def close(self) -> None:
        self.transport.close()


class LoadState(enum.Enum):
    PENDING = "pending"
    LOADING = "loading"
    ENDED = "ended"


@dataclass
class _Load:
    request_id: str
    remote: RemotePrefill
    state: LoadState = LoadState.PENDING
    aborted: bool = False
    result: LoadResult | None = None
    remote_block_ids: list[int] = field(default_factory=list)
    local_block_ids: list[int] = field(default_factory=list)
    next_token: RemoteToken | None = None
    """Set at admission when the whole prompt is read: the request continues from it."""


class DecodeConnector(KVConnector):
    def __init__(
        self,
        transport: KVTransport,
        control: ControlClient,
        layout: KVLayout,
        block_size: int,
        vocab_size: int,
        fail_on_load_error: bool = False,
        seams: Seams = NO_SEAMS,
    ) -> None:
        self.transport = transport
        self.control = control
        self.layout = layout
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.fail_on_load_error = fail_on_load_error
        self.seams = seams
        self._loads: dict[str, _Load] = {}
        self._lock = threading.Lock()
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._peers: dict[str, Handshake] = {}
        self._workers = ThreadPoolExecutor(NUM_LOAD_WORKERS, thread_name_prefix="kv-load")
        self._renewer = LeaseRenewer(control)
        """Renews each load's handoff from its arrival until its claim (or its end)."""
        self._transfers: list[tuple[int, float]] = []
        self._claims_s: list[float] = []

    # -- scheduler hooks (engine thread) ----------------------------------------------

    def on_request_added(self, request: Request) -> None:
        remote = request.kv_transfer
        if isinstance(remote, RemotePrefill):
            with self._lock:
                self._loads[request.request_id] = _Load(request.request_id, remote)
            self._renewer.add(request.request_id, remote.control_url, remote.ref, remote.lease_s)

    def get_num_remote_tokens(self, request: Request, num_local_tokens: int) -> int:
        load = self._loads.get(request.request_id)
        if load is None or load.state is not LoadState.PENDING:
            return 0
        if load.remote.num_tokens != request.num_prompt_tokens:
            return 0  # not this prompt's KV: recompute (on_admitted releases the handoff)
        if self._first_token(load, request) is not None:
            # Every prompt position's KV, then the prefill leg's token: the numbers one
            # node computes, in any dtype.
            return request.num_prompt_tokens - num_local_tokens
        # No usable first token (a vLLM prefill node): the last prompt position is
        # recomputed here and its logits give the first output token, as in vLLM.
        return max(0, request.num_prompt_tokens - 1 - num_local_tokens)

    def _first_token(self, load: _Load, request: Request) -> RemoteToken | None:
        """The prefill leg's token, if this request can continue from it: a token of this
        model (the params come from clients: another is never embedded), with the logprob
        entry the request asks for."""
        token = load.remote.first_token
        if token is None or not 0 <= token.token_id < self.vocab_size:
            return None
        if request.params.grammar is not None:
            return None  # the prefill leg sampled without the grammar: sample it here

        wanted = request.params.logprobs
        if wanted is not None and (token.logprob is None or len(token.logprob.top) < wanted):
            return None
        return token

    def on_admitted(self, request: Request, block_ids: Sequence[int], num_remote: int) -> None:
        with self._lock:
            load = self._loads.get(request.request_id)
            if load is None or load.state is not LoadState.PENDING:
                return
            if num_remote == 0:  # all cached here, or not this prompt's KV: nothing to read
                del self._loads[request.request_id]
                self._renewer.discard(request.request_id)
                self._send_release(load.remote, ReleaseReason.NOT_NEEDED)
                return
            first = request.num_computed_tokens // self.block_size
            last = -(-(request.num_computed_tokens + num_remote) // self.block_size)
            load.remote_block_ids = list(load.remote.block_ids[first:last])
            load.local_block_ids = list(block_ids[first:last])
            load.next_token = self._first_token(load, request)
            load.state = LoadState.LOADING
        self._workers.submit(self._run_load, load)

    def on_request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        with self._lock:
            load = self._loads.get(request.request_id)
            if load is None:
                return False
            load.aborted = True
            if load.state is LoadState.LOADING:
                return True  # a read may still land in these blocks: hold until it ended
            del self._loads[request.request_id]
            self._renewer.discard(request.request_id)
            if load.state is LoadState.PENDING:
                load.state = LoadState.ENDED
                self._send_release(load.remote, ReleaseReason.CANCELLED)
            return False

    def on_step_finished(self, output: SchedulerOutput) -> ConnectorEvents:
        if self._ended.empty():
            return NO_EVENTS
        results, releasable = [], []
        with self._lock:
            while not self._ended.empty():
                load = self._loads.pop(self._ended.get(), None)
                if load is None:
                    continue
                if load.aborted:
                    releasable.append(load.request_id)
                elif load.result is not None:
                    results.append(load.result)
        return ConnectorEvents(tuple(results), tuple(releasable))

    def handshake_info(self) -> NodeKVInfo:
        return NodeKVInfo(self.layout, self.transport.info())

    def take_stats(self) -> KVConnectorStats:
        """Reads and claims completed since the last call, for the metrics."""
        with self._lock:
            transfers, self._transfers = self._transfers, []
            claims_s, self._claims_s = self._claims_s, []
        return KVConnectorStats(tuple(transfers), tuple(claims_s))

    # -- the load (worker threads) ----------------------------------------------------

    def _run_load(self, load: _Load) -> None:
        try:
            result = self._load(load)
        except Exception as e:  # never let a worker die silently with blocks held
            logger.exception("load of handoff %s failed unexpectedly", load.remote.ref.handoff_id)
            result = self._failure(load, f"unexpected error: {e}")
        with self._lock:
            self._end(load, result)

    def _load(self, load: _Load) -> LoadResult:
        remote, ref = load.remote, load.remote.ref
        try:
            peer = self._handshake(remote)
        except ControlError as e:
            self._send_release(remote, ReleaseReason.REJECTED)
            return self._failure(load, f"prefill node unreachable: {e}")
        mismatch = self.layout.mismatch(peer.layout)
        if mismatch is not None:
            self._send_release(remote, ReleaseReason.REJECTED)
            return LoadResult(
                load.request_id, ok=False, error=f"incompatible prefill node: {mismatch}"
            )
        if len(load.remote_block_ids) != len(load.local_block_ids):
            # Malformed params (they come from the client), not an incompatible node.
            self._send_release(remote, ReleaseReason.REJECTED)
            return self._failure(load, "remote_block_ids do not cover the prompt")
        if load.aborted:
            self._send_release(remote, ReleaseReason.CANCELLED)
            return self._failure(load, "aborted before the claim")
        self._renewer.discard(load.request_id)  # claimed or refused now: no more renewals
        claim_sent_s = time.monotonic()
        try:
            outcome, claim_timeout_s = self.control.claim(remote.control_url, ref, remote.block_ids)
        except ControlError as e:
            # Unknown whether the claim landed: never read; the prefill node frees the
            # handoff at its claim deadline or lease end (fail closed, S12).
            return self._failure(load, f"claim failed: {e}")
        if outcome is not Outcome.OK:
            if outcome is Outcome.WRONG_BLOCKS:  # the handoff is still held, for nobody
                self._send_release(remote, ReleaseReason.REJECTED)
            return self._failure(load, f"claim refused ({outcome})")
        with self._lock:
            self._claims_s.append(time.monotonic() - claim_sent_s)
        if self.seams.kv_read_delay_s:
            time.sleep(self.seams.kv_read_delay_s)
        budget_s = claim_timeout_s - CLAIM_MARGIN_S - (time.monotonic() - claim_sent_s)
        read = self._read(load, peer, budget_s)
        try:
            self.control.finish_read(remote.control_url, ref, read.ok)
        except ControlError as e:
            logger.warning("could not report the read of %s: %s", ref.handoff_id, e)
        if not read.ok:
            return self._failure(load, f"KV read failed: {read.error}")
        return LoadResult(load.request_id, ok=True, next_token=load.next_token)

    def _read(self, load: _Load, peer: Handshake, budget_s: float) -> ReadResult:
        if budget_s <= 0:
            return ReadResult(False, 0, 0.0, "no time left before the claim deadline")
        future = self.transport.read(
            peer.transport, load.remote_block_ids, load.local_block_ids, timeout_s=budget_s
        )
        result = future.result()  # completes only once the read has ended (transport contract)
        if result.ok:
            with self._lock:
                self._transfers.append((result.num_bytes, result.seconds))
        return result

    def _handshake(self, remote: RemotePrefill) -> Handshake:
        peer = self._peers.get(remote.control_url)
        if peer is None or (remote.ref.epoch is not None and peer.epoch != remote.ref.epoch):
            # New node, or it restarted: fetch again (a stale epoch is refused at claim).
            if peer is not None:
                self.transport.forget_peer(peer.transport.agent_name)
            peer = self.control.handshake(remote.control_url)
            self._peers[remote.control_url] = peer
        return peer

    def _failure(self, load: _Load, reason: str) -> LoadResult:
        logger.warning("remote KV load for %s: %s", load.request_id, reason)
        if self.fail_on_load_error:
            return LoadResult(load.request_id, ok=False, error=reason)
        return LoadResult(load.request_id, ok=False)

    def _end(self, load: _Load, result: LoadResult) -> None:
        """Under the lock: the load is over; the engine thread picks it up next step."""
        load.state, load.result = LoadState.ENDED, result
        self._renewer.discard(load.request_id)
        self._ended.put(load.request_id)

    # -- control messages ----------------------------------------------------------

    def _send_release(self, remote: RemotePrefill, reason: ReleaseReason) -> None:
        self._workers.submit(self._release, remote, reason)

    def _release(self, remote: RemotePrefill, reason: ReleaseReason) -> None:
        try:
            self.control.release(remote.control_url, remote.ref, reason)
        except ControlError as e:  # the lease frees it anyway
            logger.warning("release of %s failed: %s", remote.ref.handoff_id, e)

    def close(self) -> None:
        """Stop renewing; wait for reads and releases in flight (they are bounded by the
        claim deadline and the control timeout)."""
        self._renewer.close()
        self._workers.shutdown(wait=True)
        self.control.close()
        self.transport.close()


def kv_layout(loaded: LoadedModel, kv_cache: torch.Tensor, block_size: int) -> KVLayout:
    from pdserve.model import kv_format  # the engine process's: a node's API process has no torch

    arch = loaded.arch
    return KVLayout(
        model_fingerprint=model_fingerprint(loaded.model, repr(arch)),
        kv_cache_dtype=kv_format.name(kv_cache.dtype),
        block_size=block_size,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        block_bytes=kv_cache.stride(0) * kv_cache.element_size(),
    )


@dataclass(frozen=True)
class PDConnectorFactory:
    """A P/D node's `KVConnectorFactory`: crosses the engine process's spawn (it pickles)
    and builds the role's connector there, once the KV pool exists."""

    config: KVTransferConfig
    seams: Seams = NO_SEAMS

    def __call__(self, loaded: LoadedModel, kv_cache: torch.Tensor, block_size: int) -> KVConnector:
        kv = self.config
        name = f"pdserve-{kv.role}-{secrets.token_hex(6)}"  # new per start: never merged with a
        transport = create_transport(kv.transport, name, kv_cache)  # predecessor's metadata
        layout = kv_layout(loaded, kv_cache, block_size)
        if kv.role is Role.PREFILL:
            return PrefillConnector(transport, layout)
        return DecodeConnector(
            transport,
            ControlClient(kv.cluster_secret, kv.tls),
            layout,
            block_size,
            loaded.arch.vocab_size,
            fail_on_load_error=kv.kv_load_failure is KVLoadFailurePolicy.FAIL,
            seams=self.seams,
        )


def connector_factory(
    config: KVTransferConfig, seams: Seams = NO_SEAMS
) -> KVConnectorFactory | None:
    """What the launcher gives the engine for this node's role: None on a `both` node."""
    return None if config.role is Role.BOTH else PDConnectorFactory(config, seams)


def create_transport(
    kind: KVTransportKind | str, agent_name: str, kv_cache: torch.Tensor
) -> KVTransport:
    """`kind`: NIXL (the real data plane) or INPROCESS (the unit-test fake), or its value.
    Here, beside the connectors that use it: `transport.py` is the interface NIXL's
    transport implements, and naming that implementation there made the two a cycle."""
    if kind == KVTransportKind.NIXL:
        from pdserve.disagg.nixl_transport import NixlTransport  # NIXL only where used

        return NixlTransport(agent_name, kv_cache)
    if kind == KVTransportKind.INPROCESS:
        return InProcessTransport(agent_name, kv_cache)
    raise ValueError(f"unknown transport kind {kind!r}: expected 'nixl' or 'inprocess'")
