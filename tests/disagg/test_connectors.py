"""The P/D KV connectors, driven through a real `Scheduler` (or their hooks) on CPU.

The decode node reads from a prefill node's `InProcessTransport` into its own; the control
channel is `FakeControl`, which records every call and answers as configured. Loads run on
the connector's worker threads, so tests poll with a deadline instead of sleeping.

Block layout of a remote prefill in these tests (block size 4, prompt of 9 tokens):

    prompt tokens   [0 1 2 3][4 5 6 7][8]
    prefill blocks      9        3     12      (REMOTE_BLOCK_IDS, scattered on purpose)
    loaded              ✓        ✓     ✗       only the KV before the last prompt position
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
import torch

from pdserve.batch import SchedulerOutput
from pdserve.config import SchedulerConfig
from pdserve.disagg.connectors import DecodeConnector, PrefillConnector
from pdserve.disagg.control import ControlClient, ControlError, Handshake
from pdserve.disagg.messages import Outcome, ReleaseReason
from pdserve.disagg.params import HandoffRef, KVLayout, RemoteDecode, RemotePrefill
from pdserve.disagg.transport import InProcessTransport
from pdserve.engine.kv_types import (
    NO_EVENTS,
    ConnectorEvents,
    KVTransferSpec,
    LoadResult,
    RemoteToken,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.outputs import TokenLogprob
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 16
BLOCK_SHAPE = (2, 4, 3)
BLOCK_BYTES = 2 * 4 * 3 * 4  # float32
PREFILL_URL = "http://prefill-a:8000"
REMOTE_BLOCK_IDS = (9, 3, 12, 5, 7)
EPOCH = "epoch-1"
DEADLINE_S = 2.0
SAMPLED_TOKEN = 7
"""What `run_step` samples for every request."""
PREFILL_TOKEN = 42
"""What the prefill leg sampled, in params that carry it (`with_first_token`)."""
EOS = 2
VOCAB_SIZE = 1000
EMPTY_STEP = SchedulerOutput((), 0)
ABORTED = RequestStatus.FINISHED_ABORTED

_agent_ids = itertools.count()


# -- the fake control channel --------------------------------------------------------------


class FakeControl:
    """Stands in for `ControlClient`: records every call (from any thread) and answers with
    `handshake_reply`, `claim_outcome` and `claim_timeout_s`. A call named in `unreachable`
    raises ControlError; a call named in `paused` waits until that event is set."""

    def __init__(
        self,
        handshake_reply: Handshake,
        claim_outcome: Outcome | str = Outcome.OK,
        claim_timeout_s: float = 10.0,
        unreachable: tuple[str, ...] = (),
    ) -> None:
        self.handshake_reply = handshake_reply
        self.claim_outcome = Outcome(claim_outcome)
        self.claim_timeout_s = claim_timeout_s
        self.unreachable = set(unreachable)
        self.paused: dict[str, threading.Event] = {}
        self.closed = False
        self.claimed_block_ids: list[tuple[int, ...]] = []
        self._calls: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    def pause(self, method: str) -> threading.Event:
        """Calls of `method` block until the returned event is set."""
        self.paused[method] = threading.Event()
        return self.paused[method]

    def handshake(self, url: str) -> Handshake:
        self._record("handshake", url)
        return self.handshake_reply

    def renew(self, url: str, refs: list[HandoffRef]) -> list[Outcome]:
        self._record("renew", url, tuple(refs))
        return [Outcome.OK] * len(refs)

    def claim(self, url: str, ref: HandoffRef, block_ids: Sequence[int]) -> tuple[Outcome, float]:
        self._record("claim", url, ref)
        self.claimed_block_ids.append(tuple(block_ids))
        return self.claim_outcome, self.claim_timeout_s

    def finish_read(self, url: str, ref: HandoffRef, ok: bool) -> Outcome:
        self._record("finish_read", url, ref, ok)
        return Outcome.OK

    def release(self, url: str, ref: HandoffRef, reason: ReleaseReason) -> Outcome:
        self._record("release", url, ref, reason)
        return Outcome.OK

    def close(self) -> None:
        self.closed = True

    def calls(self, *methods: str) -> list[tuple[Any, ...]]:
        """Recorded calls of these methods (all but renewals when none is named), in order."""
        with self._lock:
            calls = list(self._calls)
        if methods:
            return [c for c in calls if c[0] in methods]
        return [c for c in calls if c[0] != "renew"]

    def renewed_refs(self) -> list[HandoffRef]:
        return [ref for call in self.calls("renew") for ref in call[2]]

    def _record(self, method: str, *args: Any) -> None:
        with self._lock:
            self._calls.append((method, *args))
        if method in self.paused:
            self.paused[method].wait(DEADLINE_S)
        if method in self.unreachable:
            raise ControlError(f"{method}: connection refused")


# -- factories -----------------------------------------------------------------------------


def make_layout(**changes: Any) -> KVLayout:
    layout = KVLayout(
        model_fingerprint="fp-tiny",
        kv_cache_dtype="float32",
        block_size=BLOCK_SIZE,
        num_layers=2,
        num_kv_heads=4,
        head_dim=3,
        block_bytes=BLOCK_BYTES,
    )
    return replace(layout, **changes)


def make_remote(
    num_tokens: int,
    handoff_id: str = "ho-1",
    block_ids: tuple[int, ...] | None = None,
    lease_s: float = 5.0,
    epoch: str = EPOCH,
    control_url: str = PREFILL_URL,
) -> RemotePrefill:
    """A prefill node's answer for a prompt of `num_tokens` held in REMOTE_BLOCK_IDS."""
    if block_ids is None:
        block_ids = REMOTE_BLOCK_IDS[: -(-num_tokens // BLOCK_SIZE)]
    return RemotePrefill(
        ref=HandoffRef(handoff_id, f"token-{handoff_id}", epoch),
        engine_id="prefill-engine",
        control_url=control_url,
        block_ids=block_ids,
        num_tokens=num_tokens,
        lease_s=lease_s,
    )


def with_first_token(
    remote: RemotePrefill, token_id: int = PREFILL_TOKEN, logprob: TokenLogprob | None = None
) -> RemotePrefill:
    """The params of a pdserve prefill leg: its sampled token rides along."""
    return replace(remote, first_token=RemoteToken(token_id, logprob))


def make_request(
    num_prompt_tokens: int,
    remote: RemotePrefill | None,
    request_id: str = "r0",
    max_tokens: int = 2,
    first_token_id: int = 100,
    **params: Any,
) -> Request:
    prompt = list(range(first_token_id, first_token_id + num_prompt_tokens))
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    return Request(request_id, prompt, sampling, eos_token_ids=(EOS,), kv_transfer=remote)


def make_scheduler(connector: DecodeConnector, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE), 64, connector)


@dataclass
class DecodeNode:
    prefill: InProcessTransport
    """The prefill node's KV: every element distinct and nonzero."""
    decode: InProcessTransport
    """This node's KV: zeros until a read lands."""
    control: FakeControl
    connector: DecodeConnector
    events: list[ConnectorEvents] = field(default_factory=list)
    """Every non-empty `on_step_finished` answer, in order."""

    def assert_loaded(self, local_ids: list[int], remote_ids: tuple[int, ...]) -> None:
        """Exactly these blocks were read: each holds its remote block, all others zero."""
        assert len(local_ids) == len(remote_ids)
        for local, remote in zip(local_ids, remote_ids, strict=True):
            assert torch.equal(self.decode.kv_cache[local], self.prefill.kv_cache[remote])
        untouched = [b for b in range(NUM_BLOCKS) if b not in local_ids]
        assert not self.decode.kv_cache[untouched].any()


@pytest.fixture
def make_node() -> Iterator[Callable[..., DecodeNode]]:
    nodes: list[DecodeNode] = []

    def make(
        layout: KVLayout | None = None, fail_on_load_error: bool = False, **control: Any
    ) -> DecodeNode:
        n = next(_agent_ids)
        owner_kv = torch.arange(1, NUM_BLOCKS * BLOCK_BYTES // 4 + 1, dtype=torch.float32)
        prefill = InProcessTransport(f"prefill-{n}", owner_kv.view(NUM_BLOCKS, *BLOCK_SHAPE))
        decode = InProcessTransport(f"decode-{n}", torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE))
        handshake = Handshake("prefill-engine", EPOCH, layout or make_layout(), prefill.info())
        fake = FakeControl(handshake, **control)
        connector = DecodeConnector(
            decode,
            cast(ControlClient, fake),
            make_layout(),
            BLOCK_SIZE,
            VOCAB_SIZE,
            fail_on_load_error=fail_on_load_error,
        )
        node = DecodeNode(prefill, decode, fake, connector)
        on_step_finished = connector.on_step_finished

        def tap(output: Any) -> ConnectorEvents:
            events = on_step_finished(output)
            if events != NO_EVENTS:
                node.events.append(events)
            return events

        connector.on_step_finished = tap  # type: ignore[method-assign]
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.connector.close()
        node.prefill.close()


# -- helpers -------------------------------------------------------------------------------


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.002)


def wait_load_ended(scheduler: Scheduler, request: Request) -> list[Request]:
    """Tick until the request leaves `loading`; returns the requests that failed."""
    failed: list[Request] = []
    deadline = time.monotonic() + DEADLINE_S
    while request.request_id in scheduler.loading:
        assert time.monotonic() < deadline, f"load of {request.request_id} never ended"
        failed += scheduler.tick()
        time.sleep(0.002)
    return failed


def wait_events(node: DecodeNode) -> ConnectorEvents:
    """The connector's next non-empty `on_step_finished` answer."""
    deadline = time.monotonic() + DEADLINE_S
    while (events := node.connector.on_step_finished(EMPTY_STEP)) == NO_EVENTS:
        assert time.monotonic() < deadline, "the connector reported nothing"
        time.sleep(0.002)
    return events


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, [SAMPLED_TOKEN if s.samples else None for s in out.scheduled])
    return out


def run_until_done(scheduler: Scheduler, max_steps: int = 100) -> list[SchedulerOutput]:
    outputs: list[SchedulerOutput] = []
    while scheduler.has_unfinished():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(run_step(scheduler))
    return outputs


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, context tokens, new tokens) of each scheduled entry."""
    return [(s.request.request_id, s.num_context_tokens, s.num_new_tokens) for s in out.scheduled]


def admit_for_load(scheduler: Scheduler, request: Request) -> list[int]:
    """Queue the request (unless queued already) and admit it for a load; returns its blocks."""
    if request.request_id not in scheduler.requests:
        scheduler.add_request(request)
    # Only schedule(): the step's end would already apply a load that ended quickly.
    assert scheduler.schedule().is_empty  # blocks for the load, but nothing to compute yet
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    return scheduler.kv.block_ids(request.request_id)


def assert_idle(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished()
    assert scheduler.held == set()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def remote_of(request: Request) -> RemotePrefill:
    assert isinstance(request.kv_transfer, RemotePrefill)
    return request.kv_transfer


# -- decode node: a load that works --------------------------------------------------------


def test_load_renews_while_pending_then_claims_reads_and_runs_from_the_last_position(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    node.decode.delay_s = 0.15  # a read long enough for a few renewal periods
    scheduler = make_scheduler(node.connector)
    request = make_request(9, make_remote(9, lease_s=0.2), max_tokens=2)
    ref = remote_of(request).ref
    scheduler.add_request(request)

    # Pending (not yet scheduled): the lease is renewed, every lease/4 (0.05 s) once under way.
    wait_until(lambda: node.control.renewed_refs().count(ref) >= 2, "two lease renewals")
    assert set(node.control.calls("renew")) == {("renew", PREFILL_URL, (ref,))}
    assert node.control.calls() == []  # nothing else before admission

    local = admit_for_load(scheduler, request)
    assert len(local) == 2  # 8 tokens to load: blocks [0, ceil(8 / 4))
    assert wait_load_ended(scheduler, request) == []
    assert node.events == [ConnectorEvents((LoadResult(request.request_id, ok=True),))]
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("claim", PREFILL_URL, ref),
        ("finish_read", PREFILL_URL, ref, True),
    ]
    node.assert_loaded(local, REMOTE_BLOCK_IDS[:2])  # the third remote block is not read
    assert node.control.claimed_block_ids == [REMOTE_BLOCK_IDS[:3]]  # the handoff's, all
    # A claimed handoff is not renewed (one renewal may have been under way at the claim).
    methods = [c[0] for c in node.control.calls("renew", "claim", "finish_read")]
    assert methods[methods.index("claim") :].count("renew") <= 1
    [(num_bytes, seconds)] = node.connector.take_stats().transfers
    assert num_bytes == 2 * BLOCK_BYTES and seconds >= 0
    assert node.connector.take_stats().transfers == ()

    assert request.status is RequestStatus.RUNNING
    assert request.num_computed_tokens == 8
    assert shape(run_step(scheduler)) == [("r0", 8, 1)]  # the last prompt position only
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [SAMPLED_TOKEN] * 2
    assert_idle(scheduler)


def test_a_load_with_the_prefill_leg_s_token_reads_every_position_and_continues_from_it(
    make_node: Callable[..., DecodeNode],
) -> None:
    """Design §8: the decode node recomputes no prompt position (another kernel shape than
    the prefill's, which rounds differently in bf16); it decodes on from the prefill leg's
    token, over KV computed once."""
    node = make_node()
    scheduler = make_scheduler(node.connector)
    request = make_request(9, with_first_token(make_remote(9)), max_tokens=3)

    local = admit_for_load(scheduler, request)
    assert len(local) == 3  # 9 tokens: blocks [0, ceil(9 / 4)), the partial last one too
    assert wait_load_ended(scheduler, request) == [request]  # an output: its first token
    node.assert_loaded(local, REMOTE_BLOCK_IDS[:3])
    assert request.output_token_ids == [PREFILL_TOKEN]
    assert request.num_computed_tokens == 9
    assert request.first_token_time is not None

    assert shape(run_step(scheduler)) == [("r0", 9, 1)]  # decodes the prefill leg's token
    run_until_done(scheduler)
    assert request.output_token_ids == [PREFILL_TOKEN, SAMPLED_TOKEN, SAMPLED_TOKEN]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_idle(scheduler)


@pytest.mark.parametrize(
    ("first_token", "params", "status"),
    [
        (PREFILL_TOKEN, {"max_tokens": 1}, RequestStatus.FINISHED_LENGTH),
        (EOS, {}, RequestStatus.FINISHED_STOPPED),
        (PREFILL_TOKEN, {"stop_token_ids": [PREFILL_TOKEN]}, RequestStatus.FINISHED_STOPPED),
    ],
)
def test_a_prefill_leg_s_token_that_ends_the_request_ends_it_without_a_step(
    make_node: Callable[..., DecodeNode],
    first_token: int,
    params: dict[str, Any],
    status: RequestStatus,
) -> None:
    """S18 on the decode side: the stop conditions apply to the remote token as to one
    sampled here."""
    node = make_node()
    scheduler = make_scheduler(node.connector)
    request = make_request(9, with_first_token(make_remote(9), first_token), **params)
    admit_for_load(scheduler, request)
    assert wait_load_ended(scheduler, request) == [request]
    assert request.status is status
    assert request.output_token_ids == [first_token]
    assert_idle(scheduler)


def test_the_prefill_leg_s_logprob_entry_becomes_the_first_one(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    entry = TokenLogprob(PREFILL_TOKEN, -0.25, [(PREFILL_TOKEN, -0.25), (5, -1.5)])
    remote = with_first_token(make_remote(9), logprob=entry)
    request = make_request(9, remote, logprobs=2)
    admit_for_load(scheduler, request)
    wait_load_ended(scheduler, request)
    assert request.logprobs == [entry]


@pytest.mark.parametrize(
    ("token", "logprob", "params"),
    [
        (VOCAB_SIZE, None, {}),  # not a token of this model (params come from clients)
        (PREFILL_TOKEN, None, {"logprobs": 1}),  # no entry for a request that wants one
        (
            PREFILL_TOKEN,
            TokenLogprob(PREFILL_TOKEN, -0.1, [(PREFILL_TOKEN, -0.1)]),
            {"logprobs": 3},
        ),
    ],
)
def test_a_first_token_the_request_cannot_use_falls_back_to_recomputing_the_last_position(
    make_node: Callable[..., DecodeNode],
    token: int,
    logprob: TokenLogprob | None,
    params: dict[str, Any],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    request = make_request(9, with_first_token(make_remote(9), token, logprob), **params)
    assert len(admit_for_load(scheduler, request)) == 2  # the last block is not read
    assert wait_load_ended(scheduler, request) == []
    assert shape(run_step(scheduler)) == [("r0", 8, 1)]
    assert request.output_token_ids == [SAMPLED_TOKEN]


def test_a_new_pending_load_is_renewed_before_its_lease_ends(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    time.sleep(0.05)  # the renew thread has looked once and found nothing pending
    scheduler = make_scheduler(node.connector)
    lease_s = 0.3
    request = make_request(9, make_remote(9, lease_s=lease_s))
    scheduler.add_request(request)  # waits in the queue (never scheduled here)
    wait_until(lambda: node.control.renewed_refs(), "renewal within the lease", lease_s)


def test_only_the_blocks_missing_from_the_local_prefix_cache_are_read(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    warm = make_request(5, None, request_id="warm", max_tokens=1)  # caches block 0
    scheduler.add_request(warm)
    run_until_done(scheduler)
    request = make_request(13, make_remote(13))  # needs blocks [0, 3); block 0 is cached here

    local = admit_for_load(scheduler, request)
    assert request.num_computed_tokens == 4
    assert wait_load_ended(scheduler, request) == []
    assert request.num_computed_tokens == 12
    node.assert_loaded(local[1:3], REMOTE_BLOCK_IDS[1:3])  # local[0] stays as cached (zeros)
    assert shape(run_step(scheduler)) == [("r0", 12, 1)]


# -- decode node: nothing to load ----------------------------------------------------------


def assert_released_only(node: DecodeNode, remote: RemotePrefill, reason: str) -> None:
    wait_until(lambda: node.control.calls("release"), "release")
    assert node.control.calls() == [("release", PREFILL_URL, remote.ref, reason)]


def test_a_one_token_prompt_loads_nothing_and_releases_the_handoff(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    request = make_request(1, make_remote(1))
    scheduler.add_request(request)

    assert shape(run_step(scheduler)) == [("r0", 0, 1)]
    assert_released_only(node, remote_of(request), "not_needed")
    run_until_done(scheduler)
    assert not node.decode.kv_cache.any()
    assert node.events == []
    assert_idle(scheduler)


def test_a_prompt_cached_locally_up_to_its_last_position_loads_nothing(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    scheduler.add_request(make_request(9, None, request_id="warm", max_tokens=1))
    run_until_done(scheduler)  # blocks 0 and 1 (tokens 0..7) are now in the prefix cache
    request = make_request(9, make_remote(9))

    scheduler.add_request(request)
    assert shape(run_step(scheduler)) == [("r0", 8, 1)]
    assert_released_only(node, remote_of(request), "not_needed")
    assert not node.decode.kv_cache.any()
    run_until_done(scheduler)
    assert_idle(scheduler)


def test_params_for_another_prompt_are_released_and_the_prompt_recomputed(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    remote = make_remote(10)  # the prefill leg saw a 10-token prompt
    request = make_request(9, remote)
    scheduler.add_request(request)

    assert shape(run_step(scheduler)) == [("r0", 0, 9)]
    assert_released_only(node, remote, "not_needed")
    run_until_done(scheduler)
    assert not node.decode.kv_cache.any()
    assert node.events == []
    assert_idle(scheduler)


# -- decode node: aborts -------------------------------------------------------------------


def test_abort_while_pending_releases_the_handoff_and_holds_nothing(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    request = make_request(9, make_remote(9))
    node.connector.on_request_added(request)

    request.status = ABORTED
    assert node.connector.on_request_finished(request, []) is False
    assert_released_only(node, remote_of(request), "cancelled")
    assert node.connector.get_num_remote_tokens(request, 0) == 0
    assert node.connector.on_step_finished(EMPTY_STEP) == NO_EVENTS


def test_abort_while_reading_holds_the_blocks_until_the_read_ended(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    node.decode.delay_s = 0.15
    scheduler = make_scheduler(node.connector)
    request = make_request(9, make_remote(9))
    ref = remote_of(request).ref
    local = admit_for_load(scheduler, request)
    wait_until(lambda: node.control.calls("claim"), "claim")

    scheduler.finish_requests([request.request_id], ABORTED)
    assert node.control.calls("finish_read") == []  # the read is still in flight
    assert scheduler.held == {request.request_id}
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS - 2

    wait_until(lambda: not scheduler.tick() and not scheduler.held, "release of the blocks")
    assert node.events == [ConnectorEvents(releasable=(request.request_id,))]
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("claim", PREFILL_URL, ref),
        ("finish_read", PREFILL_URL, ref, True),
    ]
    node.assert_loaded(local, REMOTE_BLOCK_IDS[:2])  # it landed, into blocks still held
    assert request.status is ABORTED
    assert_idle(scheduler)


def test_abort_before_the_claim_releases_instead_of_claiming(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    handshake_done = node.control.pause("handshake")
    request = make_request(9, make_remote(9))
    connector = node.connector
    connector.on_request_added(request)
    assert connector.get_num_remote_tokens(request, 0) == 8
    connector.on_admitted(request, [0, 1], 8)
    wait_until(lambda: node.control.calls("handshake"), "handshake")

    request.status = ABORTED
    assert connector.on_request_finished(request, [0, 1]) is True  # loading: held
    handshake_done.set()
    assert wait_events(node) == ConnectorEvents(releasable=(request.request_id,))
    wait_until(lambda: node.control.calls("release"), "release")
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("release", PREFILL_URL, remote_of(request).ref, "cancelled"),
    ]
    assert not node.decode.kv_cache.any()


# -- decode node: loads that fail ----------------------------------------------------------


def run_failing_load(node: DecodeNode) -> tuple[Scheduler, Request, list[Request]]:
    """Admit a 9-token request for a load and tick until it ended; returns what failed."""
    scheduler = make_scheduler(node.connector)
    request = make_request(9, make_remote(9))
    admit_for_load(scheduler, request)
    return scheduler, request, wait_load_ended(scheduler, request)


def assert_recomputes(node: DecodeNode, scheduler: Scheduler, request: Request) -> None:
    """The load failed under policy `recompute`: the whole prompt runs here."""
    assert node.events == [ConnectorEvents((LoadResult(request.request_id, ok=False),))]
    assert request.status is RequestStatus.RUNNING
    assert request.num_computed_tokens == 0
    assert shape(run_step(scheduler)) == [("r0", 0, 9)]
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_idle(scheduler)


def assert_fails(node: DecodeNode, scheduler: Scheduler, request: Request, error: str) -> None:
    assert node.events == [ConnectorEvents((LoadResult(request.request_id, False, error),))]
    assert request.status is RequestStatus.FINISHED_ERROR
    assert request.error == error
    assert_idle(scheduler)


@pytest.mark.parametrize("outcome", ["already_released", "stale_epoch", "unknown", "wrong_state"])
def test_a_refused_claim_reads_nothing_and_recomputes(
    make_node: Callable[..., DecodeNode], outcome: str
) -> None:
    node = make_node(claim_outcome=outcome)
    scheduler, request, failed = run_failing_load(node)

    assert failed == []
    ref = remote_of(request).ref
    assert node.control.calls() == [("handshake", PREFILL_URL), ("claim", PREFILL_URL, ref)]
    assert not node.decode.kv_cache.any()
    assert_recomputes(node, scheduler, request)


def test_a_claim_refused_for_other_blocks_releases_the_handoff_and_recomputes(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node(claim_outcome="wrong_blocks")
    scheduler, request, failed = run_failing_load(node)

    assert failed == []
    wait_until(lambda: node.control.calls("release"), "release")
    ref = remote_of(request).ref
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("claim", PREFILL_URL, ref),
        ("release", PREFILL_URL, ref, "rejected"),
    ]
    assert node.control.claimed_block_ids == [remote_of(request).block_ids]
    assert not node.decode.kv_cache.any()
    assert_recomputes(node, scheduler, request)


def test_a_refused_claim_fails_the_request_under_policy_fail(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node(claim_outcome="already_released", fail_on_load_error=True)
    scheduler, request, failed = run_failing_load(node)

    assert failed == [request]
    assert not node.decode.kv_cache.any()
    assert_fails(node, scheduler, request, "claim refused (already_released)")


@pytest.mark.parametrize("fail_on_load_error", [False, True])
def test_an_unanswered_claim_never_reads(
    make_node: Callable[..., DecodeNode], fail_on_load_error: bool
) -> None:
    node = make_node(unreachable=("claim",), fail_on_load_error=fail_on_load_error)
    scheduler, request, failed = run_failing_load(node)

    # Whether the claim landed is unknown: no read, no release (the prefill node's
    # deadlines free the handoff).
    ref = remote_of(request).ref
    assert node.control.calls() == [("handshake", PREFILL_URL), ("claim", PREFILL_URL, ref)]
    assert not node.decode.kv_cache.any()
    if fail_on_load_error:
        assert failed == [request]
        assert_fails(node, scheduler, request, "claim failed: claim: connection refused")
    else:
        assert failed == []
        assert_recomputes(node, scheduler, request)


def test_an_unreachable_prefill_node_is_released_and_the_prompt_recomputed(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node(unreachable=("handshake",))
    scheduler, request, failed = run_failing_load(node)

    assert failed == []
    wait_until(lambda: node.control.calls("release"), "release")
    ref = remote_of(request).ref
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("release", PREFILL_URL, ref, "rejected"),
    ]
    assert_recomputes(node, scheduler, request)


@pytest.mark.parametrize("fail_on_load_error", [False, True])
def test_params_whose_blocks_do_not_cover_the_prompt_are_not_read(
    make_node: Callable[..., DecodeNode], fail_on_load_error: bool
) -> None:
    """Malformed params (a client writes them), not an incompatible node: the load fails
    under the node's policy, as a refused claim does (it was a 502 whatever the policy)."""
    node = make_node(fail_on_load_error=fail_on_load_error)
    scheduler = make_scheduler(node.connector)
    remote = make_remote(9, block_ids=REMOTE_BLOCK_IDS[:1])  # 8 tokens need 2 blocks
    request = make_request(9, remote)
    admit_for_load(scheduler, request)

    failed = wait_load_ended(scheduler, request)
    if fail_on_load_error:
        assert failed == [request]
        assert_fails(node, scheduler, request, "remote_block_ids do not cover the prompt")
    else:
        assert failed == []
        assert_recomputes(node, scheduler, request)
    wait_until(lambda: node.control.calls("release"), "release")
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("release", PREFILL_URL, remote.ref, "rejected"),
    ]
    assert not node.decode.kv_cache.any()


@pytest.mark.parametrize(
    ("name", "theirs"),
    [("block_size", 8), ("model_fingerprint", "fp-other"), ("kv_cache_dtype", "int8")],
)
def test_an_incompatible_prefill_node_fails_the_request_whatever_the_policy(
    make_node: Callable[..., DecodeNode], name: str, theirs: object
) -> None:
    node = make_node(layout=make_layout(**{name: theirs}))  # policy: recompute
    scheduler, request, failed = run_failing_load(node)

    assert failed == [request]
    mine = getattr(make_layout(), name)
    error = f"incompatible prefill node: {name} differs (this node: {mine}, prefill node: {theirs})"
    assert_fails(node, scheduler, request, error)
    wait_until(lambda: node.control.calls("release"), "release")
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("release", PREFILL_URL, remote_of(request).ref, "rejected"),
    ]
    assert not node.decode.kv_cache.any()


@pytest.mark.parametrize("fail_on_load_error", [False, True])
def test_a_failed_read_is_reported_and_the_prompt_recomputed_or_failed(
    make_node: Callable[..., DecodeNode], fail_on_load_error: bool
) -> None:
    node = make_node(fail_on_load_error=fail_on_load_error)
    node.decode.fail_next_reads = 1
    scheduler, request, failed = run_failing_load(node)

    ref = remote_of(request).ref
    assert node.control.calls() == [
        ("handshake", PREFILL_URL),
        ("claim", PREFILL_URL, ref),
        ("finish_read", PREFILL_URL, ref, False),
    ]
    assert not node.decode.kv_cache.any()
    assert node.connector.take_stats().transfers == ()
    if fail_on_load_error:
        assert failed == [request]
        assert_fails(node, scheduler, request, "KV read failed: injected failure")
    else:
        assert failed == []
        assert_recomputes(node, scheduler, request)


def test_no_read_starts_within_the_margin_before_the_claim_deadline(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node(claim_timeout_s=0.9)  # less than CLAIM_MARGIN_S: no time to read
    scheduler, request, failed = run_failing_load(node)

    assert failed == []
    ref = remote_of(request).ref
    assert node.control.calls()[-1] == ("finish_read", PREFILL_URL, ref, False)
    assert not node.decode.kv_cache.any()
    assert_recomputes(node, scheduler, request)


def test_a_read_that_ends_past_its_budget_is_not_trusted(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node(claim_timeout_s=1.05)  # 0.05 s left after the margin
    node.decode.delay_s = 0.15
    scheduler, request, failed = run_failing_load(node)

    assert failed == []
    ref = remote_of(request).ref
    assert node.control.calls()[-1] == ("finish_read", PREFILL_URL, ref, False)
    assert_recomputes(node, scheduler, request)


# -- decode node: at most one load per request, peers ---------------------------------------


def test_a_request_preempted_after_its_load_recomputes_instead_of_loading_again(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector, num_blocks=5)
    other = make_request(7, None, request_id="other", max_tokens=10, first_token_id=200)
    scheduler.add_request(other)
    run_step(scheduler)
    request = make_request(9, make_remote(9), max_tokens=2)
    scheduler.add_request(request)
    assert shape(run_step(scheduler)) == [("other", 7, 1)]  # r0 admitted for its load
    assert wait_load_ended(scheduler, request) == []
    assert request.num_computed_tokens == 8

    out = run_step(scheduler)  # both need a third block; one is left
    assert out.preempted_ids == ("r0",)
    assert node.connector.get_num_remote_tokens(request, 0) == 0
    runs: list[tuple[int, int]] = []
    while scheduler.has_unfinished():
        assert len(runs) < 100, "scheduler made no progress"
        out = run_step(scheduler)
        assert request.status is not RequestStatus.WAITING_FOR_REMOTE_KV
        runs += [
            (s.num_context_tokens, s.num_new_tokens) for s in out.scheduled if s.request is request
        ]
    # Recomputed locally: its loaded blocks were freed, the full one stayed a prefix hit.
    assert runs == [(4, 5), (9, 1)]
    assert len(node.control.calls("claim")) == 1
    assert node.control.calls("release") == []
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_idle(scheduler)


def test_the_handshake_is_cached_per_node_until_its_epoch_changes(
    make_node: Callable[..., DecodeNode],
) -> None:
    node = make_node()
    scheduler = make_scheduler(node.connector)
    for i, epoch in enumerate([EPOCH, EPOCH, "epoch-2"]):
        if epoch != EPOCH:  # the prefill node restarted
            node.control.handshake_reply = replace(node.control.handshake_reply, epoch=epoch)
        remote = make_remote(9, f"ho-{i}", epoch=epoch)
        request = make_request(9, remote, request_id=f"r{i}", first_token_id=100 + 20 * i)
        admit_for_load(scheduler, request)
        assert wait_load_ended(scheduler, request) == []
        run_until_done(scheduler)

    assert len(node.control.calls("handshake")) == 2
    assert node.decode.forgotten_peers == [node.prefill.agent_name]
    assert [e.loads_finished[0].ok for e in node.events] == [True, True, True]


# -- decode node: close ------------------------------------------------------------------


def test_close_returns_promptly_and_stops_the_connector_threads(
    make_node: Callable[..., DecodeNode],
) -> None:
    before = set(threading.enumerate())
    node = make_node()
    scheduler = make_scheduler(node.connector)
    request = make_request(9, make_remote(9, "ho-done"), request_id="done")
    admit_for_load(scheduler, request)
    assert wait_load_ended(scheduler, request) == []  # a load worker exists now
    scheduler.add_request(make_request(9, make_remote(9, "ho-pending"), request_id="pending"))

    start_s = time.monotonic()
    node.connector.close()
    assert time.monotonic() - start_s < 0.5
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    assert node.control.closed


def test_close_waits_for_a_read_in_flight(make_node: Callable[..., DecodeNode]) -> None:
    node = make_node()
    node.decode.delay_s = 0.1
    scheduler = make_scheduler(node.connector)
    request = make_request(9, make_remote(9))
    local = admit_for_load(scheduler, request)
    wait_until(lambda: node.control.calls("claim"), "claim")

    node.connector.close()
    ref = remote_of(request).ref
    assert node.control.calls()[-1] == ("finish_read", PREFILL_URL, ref, True)
    node.assert_loaded(local, REMOTE_BLOCK_IDS[:2])
    result = node.decode.read(node.prefill.info(), [0], [0], timeout_s=1.0).result(timeout=1)
    assert (result.ok, result.error) == (False, "transport is closed")


# -- prefill node --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_transfer", "status", "block_ids", "held"),
    [
        (RemoteDecode(), RequestStatus.FINISHED_STOPPED, [3, 4], True),
        (RemoteDecode(), RequestStatus.FINISHED_LENGTH, [3], True),
        (RemoteDecode(), RequestStatus.FINISHED_ABORTED, [3, 4], False),
        (RemoteDecode(), RequestStatus.FINISHED_ERROR, [3, 4], False),
        (RemoteDecode(), RequestStatus.FINISHED_LENGTH, [], False),
        (None, RequestStatus.FINISHED_LENGTH, [3, 4], False),
        (make_remote(9), RequestStatus.FINISHED_LENGTH, [3, 4], False),
    ],
)
def test_prefill_connector_holds_only_normally_finished_prefill_legs(
    kv_transfer: KVTransferSpec | None, status: RequestStatus, block_ids: list[int], held: bool
) -> None:
    class Recording(InProcessTransport):
        serving: ClassVar[list[bool]] = []

        def set_serving(self, serving: bool) -> None:
            self.serving.append(serving)

    name = f"prefill-{next(_agent_ids)}"
    transport = Recording(name, torch.zeros(4, 2))
    connector = PrefillConnector(transport, make_layout())
    request = Request("p0", [1, 2, 3], SamplingParams(max_tokens=1), kv_transfer=kv_transfer)
    request.status = status
    try:
        assert connector.on_request_finished(request, block_ids) is held
        # The transport is told to stay prompt while decode nodes may read held blocks.
        assert transport.serving == ([True] if held else [])
        assert list(connector.on_free_held(["p0", "p1"])) == ["p0", "p1"]
        assert transport.serving[-1] is False
    finally:
        connector.close()
    InProcessTransport(name, torch.zeros(4, 2)).close()  # the name is free: it was closed


TINY_LLAMA_CONFIG = (
    '{"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, '
    '"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
    '"num_key_value_heads": 2, "max_position_embeddings": 128, "eos_token_id": 2}'
)


def test_engine_holds_a_finished_prefill_leg_until_it_is_freed(tmp_path: Path) -> None:
    from pdserve.disagg.config import KVTransferConfig, KVTransportKind, Role
    from pdserve.disagg.connectors import connector_factory
    from pdserve.engine.engine import LLMEngine
    from pdserve.llm import engine_config

    (tmp_path / "config.json").write_text(TINY_LLAMA_CONFIG)
    config = engine_config(
        model=str(tmp_path),
        load_format="dummy",
        dtype="float32",
        device="cpu",
        num_blocks=32,
        block_size=4,
    )
    kv = KVTransferConfig(role=Role.PREFILL, transport=KVTransportKind.INPROCESS)
    engine = LLMEngine(config, connector_factory(kv))
    try:
        assert isinstance(engine.connector, PrefillConnector)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        held_leg = engine.add_request(list(range(3, 12)), params, "leg", RemoteDecode())
        aborted_leg = engine.add_request(list(range(3, 12)), params, "cut", RemoteDecode())
        engine.abort([aborted_leg])
        outputs = [out for _ in range(3) for out in engine.step() if out.finished]

        [output] = outputs
        assert output.request_id == held_leg
        assert len(output.held_block_ids) == 3  # 9 prompt tokens in blocks of 4
        [internal_id] = engine.scheduler.held
        assert internal_id.startswith(f"{held_leg}#")
        assert engine.kv.num_free_blocks == engine.kv.num_blocks - 3

        engine.abort([held_leg])  # finished: an abort does not touch its held blocks
        assert engine.scheduler.held == {internal_id}
        assert engine.free_held([held_leg]) == [held_leg]
        assert engine.scheduler.held == set()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        engine.close()
