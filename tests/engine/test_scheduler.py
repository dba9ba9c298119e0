"""Scheduler, driven without a model: each step samples a fixed token for entries that sample."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from pdserve.batch import SchedulerOutput
from pdserve.config import SchedulerConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.kv_types import ConnectorEvents, LoadResult
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import ConfigError
from pdserve.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.outputs import RequestTimes
from pdserve.sampling_params import SamplingParams

SAMPLED_TOKEN = 7
ABORTED = RequestStatus.FINISHED_ABORTED


def make_request(
    num_prompt_tokens: int,
    max_tokens: int | None = 4,
    request_id: str = "r0",
    first_token_id: int = 100,
    eos_token_ids: tuple[int, ...] = (),
    **params: object,
) -> Request:
    prompt = list(range(first_token_id, first_token_id + num_prompt_tokens))
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=eos_token_ids,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    connector: KVConnector | None = None,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    clock: Callable[[], float] | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    if clock is None:
        return Scheduler(config, kv, max_model_len, connector)
    return Scheduler(config, kv, max_model_len, connector, clock)


def run_step(scheduler: Scheduler, token: int = SAMPLED_TOKEN) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = [token if s.samples else None for s in out.scheduled]
    scheduler.update_from_output(out, sampled)
    return out


def run_until_done(scheduler: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(run_step(scheduler))
    return outputs


def scheduled_ids(out: SchedulerOutput) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def assert_idle(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished()
    assert scheduler.requests == {}
    assert scheduler.held == set()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.schedule().is_empty


# -- batching ------------------------------------------------------------------------------


def test_single_request_prefills_then_decodes_until_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request(6, max_tokens=3)
    scheduler.add_request(request)

    outputs = run_until_done(scheduler)
    assert [s.num_new_tokens for out in outputs for s in out.scheduled] == [6, 1, 1]
    assert [s.num_context_tokens for out in outputs for s in out.scheduled] == [0, 6, 7]
    assert request.output_token_ids == [SAMPLED_TOKEN] * 3
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert_idle(scheduler)


def test_new_request_joins_while_others_decode() -> None:
    scheduler = make_scheduler()
    a = make_request(4, max_tokens=10, request_id="a")
    scheduler.add_request(a)
    run_step(scheduler)
    run_step(scheduler)
    assert a.num_output_tokens == 2

    b = make_request(5, max_tokens=2, request_id="b", first_token_id=200)
    scheduler.add_request(b)
    out = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]
    assert out.num_decodes == 1
    assert a.num_output_tokens == 3
    assert b.num_output_tokens == 1

    run_until_done(scheduler)
    assert a.num_output_tokens == 10
    assert b.num_output_tokens == 2
    assert_idle(scheduler)


def test_token_budget_is_respected_every_step() -> None:
    budget = 10
    scheduler = make_scheduler(max_num_batched_tokens=budget)
    requests = [
        make_request(8, max_tokens=5, request_id=f"r{i}", first_token_id=100 * i) for i in range(4)
    ]
    for r in requests:
        scheduler.add_request(r)

    outputs = run_until_done(scheduler)
    assert all(out.num_tokens <= budget for out in outputs)
    assert outputs[0].num_tokens == budget  # r0 whole, r1 chunked into the rest
    assert [(s.request.request_id, s.num_new_tokens) for s in outputs[0].scheduled] == [
        ("r0", 8),
        ("r1", 2),
    ]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_output_tokens == 5 for r in requests)
    assert_idle(scheduler)


def test_chunked_prefill_splits_a_long_prompt_and_only_the_last_chunk_samples() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request(10, max_tokens=1)
    scheduler.add_request(request)

    chunks, samples = [], []
    for _ in range(3):
        out = scheduler.schedule()
        (entry,) = out.scheduled
        chunks.append(entry)
        samples.append(entry.samples)
        scheduler.update_from_output(out, [SAMPLED_TOKEN if entry.samples else None])
    assert [c.num_new_tokens for c in chunks] == [4, 4, 2]
    assert [c.num_context_tokens for c in chunks] == [0, 4, 8]
    assert samples == [False, False, True]
    assert request.output_token_ids == [SAMPLED_TOKEN]
    assert_idle(scheduler)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=8
    )
    a = make_request(6, max_tokens=3, request_id="a")
    b = make_request(5, max_tokens=1, request_id="b", first_token_id=200)
    scheduler.add_request(a)
    scheduler.add_request(b)

    out = run_step(scheduler)
    assert scheduled_ids(out) == ["a"]  # b (5 tokens) does not fit in the 2 left
    out = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]
    run_until_done(scheduler)
    assert_idle(scheduler)


def test_without_chunked_prefill_a_budget_below_the_context_is_refused_at_start() -> None:
    # Otherwise a prompt longer than the budget would wait forever.
    with pytest.raises(ConfigError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=64)


def test_decodes_come_first_in_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=12)
    arrivals = {0: 9, 1: 3, 3: 14, 4: 2}  # step -> prompt length
    outputs = []
    for step in range(40):
        if step in arrivals:
            scheduler.add_request(
                make_request(
                    arrivals[step], max_tokens=6, request_id=f"r{step}", first_token_id=100 * step
                )
            )
        outputs.append(run_step(scheduler))
    assert not scheduler.has_unfinished()
    mixed = [out for out in outputs if 0 < out.num_decodes < len(out.scheduled)]
    assert mixed, "the workload should mix decodes and prefill chunks in one step"
    for out in outputs:
        sizes = [s.num_new_tokens for s in out.scheduled]
        assert out.num_decodes == sizes.count(1)
        assert all(n == 1 for n in sizes[: out.num_decodes])
        assert all(n > 1 for n in sizes[out.num_decodes :])


def test_max_num_seqs_is_respected() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [
        make_request(3, max_tokens=3, request_id=f"r{i}", first_token_id=100 * i) for i in range(5)
    ]
    for r in requests:
        scheduler.add_request(r)

    outputs = run_until_done(scheduler)
    assert all(len(out.scheduled) <= 2 for out in outputs)
    assert scheduled_ids(outputs[0]) == ["r0", "r1"]
    assert all(r.num_output_tokens == 3 for r in requests)
    assert_idle(scheduler)


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request(3, request_id="a"))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request(3, request_id="a"))


# -- preemption ------------------------------------------------------------------------------


def make_two_request_squeeze() -> tuple[Scheduler, Request, Request]:
    """Two 6-token prompts growing to 14 tokens in a pool that fits 16 tokens in all."""
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a = make_request(6, max_tokens=8, request_id="a", first_token_id=100)
    b = make_request(6, max_tokens=8, request_id="b", first_token_id=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    return scheduler, a, b


def run_until_preemption(scheduler: Scheduler, max_steps: int = 20) -> SchedulerOutput:
    for _ in range(max_steps):
        out = run_step(scheduler)
        if out.preempted_ids:
            return out
    raise AssertionError("no preemption happened")


def test_newest_running_request_is_preempted_when_blocks_run_out() -> None:
    scheduler, a, b = make_two_request_squeeze()
    out = run_until_preemption(scheduler)

    assert out.preempted_ids == ("b",)
    assert scheduled_ids(out) == ["a"]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert a.num_preemptions == 0
    assert scheduler.waiting[0] is b
    assert not scheduler.kv.holds("b")
    assert scheduler.num_preemptions == 1


def test_preempted_request_is_readmitted_and_both_finish() -> None:
    scheduler, a, b = make_two_request_squeeze()
    run_until_preemption(scheduler)
    num_output_tokens_before = b.num_output_tokens

    statuses = []
    for _ in range(50):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
        statuses.append(b.status)
    assert RequestStatus.RUNNING in statuses  # re-admitted after the preemption

    assert b.num_output_tokens > num_output_tokens_before
    for r in (a, b):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [SAMPLED_TOKEN] * 8
    assert_idle(scheduler)


def test_preempted_request_goes_back_ahead_of_later_arrivals() -> None:
    scheduler, _, b = make_two_request_squeeze()
    run_until_preemption(scheduler)
    c = make_request(3, max_tokens=1, request_id="c", first_token_id=300)
    scheduler.add_request(c)
    assert list(scheduler.waiting) == [b, c]

    admitted = []
    while scheduler.has_unfinished():
        out = run_step(scheduler)
        admitted += [s.request.request_id for s in out.scheduled if s.num_context_tokens == 0]
    assert admitted.index("b") < admitted.index("c")
    assert_idle(scheduler)


def test_a_prompt_starts_only_when_all_of_it_fits() -> None:
    """Chunked prefill must not start a prompt the pool cannot hold whole while others
    run: it would be preempted by their growth and computed again from the start, over
    and over. Here `b` (40 tokens, 10 blocks) waits until `a` is done with its blocks,
    though its first 8-token chunk would fit beside `a` at once; nothing is preempted."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    a = make_request(24, max_tokens=8, request_id="a", first_token_id=100)  # 8 blocks at most
    b = make_request(40, max_tokens=4, request_id="b", first_token_id=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    admitted_b_with_a_running = False
    while scheduler.has_unfinished():
        out = run_step(scheduler)
        assert not out.preempted_ids
        if any(s.request is b for s in out.scheduled) and a.status is RequestStatus.RUNNING:
            admitted_b_with_a_running = True
    assert not admitted_b_with_a_running
    assert scheduler.num_preemptions == 0
    assert b.output_token_ids == [SAMPLED_TOKEN] * 4
    assert_idle(scheduler)


def test_a_prompt_larger_than_the_free_pool_still_runs_alone() -> None:
    """Nothing running: a prompt is admitted chunk by chunk as before (no one to wait for)."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    big = make_request(56, max_tokens=4, request_id="big")
    scheduler.add_request(big)
    run_until_done(scheduler)
    assert big.output_token_ids == [SAMPLED_TOKEN] * 4
    assert_idle(scheduler)


# -- abort -----------------------------------------------------------------------------------


def test_abort_waiting_request() -> None:
    scheduler = make_scheduler()
    request = make_request(6)
    scheduler.add_request(request)
    scheduler.finish_requests(["r0"], ABORTED)
    assert request.status is ABORTED
    assert request.status.finish_reason == "abort"
    assert_idle(scheduler)


def test_abort_running_request_mid_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request(10)
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.status is RequestStatus.RUNNING
    assert 0 < request.num_computed_tokens < request.num_prompt_tokens

    scheduler.finish_requests(["r0"], ABORTED)
    assert request.status is ABORTED
    assert request.num_output_tokens == 0
    assert_idle(scheduler)


def test_abort_running_request_while_decoding() -> None:
    scheduler = make_scheduler()
    request = make_request(6, max_tokens=10)
    scheduler.add_request(request)
    for _ in range(3):
        run_step(scheduler)
    scheduler.finish_requests(["r0"], ABORTED)
    assert request.status is ABORTED
    assert request.num_output_tokens == 3
    assert_idle(scheduler)


def test_abort_between_schedule_and_update_drops_the_steps_result() -> None:
    scheduler = make_scheduler()
    a = make_request(6, max_tokens=10, request_id="a")
    b = make_request(6, max_tokens=10, request_id="b", first_token_id=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    scheduler.finish_requests(["a"], ABORTED)
    scheduler.update_from_output(out, [SAMPLED_TOKEN, SAMPLED_TOKEN])

    assert a.num_output_tokens == 0
    assert b.num_output_tokens == 1
    assert scheduler.running == [b]
    run_until_done(scheduler)
    assert_idle(scheduler)


def test_abort_preempted_request() -> None:
    scheduler, a, b = make_two_request_squeeze()
    run_until_preemption(scheduler)
    scheduler.finish_requests(["b"], ABORTED)
    assert b.status is ABORTED
    assert b not in scheduler.waiting

    run_until_done(scheduler)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert_idle(scheduler)


def test_abort_of_unknown_or_finished_ids_is_a_no_op() -> None:
    scheduler = make_scheduler()
    done = make_request(3, max_tokens=1, request_id="done")
    live = make_request(3, max_tokens=5, request_id="live", first_token_id=200)
    scheduler.add_request(done)
    scheduler.add_request(live)
    run_step(scheduler)
    assert done.status is RequestStatus.FINISHED_LENGTH

    scheduler.finish_requests(["nope", "done"], ABORTED)
    assert done.status is RequestStatus.FINISHED_LENGTH
    assert live.status is RequestStatus.RUNNING
    assert list(scheduler.requests) == ["live"]

    scheduler.finish_requests(["live"], ABORTED)
    scheduler.finish_requests(["live"], RequestStatus.FINISHED_STOPPED)
    assert live.status is ABORTED
    assert_idle(scheduler)


@pytest.mark.parametrize("abort_every", [2, 3, 5])
def test_pool_is_whole_again_after_any_mix_of_finished_and_aborted(abort_every: int) -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=10)
    requests = [
        make_request(
            3 + (i * 5) % 11, max_tokens=2 + i % 6, request_id=f"r{i}", first_token_id=50 * i
        )
        for i in range(12)
    ]
    for i, r in enumerate(requests):
        scheduler.add_request(r)
        if i % 4 == 3:
            scheduler.finish_requests([requests[i - 2].request_id], ABORTED)
    step = 0
    while scheduler.has_unfinished():
        step += 1
        assert step < 300
        run_step(scheduler)
        if step % abort_every == 0:
            scheduler.finish_requests([requests[step % len(requests)].request_id], ABORTED)
    assert all(r.is_finished for r in requests)
    assert any(r.status is ABORTED for r in requests)
    assert any(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert_idle(scheduler)


# -- stop conditions -------------------------------------------------------------------------


def test_max_tokens_finishes_with_length() -> None:
    scheduler = make_scheduler()
    request = make_request(4, max_tokens=5)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.num_output_tokens == 5
    assert request.stop_reason is None


def test_eos_token_finishes_with_stopped() -> None:
    scheduler = make_scheduler()
    request = make_request(4, max_tokens=5, eos_token_ids=(SAMPLED_TOKEN,))
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [SAMPLED_TOKEN]
    assert request.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request(4, max_tokens=5, eos_token_ids=(SAMPLED_TOKEN,), ignore_eos=True)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.num_output_tokens == 5


def test_stop_token_id_finishes_and_sets_stop_reason() -> None:
    scheduler = make_scheduler()
    request = make_request(4, max_tokens=5, stop_token_ids=(3, SAMPLED_TOKEN))
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == SAMPLED_TOKEN
    assert request.num_output_tokens == 1


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    scheduler = make_scheduler()
    request = make_request(4, max_tokens=5, stop_token_ids=(SAMPLED_TOKEN,), ignore_eos=True)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == SAMPLED_TOKEN


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    scheduler = make_scheduler()
    eos = make_request(
        4, max_tokens=8, request_id="eos", eos_token_ids=(SAMPLED_TOKEN,), min_tokens=3
    )
    stop = make_request(
        4,
        max_tokens=8,
        request_id="stop",
        first_token_id=200,
        stop_token_ids=(SAMPLED_TOKEN,),
        min_tokens=3,
    )
    scheduler.add_request(eos)
    scheduler.add_request(stop)
    run_until_done(scheduler)
    for r in (eos, stop):
        assert r.status is RequestStatus.FINISHED_STOPPED
        assert r.num_output_tokens == 3


def test_max_model_len_finishes_with_length() -> None:
    scheduler = make_scheduler(max_model_len=10)
    request = make_request(6, max_tokens=None)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.num_tokens == 10
    assert request.num_output_tokens == 4


def test_pending_prompt_tokens_count_waiting_and_unfinished_prefills() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4, max_num_seqs=1)
    scheduler.add_request(make_request(10, request_id="a"))
    scheduler.add_request(make_request(6, request_id="b", first_token_id=300))
    assert scheduler.num_prompt_tokens_pending == 16
    run_step(scheduler)  # 4 of a's 10
    assert scheduler.num_prompt_tokens_pending == 6 + 6
    run_step(scheduler)
    run_step(scheduler)  # a's prefill is done and it decodes: only b is owed
    assert scheduler.num_prompt_tokens_pending == 6
    run_until_done(scheduler)
    assert scheduler.num_prompt_tokens_pending == 0


# -- phase times -----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_finished_request_reports_where_its_time_went() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(clock=clock, max_num_seqs=1, max_num_batched_tokens=4)
    first = Request("first", list(range(6)), SamplingParams(max_tokens=2), arrival_time=100.0)
    queued = Request("queued", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=100.0)
    scheduler.add_request(first)
    scheduler.add_request(queued)
    for now in (100.5, 101.0, 103.0):  # first: a chunk, the rest + a token, a token
        clock.now = now
        run_step(scheduler)
    assert first.times() == RequestTimes(queued_s=0.5, kv_load_s=0.0, prefill_s=0.5, decode_s=2.0)
    assert queued.times() is None  # still waiting for the only seat
    for now in (104.0, 110.0):
        clock.now = now
        run_step(scheduler)
    assert queued.times() == RequestTimes(queued_s=4.0, kv_load_s=0.0, prefill_s=0.0, decode_s=6.0)


def test_a_remote_load_is_its_own_phase() -> None:
    clock = FakeClock()
    connector = RecordingConnector(remote={"d": 9})
    scheduler = make_scheduler(clock=clock, connector=connector)
    d = Request("d", list(range(10)), SamplingParams(max_tokens=1), arrival_time=100.0)
    scheduler.add_request(d)
    clock.now = 101.0
    run_step(scheduler)  # admitted, loading
    clock.now = 104.0
    connector.loads_finished = [LoadResult("d", ok=True)]
    scheduler.tick()
    clock.now = 104.5
    run_step(scheduler)
    assert d.times() == RequestTimes(queued_s=1.0, kv_load_s=3.0, prefill_s=0.5, decode_s=0.0)


def test_a_request_aborted_before_its_first_token_reports_no_times() -> None:
    scheduler = make_scheduler(clock=FakeClock(), max_num_batched_tokens=4)
    request = make_request(6, max_tokens=5)
    scheduler.add_request(request)
    run_step(scheduler)  # the first chunk: no token yet
    scheduler.finish_requests(["r0"], ABORTED)
    assert request.admitted_time is not None and request.times() is None


# -- connector hooks -------------------------------------------------------------------------


class RecordingConnector(KVConnector):
    """Records every hook call; holds the blocks of requests named in `hold`; loads the
    tokens named in `remote` (request id → token count) until a test ends the load."""

    def __init__(self, hold: Sequence[str] = (), remote: dict[str, int] | None = None) -> None:
        self.hold = set(hold)
        self.remote = dict(remote or {})
        self.releasable: list[str] = []
        self.loads_finished: list[LoadResult] = []
        self.added: list[str] = []
        self.admitted: list[tuple[str, list[int], int]] = []
        self.finished: list[tuple[str, RequestStatus, list[int]]] = []
        self.num_step_calls = 0

    def on_request_added(self, request: Request) -> None:
        self.added.append(request.request_id)

    def get_num_remote_tokens(self, request: Request, num_local_tokens: int) -> int:
        return max(0, self.remote.get(request.request_id, 0) - num_local_tokens)

    def on_admitted(self, request: Request, block_ids: Sequence[int], num_remote: int) -> None:
        self.admitted.append((request.request_id, list(block_ids), num_remote))
        self.remote.pop(request.request_id, None)  # loads once, like the decode connector

    def on_request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        self.finished.append((request.request_id, request.status, list(block_ids)))
        return request.request_id in self.hold

    def on_step_finished(self, output: SchedulerOutput) -> ConnectorEvents:
        self.num_step_calls += 1
        ids, self.releasable = self.releasable, []
        loads, self.loads_finished = self.loads_finished, []
        return ConnectorEvents(tuple(loads), tuple(ids))


def test_connector_hooks_get_each_request_and_its_blocks() -> None:
    connector = RecordingConnector()
    scheduler = make_scheduler(connector=connector, max_num_batched_tokens=4)
    scheduler.add_request(make_request(6, max_tokens=2, request_id="a"))
    scheduler.add_request(make_request(2, max_tokens=1, request_id="b", first_token_id=200))
    assert connector.added == ["a", "b"]
    assert connector.admitted == []

    last_blocks = {}
    num_steps = 0
    admitted_blocks = {}
    while scheduler.has_unfinished():
        out = run_step(scheduler)
        num_steps += 1
        for s in out.scheduled:
            assert len(s.block_ids) == -(-(s.num_context_tokens + s.num_new_tokens) // 4)
            last_blocks[s.request.request_id] = list(s.block_ids)
            admitted_blocks.setdefault(s.request.request_id, list(s.block_ids))

    assert num_steps == 3  # a's first chunk; a's rest with b; a's decode
    assert connector.num_step_calls == num_steps
    assert connector.admitted == [("a", admitted_blocks["a"], 0), ("b", admitted_blocks["b"], 0)]
    length = RequestStatus.FINISHED_LENGTH
    assert connector.finished == [("b", length, last_blocks["b"]), ("a", length, last_blocks["a"])]
    assert_idle(scheduler)


# -- remote loads (a decode node's requests) -------------------------------------------------


def test_a_remote_load_parks_the_request_with_blocks_until_the_load_ends() -> None:
    connector = RecordingConnector(remote={"d": 9})
    scheduler = make_scheduler(connector=connector, block_size=4)
    d = make_request(10, max_tokens=2, request_id="d")
    scheduler.add_request(d)
    scheduler.add_request(make_request(3, max_tokens=2, request_id="local", first_token_id=300))
    out = run_step(scheduler)
    assert scheduled_ids(out) == ["local"]  # d computes nothing while its KV is loading
    assert d.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert connector.admitted[0] == ("d", scheduler.kv.block_ids("d"), 9)
    assert len(scheduler.kv.block_ids("d")) == 3  # 9 tokens in blocks of 4
    run_step(scheduler)
    assert d.status is RequestStatus.WAITING_FOR_REMOTE_KV  # still loading

    connector.loads_finished = [LoadResult("d", ok=True)]
    scheduler.tick()
    out = run_step(scheduler)
    entry = next(s for s in out.scheduled if s.request is d)
    assert (entry.num_context_tokens, entry.num_new_tokens) == (9, 1)  # only the last position
    run_until_done(scheduler)
    assert d.output_token_ids == [SAMPLED_TOKEN] * 2
    assert_idle(scheduler)


def test_a_failed_load_recomputes_the_prompt_and_an_erroring_one_fails_the_request() -> None:
    connector = RecordingConnector(remote={"re": 9, "err": 9})
    scheduler = make_scheduler(connector=connector, block_size=4)
    recompute = make_request(10, max_tokens=1, request_id="re")
    failing = make_request(10, max_tokens=1, request_id="err", first_token_id=500)
    scheduler.add_request(recompute)
    scheduler.add_request(failing)
    run_step(scheduler)
    connector.loads_finished = [LoadResult("re", ok=False), LoadResult("err", False, "boom")]
    failed = scheduler.tick()
    assert failed == [failing] and failing.status is RequestStatus.FINISHED_ERROR
    assert failing.error == "boom" and not scheduler.kv.holds("err")
    out = run_step(scheduler)
    assert (out.scheduled[0].num_context_tokens, out.scheduled[0].num_new_tokens) == (0, 10)
    assert_idle(scheduler)


def test_loading_requests_count_against_max_num_seqs_and_are_never_preempted() -> None:
    connector = RecordingConnector(remote={"d": 7})
    scheduler = make_scheduler(connector=connector, max_num_seqs=1, num_blocks=4, block_size=4)
    scheduler.add_request(make_request(8, max_tokens=8, request_id="d"))
    scheduler.add_request(make_request(3, max_tokens=2, request_id="x", first_token_id=300))
    assert run_step(scheduler).scheduled == ()  # x waits: d holds the only seat
    assert scheduler.waiting[0].request_id == "x"
    connector.loads_finished = [LoadResult("d", ok=True)]
    run_until_done(scheduler)
    assert_idle(scheduler)


def test_abort_while_loading_keeps_blocks_the_connector_holds_until_released() -> None:
    connector = RecordingConnector(remote={"d": 9}, hold=["d"])
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(make_request(10, max_tokens=2, request_id="d"))
    run_step(scheduler)
    blocks = scheduler.kv.block_ids("d")
    scheduler.finish_requests(["d"], ABORTED)
    assert connector.finished == [("d", ABORTED, blocks)]
    assert scheduler.held == {"d"} and "d" not in scheduler.loading
    connector.loads_finished = [LoadResult("d", ok=True)]  # the read ended: ignored result
    connector.releasable = ["d"]
    scheduler.tick()
    assert scheduler.held == set()
    assert_idle(scheduler)


def test_a_preempted_request_is_recomputed_locally_after_its_load() -> None:
    connector = RecordingConnector(remote={"d": 7})
    scheduler = make_scheduler(connector=connector, num_blocks=6, block_size=4)
    scheduler.add_request(make_request(4, max_tokens=8, request_id="x", first_token_id=300))
    d = make_request(8, max_tokens=12, request_id="d")  # 5 blocks alone; with x: too many
    scheduler.add_request(d)
    run_step(scheduler)
    connector.loads_finished = [LoadResult("d", ok=True)]  # d runs after x: preempted first
    run_until_done(scheduler)
    assert d.num_preemptions > 0
    assert [n for rid, _, n in connector.admitted if rid == "d"] == [7] + [0] * d.num_preemptions
    assert_idle(scheduler)


# -- prefix cache ----------------------------------------------------------------------------


def test_repeated_prompt_is_served_from_the_prefix_cache() -> None:
    scheduler = make_scheduler(block_size=4)
    first = make_request(18, max_tokens=1, request_id="first")
    scheduler.add_request(first)
    run_until_done(scheduler)
    assert first.num_cached_tokens == 0

    second = make_request(18, max_tokens=1, request_id="second")
    scheduler.add_request(second)
    out = run_step(scheduler)
    assert second.num_cached_tokens == 16
    assert out.scheduled[0].num_context_tokens == 16
    assert out.scheduled[0].num_new_tokens == 2
    assert second.output_token_ids == [SAMPLED_TOKEN]
    assert_idle(scheduler)


def test_prefix_shared_with_a_running_request_is_freed_once_both_finish() -> None:
    scheduler = make_scheduler(block_size=4)
    a = make_request(12, max_tokens=6, request_id="a")
    scheduler.add_request(a)
    run_step(scheduler)
    b = make_request(12, max_tokens=2, request_id="b")
    scheduler.add_request(b)
    out = run_step(scheduler)
    b_entry = next(s for s in out.scheduled if s.request is b)
    assert b.num_cached_tokens == 8
    assert b_entry.block_ids[:2] == tuple(scheduler.kv.block_ids("a")[:2])
    run_until_done(scheduler)
    assert_idle(scheduler)


def test_prompt_tokens_computed_leave_out_prefix_hits_and_chunks_count_once() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request(18, max_tokens=3, request_id="first"))  # 3 chunks
    run_until_done(scheduler)
    assert scheduler.num_prompt_tokens_computed == 18  # decode steps add nothing
    scheduler.add_request(make_request(18, max_tokens=1, request_id="second"))
    run_until_done(scheduler)
    assert scheduler.num_prompt_tokens_computed == 18 + 2  # 16 were prefix hits


def test_prefix_caching_disabled_recomputes_everything() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    for rid in ("first", "second"):
        request = make_request(18, max_tokens=1, request_id=rid)
        scheduler.add_request(request)
        out = run_step(scheduler)
        assert request.num_cached_tokens == 0
        assert out.scheduled[0].num_new_tokens == 18
    assert_idle(scheduler)


def test_requests_arriving_together_compute_their_shared_prefix_once() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    first = make_request(18, max_tokens=2, request_id="first")
    same = make_request(18, max_tokens=2, request_id="same")  # the same 16-token prefix
    other = make_request(18, max_tokens=2, request_id="other", first_token_id=500)
    for request in (first, same, other):
        scheduler.add_request(request)
    out = run_step(scheduler)
    assert scheduled_ids(out) == ["first", "other"]  # `same` waits for first's blocks
    out = run_step(scheduler)
    entry = next(s for s in out.scheduled if s.request is same)
    assert same.num_cached_tokens == 16 and entry.num_new_tokens == 2
    run_until_done(scheduler)
    assert scheduler.num_prompt_tokens_computed == 18 + 18 + 2
    assert_idle(scheduler)


def test_a_request_waits_for_a_shared_prefix_only_while_it_is_being_computed() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=12)
    long = make_request(20, max_tokens=2, request_id="long")  # chunks of 12 and 8
    scheduler.add_request(long)
    run_step(scheduler)  # long: 12 computed, 3 blocks cached
    short = make_request(18, max_tokens=1, request_id="short")  # long's first 18 tokens
    scheduler.add_request(short)
    out = run_step(scheduler)  # short's 4th block is in long's last chunk: it waits
    assert scheduled_ids(out) == ["long"]
    out = run_step(scheduler)
    assert short.num_cached_tokens == 16 and "short" in scheduled_ids(out)
    run_until_done(scheduler)
    assert_idle(scheduler)
    # Without prefix caching there is nothing to wait for.
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    for rid in ("a", "b"):
        scheduler.add_request(make_request(18, max_tokens=1, request_id=rid))
    assert scheduled_ids(run_step(scheduler)) == ["a", "b"]
    assert_idle(scheduler)
