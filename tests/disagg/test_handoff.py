"""The handoff table against DESIGN.md's states, invariants and failure windows (S-ids)."""

from __future__ import annotations

import random

import pytest

from pdserve.disagg.handoff import Handoff, HandoffState, HandoffTable, Outcome


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(
    lease_s: float = 5.0, claim_timeout_s: float = 10.0
) -> tuple[HandoffTable, FakeClock]:
    clock = FakeClock()
    return HandoffTable(lease_s, claim_timeout_s, epoch="e1", clock=clock), clock


def make_held(
    table: HandoffTable, request_id: str = "r1", blocks: tuple[int, ...] = (3, 4)
) -> Handoff:
    handoff = table.begin(request_id)
    assert table.hold(handoff.handoff_id, blocks, num_tokens=20) is Outcome.OK
    return handoff


def released_ids(table: HandoffTable) -> list[str]:
    return [h.handoff_id for h in table.take_released()]


def test_happy_path_claim_read_done_frees_once() -> None:
    table, _ = make_table()
    h = make_held(table)
    assert table.num_held_blocks == 2
    assert table.claim(h.handoff_id, h.release_token, "e1", h.block_ids) is Outcome.OK
    assert table.finish_read(h.handoff_id, h.release_token, "e1", ok=True) is Outcome.OK
    assert released_ids(table) == [h.handoff_id]
    assert table.num_live == 0 and table.num_held_blocks == 0


def test_s1_s2_abort_while_prefilling_wins_over_the_commit() -> None:
    table, _ = make_table()
    h = table.begin("r1")
    assert table.release(h.handoff_id, h.release_token) is Outcome.OK
    # The step's output is committed after the abort: nothing may be pinned.
    assert table.hold(h.handoff_id, (1, 2), 20) is Outcome.ALREADY_RELEASED
    assert table.num_held_blocks == 0
    assert [x.block_ids for x in table.take_released()] == [()]


@pytest.mark.parametrize("admin", [False, True])
def test_s3_s15_release_of_a_held_handoff_is_immediate(admin: bool) -> None:
    table, _ = make_table()
    h = make_held(table)
    token = None if admin else h.release_token
    assert table.release(h.handoff_id, token, admin=admin) is Outcome.OK
    assert released_ids(table) == [h.handoff_id]


def test_s6_release_during_the_read_waits_for_the_read_to_end() -> None:
    table, _ = make_table()
    h = make_held(table)
    table.claim(h.handoff_id, h.release_token, "e1", h.block_ids)
    assert table.release(h.handoff_id, h.release_token) is Outcome.DEFERRED
    assert table.take_released() == []  # invariant 2: no free while the read can land
    assert table.finish_read(h.handoff_id, h.release_token, "e1", ok=False) is Outcome.OK
    assert released_ids(table) == [h.handoff_id]


def test_s8_done_and_release_together_or_twice_release_once() -> None:
    table, _ = make_table()
    h = make_held(table)
    table.claim(h.handoff_id, h.release_token, "e1", h.block_ids)
    assert table.finish_read(h.handoff_id, h.release_token, "e1", ok=True) is Outcome.OK
    assert (
        table.finish_read(h.handoff_id, h.release_token, "e1", ok=True) is Outcome.ALREADY_RELEASED
    )
    assert table.release(h.handoff_id, h.release_token) is Outcome.ALREADY_RELEASED
    assert released_ids(table) == [h.handoff_id]
    assert table.counters["done_late"] == 1 and table.counters["release_late"] == 1


def test_s9_expired_lease_refuses_the_claim() -> None:
    table, clock = make_table(lease_s=5)
    h = make_held(table)
    clock.now += 5.0
    assert table.claim(h.handoff_id, h.release_token, "e1", h.block_ids) is Outcome.ALREADY_RELEASED
    assert released_ids(table) == [h.handoff_id]


def test_s10_s12_without_renewals_the_sweep_frees_at_lease_end() -> None:
    table, clock = make_table(lease_s=5)
    h = make_held(table)
    clock.now += 4.9
    assert table.sweep() == 0
    clock.now += 0.1
    assert table.sweep() == 1
    assert released_ids(table) == [h.handoff_id]


def test_renew_extends_the_lease() -> None:
    table, clock = make_table(lease_s=5)
    h = make_held(table)
    for _ in range(4):
        clock.now += 4.0
        assert table.renew(h.handoff_id, h.release_token, "e1") is Outcome.OK
        assert table.sweep() == 0
    assert table.claim(h.handoff_id, h.release_token, "e1", h.block_ids) is Outcome.OK


def test_claim_deadline_frees_a_stuck_read() -> None:
    table, clock = make_table(claim_timeout_s=10)
    h = make_held(table)
    table.claim(h.handoff_id, h.release_token, "e1", h.block_ids)
    clock.now += 9.9
    assert table.sweep() == 0
    clock.now += 0.1
    assert table.sweep() == 1
    assert (
        table.finish_read(h.handoff_id, h.release_token, "e1", ok=True) is Outcome.ALREADY_RELEASED
    )


def test_s11_stale_epoch_is_refused() -> None:
    table, _ = make_table()
    h = make_held(table)
    assert (
        table.claim(h.handoff_id, h.release_token, "old-epoch", h.block_ids) is Outcome.STALE_EPOCH
    )
    assert table.get(h.handoff_id).state is HandoffState.HELD  # type: ignore[union-attr]


def test_s14_ids_and_tokens_are_minted_per_attempt() -> None:
    table, _ = make_table()
    a, b = table.begin("same-client-id"), table.begin("same-client-id")
    assert a.handoff_id != b.handoff_id and a.release_token != b.release_token
    assert table.release(a.handoff_id, b.release_token) is Outcome.BAD_TOKEN


def test_s16_unknown_ids_are_counted_and_ignored() -> None:
    table, _ = make_table()
    h = make_held(table)
    assert table.release("ho-nope", "x") is Outcome.UNKNOWN
    assert table.claim("ho-nope", "x", "e1", ()) is Outcome.UNKNOWN
    assert table.hold("ho-nope", (1,), 1) is Outcome.UNKNOWN
    assert table.counters["release_unknown"] == 1
    assert table.get(h.handoff_id).state is HandoffState.HELD  # type: ignore[union-attr]


def test_s20_wrong_or_missing_token_releases_nothing() -> None:
    table, _ = make_table()
    h = make_held(table)
    for token in (None, "", "guess", h.release_token[:-1]):
        assert table.release(h.handoff_id, token) is Outcome.BAD_TOKEN
        assert table.claim(h.handoff_id, token or "", "e1", h.block_ids) is Outcome.BAD_TOKEN
    assert table.take_released() == []
    assert table.get(h.handoff_id).state is HandoffState.HELD  # type: ignore[union-attr]


def test_a_claim_for_other_blocks_reads_nothing_and_the_handoff_stays_held() -> None:
    """The decode node's block ids come from the decode leg's params, which any client
    writes: a claim must name exactly the handoff's blocks (found by the HTTP properties:
    a decode leg naming block 0 read it, free or another request's)."""
    table, _ = make_table()
    h = make_held(table, blocks=(3, 4))
    for blocks in ((0, 1), (3,), (4, 3), (3, 4, 5), ()):
        assert table.claim(h.handoff_id, h.release_token, "e1", blocks) is Outcome.WRONG_BLOCKS
    assert table.counters["claim_wrong_blocks"] == 5
    assert table.get(h.handoff_id).state is HandoffState.HELD  # type: ignore[union-attr]
    assert table.claim(h.handoff_id, h.release_token, "e1", [3, 4]) is Outcome.OK


def test_wrong_state_messages_are_total() -> None:
    table, _ = make_table()
    h = table.begin("r1")
    assert (
        table.claim(h.handoff_id, h.release_token, "e1", h.block_ids) is Outcome.WRONG_STATE
    )  # prefilling
    table.hold(h.handoff_id, (1,), 4)
    assert table.hold(h.handoff_id, (1,), 4) is Outcome.WRONG_STATE
    assert table.finish_read(h.handoff_id, h.release_token, "e1", ok=True) is Outcome.WRONG_STATE
    table.claim(h.handoff_id, h.release_token, "e1", h.block_ids)
    assert table.claim(h.handoff_id, h.release_token, "e1", h.block_ids) is Outcome.WRONG_STATE


@pytest.mark.parametrize("seed", range(20))
def test_random_message_storms_keep_the_invariants(seed: int) -> None:
    """Any interleaving: each handoff is released exactly once, never while CLAIMED except
    by done/failed/deadline, and nothing outlives its deadlines."""
    rng = random.Random(seed)
    table, clock = make_table(lease_s=5, claim_timeout_s=8)
    handoffs = [table.begin(f"r{i}") for i in range(12)]
    released: list[str] = []
    for _ in range(300):
        h = rng.choice(handoffs)
        before = h.state
        action = rng.randrange(9)
        token = h.release_token if rng.random() < 0.9 else "wrong"
        epoch = "e1" if rng.random() < 0.95 else "e0"
        if action == 0:
            table.hold(h.handoff_id, (rng.randrange(100),), 16)
        elif action == 1:
            table.renew(h.handoff_id, token, epoch)
        elif action == 2:
            table.claim(h.handoff_id, token, epoch, h.block_ids if rng.random() < 0.9 else (7,))
        elif action in (3, 4):
            table.finish_read(h.handoff_id, token, epoch, ok=action == 3)
        elif action == 5:
            outcome = table.release(h.handoff_id, token, epoch)
            if before is HandoffState.CLAIMED and outcome is not Outcome.BAD_TOKEN:
                assert outcome in (Outcome.DEFERRED, Outcome.STALE_EPOCH)
        elif action == 6:
            clock.now += rng.uniform(0, 3)
            table.sweep()
        elif action == 7:
            table.release(h.handoff_id, None, admin=True)
        else:
            released.extend(released_ids(table))
        if before is HandoffState.CLAIMED and h.state is HandoffState.RELEASED:
            assert action in (3, 4, 6) or h.release_reason == "expired"
    for h in handoffs:  # the PREFILLING ones belong to running requests: abort them
        if h.state is HandoffState.PREFILLING:
            table.release(h.handoff_id, h.release_token)
    clock.now += 100
    table.sweep()
    released.extend(released_ids(table))
    assert sorted(released) == sorted(h.handoff_id for h in handoffs)  # each exactly once
    assert table.num_live == 0 and table.num_held_blocks == 0
