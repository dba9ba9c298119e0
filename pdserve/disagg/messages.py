"""Wire (both processes): the control channel's vocabulary and bodies, one type each, used
by the decode node's `ControlClient` (engine process) and the prefill node's `/kv/*` routes
(`pdserve.api.disagg_routes`, API process).

    GET  /kv/handshake                       → Handshake.to_json()
    POST /kv/renew    RenewBody              → RenewReply     (batched per prefill node)
    POST /kv/claim    ClaimBody              → ClaimReply
    POST /kv/done     RefBody                → OutcomeReply   (read succeeded)
    POST /kv/failed   RefBody                → OutcomeReply   (read failed or abandoned)
    POST /kv/release  ReleaseBody            → OutcomeReply

Bodies are checked strictly (a string is not a number, `true` is not a block id) and extra
fields are ignored, so a newer peer may add some. `Outcome` is the prefill node's answer
about one handoff, `ReleaseReason` why a handoff ended or why a decode node lets one go,
`AbortOutcome` the per-id answer of `POST /v1/abort_requests`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.disagg.params import HandoffRef, KVLayout
from pdserve.disagg.transport import TransportInfo
from pdserve.errors import InvalidRequestError

MAX_REFS = 1024
"""Most handoffs one renewal names."""


class Outcome(str, enum.Enum):
    """The prefill node's answer to one message about one handoff."""

    OK = "ok"
    UNKNOWN = "unknown"
    BAD_TOKEN = "bad_token"
    STALE_EPOCH = "stale_epoch"
    ALREADY_RELEASED = "already_released"
    WRONG_STATE = "wrong_state"
    """The message does not apply in the handoff's current state (e.g. a claim while
    still prefilling or already claimed, `done` without a claim)."""
    DEFERRED = "deferred"
    """Release of a CLAIMED handoff: honoured when the read ends or its deadline passes."""
    WRONG_BLOCKS = "wrong_blocks"
    """A claim for other blocks than the handoff's: the decode node would read blocks that
    are free or another request's (its block ids come from the decode leg's
    kv_transfer_params, which any client writes)."""

    def __str__(self) -> str:
        return self.value


class ReleaseReason(str, enum.Enum):
    """Why a handoff ended (the prefill node's record, and the label of
    `pdserve_handoffs_released_total`), or why a decode node lets one go (`/kv/release`).

    A decode node's own reasons (`CANCELLED`, `NOT_NEEDED`, `SHUTDOWN`) are logged by the
    prefill node as `RELEASED`: only `REJECTED` is kept apart (the decode node refused the
    request, S4)."""

    TRANSFERRED = "transferred"
    """Ended: the decode node read the blocks (`done`)."""
    RELEASED = "released"
    """Ended: released by the decode node or by the proxy (its release token)."""
    ABORTED = "aborted"
    """Ended: aborted by an operator, or its prefill leg was cut short."""
    EXPIRED = "expired"
    """Ended: its lease or its claim deadline passed."""
    REJECTED = "rejected"
    """Ended, or sent by the decode node: it refused the request before reading."""
    FAILED = "failed"
    """Ended: the decode node's read failed (`failed`)."""
    CANCELLED = "cancelled"
    """Sent by the decode node: its client left before the read."""
    NOT_NEEDED = "not_needed"
    """Sent by the decode node: the KV was cached there, or was not this prompt's."""
    SHUTDOWN = "shutdown"
    """Sent by the decode node: it is shutting down."""

    def __str__(self) -> str:
        return self.value

    @property
    def as_recorded(self) -> ReleaseReason:
        """What the prefill node records when a decode node sends this reason."""
        return self if self is ReleaseReason.REJECTED else ReleaseReason.RELEASED

    @classmethod
    def handoff_ends(cls) -> tuple[ReleaseReason, ...]:
        """The reasons a handoff can end with (the metric's labels)."""
        return (cls.TRANSFERRED, cls.RELEASED, cls.ABORTED, cls.EXPIRED, cls.REJECTED, cls.FAILED)


class AbortOutcome(str, enum.Enum):
    """The answer of `POST /v1/abort_requests` for one id."""

    ABORTED = "aborted"
    """A running request was aborted."""
    RELEASED = "released"
    """A handoff was released (or will be, when its claimed read ends)."""
    ALREADY_RELEASED = "already_released"
    NOT_FOUND = "not_found"

    def __str__(self) -> str:
        return self.value


# -- bodies ---------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class RefBody(_Body):
    """Names one handoff; the per-handoff release token authorizes the message for it."""

    handoff_id: str
    release_token: str
    epoch: str | None = None

    @classmethod
    def of(cls, ref: HandoffRef) -> RefBody:
        return cls(handoff_id=ref.handoff_id, release_token=ref.release_token, epoch=ref.epoch)


class RenewBody(_Body):
    handoffs: list[RefBody] = Field(max_length=MAX_REFS)


class ClaimBody(RefBody):
    block_ids: list[int]
    """The blocks the decode node will read (the `remote_block_ids` it was given)."""


class ReleaseBody(RefBody):
    reason: ReleaseReason = ReleaseReason.RELEASED

    @field_validator("reason", mode="before")
    @classmethod
    def _any_other_reason_is_a_release(cls, value: Any) -> ReleaseReason:
        # Lenient on purpose: a reason this node does not know still releases.
        try:
            return ReleaseReason(value)
        except (ValueError, TypeError):
            return ReleaseReason.RELEASED


class OutcomeReply(_Body):
    outcome: Outcome


class RenewReply(_Body):
    outcomes: list[Outcome]


class ClaimReply(OutcomeReply):
    claim_timeout_s: float
    """How long the claim holds on the prefill node (the decode node reads well within)."""


MAX_ABORT_IDS = 1024


@dataclass(frozen=True)
class AbortRequest:
    """`POST /v1/abort_requests`: the ids to abort or release, and the caller's release
    token (none: the caller must hold the admin credential)."""

    ids: tuple[str, ...]
    release_token: str | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AbortRequest:
        """Validated; a bad body is an InvalidRequestError naming the field (a 400)."""
        ids, token = data.get("request_ids"), data.get("release_token")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
            raise InvalidRequestError(
                "request_ids must be a non-empty list of ids", param="request_ids"
            )
        if len(ids) > MAX_ABORT_IDS:
            raise InvalidRequestError(f"at most {MAX_ABORT_IDS} ids per call", param="request_ids")
        if token is not None and not isinstance(token, str):
            raise InvalidRequestError("release_token must be a string", param="release_token")
        return cls(tuple(ids), token or None)


# -- the handshake ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Handshake:
    """`GET /kv/handshake`: who the prefill node is, and how to read its blocks."""

    engine_id: str
    epoch: str
    layout: KVLayout
    transport: TransportInfo

    def to_json(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "epoch": self.epoch,
            "layout": dataclasses.asdict(self.layout),
            "transport": self.transport.to_json_dict(),
        }

    @classmethod
    def from_json(cls, data: Any) -> Handshake:
        """Inverse of `to_json`; raises KeyError/ValueError/TypeError on a bad body."""
        if not isinstance(data, dict):
            raise TypeError("a handshake must be an object")
        engine_id, epoch = data["engine_id"], data["epoch"]
        if not isinstance(engine_id, str) or not isinstance(epoch, str):
            raise TypeError("engine_id and epoch must be strings")
        layout = KVLayout.from_json_dict(data["layout"])
        return cls(engine_id, epoch, layout, TransportInfo.from_json_dict(data["transport"]))
