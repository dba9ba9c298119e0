"""The handoff endpoints' rules, once, over `HandoffTable`: what each `/kv/*` message does
to the table and answers, who may send it, and who may release through the abort API.

Two thin HTTP adapters serve them: a pdserve prefill node's Starlette routes
(`pdserve.api.disagg_routes`) and the endpoint `PdserveConnector` opens inside vLLM's
EngineCore (`pdserve.vllm.control_server`, standard-library threads: no event loop in vLLM's
process). An adapter reads the body (at most `MAX_BODY_BYTES`, parsed by
`openai_api.errors.parse_json_object`: any depth or garbage is a 400), asks for the
`Operation` of its path, runs `operation.act` on the table the way its process guards it
(the event loop, or a lock) and frees what it released the way its engine does, then sends
`operation.answer(result)`. Every refusal is a `PdserveError` raised here, so both adapters
send the same status, type and message.

    POST /kv/renew  /kv/claim  /kv/done  /kv/failed  /kv/release
        the cluster credential (when the node has one) + the handoff's release token
    POST /v1/abort_requests  {"request_ids": [...], "release_token"?}
        the node's admin credential, or a release token covering every id
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from pdserve.disagg.handoff import HandoffTable
from pdserve.disagg.messages import (
    AbortOutcome,
    ClaimBody,
    ClaimReply,
    OutcomeReply,
    RefBody,
    ReleaseBody,
    RenewBody,
    RenewReply,
)
from pdserve.errors import StatusError
from pdserve.openai_api.errors import validate_body

MAX_BODY_BYTES = 1 << 20
"""Largest control or abort body either adapter reads (413 beyond)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Operation(Generic[T]):
    """One control message, validated: its table transition and how to answer its result."""

    act: Callable[[HandoffTable], T]
    answer: Callable[[T], BaseModel]


def _renew(body: RenewBody) -> Operation[Any]:
    return Operation(
        lambda t: [t.renew(r.handoff_id, r.release_token, r.epoch) for r in body.handoffs],
        lambda outcomes: RenewReply(outcomes=outcomes),
    )


def _claim(body: ClaimBody) -> Operation[Any]:
    def act(t: HandoffTable) -> tuple[Any, float]:
        outcome = t.claim(body.handoff_id, body.release_token, body.epoch, body.block_ids)
        return outcome, t.claim_timeout_s

    return Operation(act, lambda r: ClaimReply(outcome=r[0], claim_timeout_s=r[1]))


def _finish_read(ok: bool) -> Callable[[RefBody], Operation[Any]]:
    def operation(body: RefBody) -> Operation[Any]:
        return Operation(
            lambda t: t.finish_read(body.handoff_id, body.release_token, body.epoch, ok=ok),
            lambda outcome: OutcomeReply(outcome=outcome),
        )

    return operation


def _release(body: ReleaseBody) -> Operation[Any]:
    reason = body.reason.as_recorded
    return Operation(
        lambda t: t.release(body.handoff_id, body.release_token, body.epoch, reason=reason),
        lambda outcome: OutcomeReply(outcome=outcome),
    )


ROUTES: Mapping[str, tuple[type[BaseModel], Callable[[Any], Operation[Any]]]] = {
    "/kv/renew": (RenewBody, _renew),
    "/kv/claim": (ClaimBody, _claim),
    "/kv/done": (RefBody, _finish_read(ok=True)),
    "/kv/failed": (RefBody, _finish_read(ok=False)),
    "/kv/release": (ReleaseBody, _release),
}
"""Every POST of the control channel: its body's model and its operation."""


def operation(path: str, data: Any) -> Operation[Any]:
    """The validated operation of `POST path` (404 for another path, 400 for a bad body)."""
    if path not in ROUTES:
        raise StatusError(f"no route {path}", status=404, error_type="not_found_error")
    model, build = ROUTES[path]
    return build(validate_body(data, model))


def credential_required() -> StatusError:
    return StatusError(
        "the cluster credential is required", status=401, error_type="authentication_error"
    )


def authorize_control(has_credential: bool, secret: str | None) -> None:
    """`/kv/*` needs the cluster credential when the node has one (release tokens still
    authorize each message about a handoff)."""
    if secret and not has_credential:
        raise credential_required()


def authorize_abort(admin: bool, token: str | None, covers: Callable[[], bool]) -> None:
    """`/v1/abort_requests`: the admin credential, or a token that covers every id (401
    without either, 403 for a token that does not); nothing is touched when refused."""
    if admin:
        return
    if not token:
        raise StatusError(
            "the admin credential or a release token is required",
            status=401,
            error_type="authentication_error",
        )
    if not covers():
        raise StatusError(
            "the release token does not cover every id", status=403, error_type="permission_error"
        )


def abort_answer(ids: Sequence[str], results: Mapping[str, AbortOutcome]) -> dict[str, Any]:
    """The abort API's body: one outcome per id asked for, in order."""
    return {
        "results": [{"id": i, "outcome": results.get(i, AbortOutcome.NOT_FOUND).value} for i in ids]
    }
