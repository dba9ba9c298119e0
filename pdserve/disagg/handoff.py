"""API process (prefill node): the handoff table, blocks held for one remote decode, and
their life.

A handoff is minted per prefill attempt (unguessable id, per-handoff release token, the
node's epoch) and moves through these states, each with a bounded lifetime:

    PREFILLING ──prefill committed──▶ HELD ──claim──▶ CLAIMED ──done / failed──▶ RELEASED
        │                              │  │              │
        │ abort: freed at once         │  │ lease        │ claim deadline passed
        ▼                              │  │ expired      ▼
     RELEASED ◀── release / abort ─────┘  └──────────▶ RELEASED

- HELD: blocks pinned, waiting for the decode node. `renew` extends the lease; without
  renewals the sweep releases the handoff when the lease ends (decode node dead, S10). A
  `claim` must name exactly the handoff's blocks; any other list is refused and the
  handoff stays HELD.
- CLAIMED: the decode node is reading. Nothing frees the blocks now (invariant 2) except
  `done`/`failed` or the claim deadline; a `release` that arrives meanwhile is answered
  `DEFERRED` and needs no record: one of those ends the handoff anyway.
- RELEASED: terminal. Every later message about it is answered (`ALREADY_RELEASED`),
  counted and ignored.

Every handler is total: unknown ids, wrong tokens, stale epochs and late or repeated
messages return an `Outcome` and bump a counter; none raises (invariant 4). Released
handoffs are queued for the engine, which frees their blocks (`take_released`).
"""

from __future__ import annotations

import enum
import hmac
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.disagg.messages import AbortOutcome, Outcome, ReleaseReason

RELEASED_RETENTION_S = 600.0
"""RELEASED handoffs are remembered this long, to answer late messages precisely."""


class HandoffState(enum.Enum):
    PREFILLING = "prefilling"
    HELD = "held"
    CLAIMED = "claimed"
    RELEASED = "released"


@dataclass
class Handoff:
    handoff_id: str
    request_id: str
    release_token: str
    state: HandoffState
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    lease_deadline_s: float = 0.0
    claim_deadline_s: float = 0.0
    client_request_id: str = ""
    """The client's X-Request-Id, so an operator can abort by it."""
    created_s: float = 0.0
    release_reason: ReleaseReason | None = None
    """Set once RELEASED."""
    released_at_s: float = 0.0


class HandoffTable:
    def __init__(
        self,
        lease_s: float = 5.0,
        claim_timeout_s: float = 10.0,
        epoch: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease_s = lease_s
        self.claim_timeout_s = claim_timeout_s
        self.epoch = epoch or secrets.token_hex(8)
        """New at every start: a decode node holding params from an older incarnation is
        refused (S11)."""
        self._clock = clock
        self._handoffs: dict[str, Handoff] = {}
        self._released: list[Handoff] = []
        self.counters: Counter[str] = Counter()

    # -- the prefill node's own transitions ------------------------------------------

    def begin(
        self, request_id: str, client_request_id: str = "", release_token: str | None = None
    ) -> Handoff:
        """A prefill leg was admitted: mint the handoff (PREFILLING, no blocks pinned yet).

        `release_token` is the leg's own when its caller chose one (the proxy does, so it
        can release an attempt whose answer it never read), else minted here."""
        handoff = Handoff(
            handoff_id=f"ho-{secrets.token_urlsafe(16)}",
            request_id=request_id,
            release_token=release_token or secrets.token_urlsafe(24),
            state=HandoffState.PREFILLING,
            client_request_id=client_request_id,
            created_s=self._clock(),
        )
        self._handoffs[handoff.handoff_id] = handoff
        return handoff

    def hold(self, handoff_id: str, block_ids: tuple[int, ...], num_tokens: int) -> Outcome:
        """The prefill step was committed: pin its blocks and start the lease.

        Refused (the caller frees the blocks) when an abort won the race (S2)."""
        handoff = self._handoffs.get(handoff_id)
        if handoff is None:
            return self._count("hold_unknown", Outcome.UNKNOWN)
        if handoff.state is HandoffState.RELEASED:
            return self._count("hold_after_release", Outcome.ALREADY_RELEASED)
        if handoff.state is not HandoffState.PREFILLING:
            return self._count("hold_repeated", Outcome.WRONG_STATE)
        handoff.state = HandoffState.HELD
        handoff.block_ids, handoff.num_tokens = block_ids, num_tokens
        handoff.lease_deadline_s = self._clock() + self.lease_s
        return Outcome.OK

    # -- messages from the decode node, the proxy or an operator --------------------

    def renew(self, handoff_id: str, token: str, epoch: str | None) -> Outcome:
        handoff, outcome = self._authorize("renew", handoff_id, token, epoch)
        if handoff is None:
            return outcome
        if handoff.state is HandoffState.HELD:
            handoff.lease_deadline_s = self._clock() + self.lease_s
        return Outcome.OK

    def claim(
        self, handoff_id: str, token: str, epoch: str | None, block_ids: Sequence[int]
    ) -> Outcome:
        """The decode node asks to read `block_ids`. Only a HELD handoff within its lease is
        claimable, and only for exactly its own blocks."""
        handoff, outcome = self._authorize("claim", handoff_id, token, epoch)
        if handoff is None:
            return outcome
        if handoff.state is not HandoffState.HELD:
            return self._count("claim_wrong_state", Outcome.WRONG_STATE)
        if tuple(block_ids) != handoff.block_ids:
            return self._count("claim_wrong_blocks", Outcome.WRONG_BLOCKS)
        if self._clock() >= handoff.lease_deadline_s:  # expired, sweep not yet run
            self.counters["lease_expired"] += 1
            self._release(handoff, ReleaseReason.EXPIRED)
            return self._count("claim_expired", Outcome.ALREADY_RELEASED)
        handoff.state = HandoffState.CLAIMED
        handoff.claim_deadline_s = self._clock() + self.claim_timeout_s
        return Outcome.OK

    def finish_read(self, handoff_id: str, token: str, epoch: str | None, ok: bool) -> Outcome:
        """`done` (ok) or `failed`: the decode node's read has ended; free the blocks."""
        name = "done" if ok else "failed"
        handoff, outcome = self._authorize(name, handoff_id, token, epoch)
        if handoff is None:
            return outcome
        if handoff.state is not HandoffState.CLAIMED:
            return self._count(f"{name}_unclaimed", Outcome.WRONG_STATE)
        self._release(handoff, ReleaseReason.TRANSFERRED if ok else ReleaseReason.FAILED)
        return Outcome.OK

    def release(
        self,
        handoff_id: str,
        token: str | None,
        epoch: str | None = None,
        admin: bool = False,
        reason: ReleaseReason = ReleaseReason.RELEASED,
    ) -> Outcome:
        """Release from the decode node, the proxy (release token) or an operator (admin)."""
        handoff, outcome = self._authorize("release", handoff_id, token, epoch, admin)
        if handoff is None:
            return outcome
        if handoff.state is HandoffState.CLAIMED:
            return Outcome.DEFERRED  # done, failed or the claim deadline ends it
        self._release(handoff, reason)
        return Outcome.OK

    def abort(self, ids: Sequence[str], token: str | None, admin: bool) -> dict[str, AbortOutcome]:
        """`POST /v1/abort_requests`: release the handoffs each id names (`named`; with a
        token and no admin credential, only those minted with it). Ids that name nothing
        are left out of the answer."""
        results: dict[str, AbortOutcome] = {}
        for key in ids:
            handoffs = self.named(key, None if admin else token)
            if handoffs:
                outcomes = [
                    self.release(h.handoff_id, token, admin=admin, reason=ReleaseReason.ABORTED)
                    for h in handoffs
                ]
                results[key] = _abort_outcome(outcomes)
        return results

    def covers(self, ids: Sequence[str], token: str) -> bool:
        """Whether a release token may act on every id: each must name a handoff (live or
        recently released) minted with it. An unknown id cannot be checked against the
        token, so it is refused too: without the admin key nothing is answered about ids
        the caller cannot prove are theirs."""
        return all(self.named(key, token) for key in ids)

    def ended(self, handoff_id: str, reason: ReleaseReason) -> Outcome:
        """The engine freed the handoff's blocks on its own (a vLLM worker: the decode
        node's read notification, or its own lease): the handoff ends in any state."""
        handoff = self._handoffs.get(handoff_id)
        if handoff is None:
            return self._count("ended_unknown", Outcome.UNKNOWN)
        if handoff.state is HandoffState.RELEASED:
            return self._count("ended_late", Outcome.ALREADY_RELEASED)
        self._release(handoff, reason)
        return Outcome.OK

    # -- time ----------------------------------------------------------------------

    def sweep(self) -> int:
        """Release every handoff past its lease (HELD) or claim deadline (CLAIMED)."""
        now = self._clock()
        expired = [
            h
            for h in self._handoffs.values()
            if (h.state is HandoffState.HELD and now >= h.lease_deadline_s)
            or (h.state is HandoffState.CLAIMED and now >= h.claim_deadline_s)
        ]
        for handoff in expired:
            held = handoff.state is HandoffState.HELD
            self.counters["lease_expired" if held else "claim_deadline"] += 1
            self._release(handoff, ReleaseReason.EXPIRED)
        forgotten = [
            h.handoff_id
            for h in self._handoffs.values()
            if h.state is HandoffState.RELEASED and now - h.released_at_s > RELEASED_RETENTION_S
        ]
        for handoff_id in forgotten:
            del self._handoffs[handoff_id]
        return len(expired)

    def take_released(self) -> list[Handoff]:
        """Handoffs released since the last call: the engine frees their blocks (PREFILLING
        ones pinned none; the running request's own abort frees those)."""
        released, self._released = self._released, []
        return released

    def get(self, handoff_id: str) -> Handoff | None:
        return self._handoffs.get(handoff_id)

    def named(self, key: str, token: str | None = None) -> list[Handoff]:
        """The handoffs `key` names (a handoff id, else a server request id or a client
        X-Request-Id; live and released), only those whose release token is `token` when
        one is given: client-chosen ids need not be unique, tokens are (S14)."""
        handoff = self._handoffs.get(key)
        named = (
            [handoff]
            if handoff
            else [h for h in self._handoffs.values() if key in (h.request_id, h.client_request_id)]
        )
        return named if token is None else [h for h in named if _same_token(token, h)]

    def live(self) -> list[Handoff]:
        return [h for h in self._handoffs.values() if h.state is not HandoffState.RELEASED]

    @property
    def num_live(self) -> int:
        return sum(1 for h in self._handoffs.values() if h.state is not HandoffState.RELEASED)

    @property
    def num_held_blocks(self) -> int:
        return sum(
            len(h.block_ids)
            for h in self._handoffs.values()
            if h.state in (HandoffState.HELD, HandoffState.CLAIMED)
        )

    # -- helpers -------------------------------------------------------------------

    def _authorize(
        self,
        name: str,
        handoff_id: str,
        token: str | None,
        epoch: str | None,
        admin: bool = False,
    ) -> tuple[Handoff | None, Outcome]:
        """The handoff if the message may act on it, else (None, why) — counted."""
        if epoch is not None and epoch != self.epoch:
            return None, self._count(f"{name}_stale_epoch", Outcome.STALE_EPOCH)
        handoff = self._handoffs.get(handoff_id)
        if handoff is None:
            return None, self._count(f"{name}_unknown", Outcome.UNKNOWN)
        if not admin and not _same_token(token, handoff):
            return None, self._count(f"{name}_bad_token", Outcome.BAD_TOKEN)
        if handoff.state is HandoffState.RELEASED:
            return None, self._count(f"{name}_late", Outcome.ALREADY_RELEASED)
        return handoff, Outcome.OK

    def _count(self, name: str, outcome: Outcome) -> Outcome:
        self.counters[name] += 1
        return outcome

    def _release(self, handoff: Handoff, reason: ReleaseReason) -> None:
        handoff.state = HandoffState.RELEASED
        handoff.release_reason = reason
        handoff.released_at_s = self._clock()
        self._released.append(handoff)


def _abort_outcome(outcomes: list[Outcome]) -> AbortOutcome:
    if any(o in (Outcome.OK, Outcome.DEFERRED) for o in outcomes):
        return AbortOutcome.RELEASED  # DEFERRED: freed when the claimed read ends
    if any(o is Outcome.ALREADY_RELEASED for o in outcomes):
        return AbortOutcome.ALREADY_RELEASED
    return AbortOutcome.NOT_FOUND


def _same_token(token: str | None, handoff: Handoff) -> bool:
    return hmac.compare_digest((token or "").encode(), handoff.release_token.encode())
