"""HTTP endpoints of P/D nodes: the control channel (`/kv/*`, prefill nodes; its bodies
are the models of `pdserve.disagg.messages`, shared with the decode node's client) and the
abort API (`/v1/abort_requests`, every node).

Authentication. `/kv/*` calls need the cluster credential (`--cluster-secret`, default the
API key) when the node has one, plus the handoff's release token in the body for anything
that acts on a handoff. `/v1/abort_requests` takes the admin credential (the API key or
the cluster secret: any request) or a `release_token` (the handoffs it was minted for,
only, named by handoff id or by their leg's X-Request-Id); without either the answer is
401, with a token that does not match every id (another handoff's, or ids this node does
not know) 403, and in both cases nothing is touched.
A request the admin aborts while its client waits is answered 409 `request_aborted` (an
error event, then `[DONE]`, if its stream had started), never as a completion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.disagg.handoff import HandoffTable
from pdserve.disagg.handoff_service import HandoffService
from pdserve.disagg.messages import (
    AbortOutcome,
    AbortRequest,
    ClaimBody,
    ClaimReply,
    Outcome,
    OutcomeReply,
    RefBody,
    ReleaseBody,
    RenewBody,
    RenewReply,
)
from pdserve.errors import PdserveError, RequestAbortedError, StatusError
from pdserve.openai_api.auth import bearer_matches
from pdserve.openai_api.errors import error_response, from_exception, read_json, validate_body

if TYPE_CHECKING:
    from pdserve.api.state import ServerState

MAX_CONTROL_BODY_BYTES = 1 << 20

Body = TypeVar("Body", bound=BaseModel)


def disagg_routes(state: ServerState) -> list[Route]:
    routes = [Route("/v1/abort_requests", _endpoint(state, abort_requests), methods=["POST"])]
    if state.legs.handoffs is not None:
        routes += [
            Route("/kv/handshake", _endpoint(state, handshake), methods=["GET"]),
            Route("/kv/renew", _endpoint(state, renew), methods=["POST"]),
            Route("/kv/claim", _endpoint(state, claim), methods=["POST"]),
            Route("/kv/done", _endpoint(state, done), methods=["POST"]),
            Route("/kv/failed", _endpoint(state, failed), methods=["POST"]),
            Route("/kv/release", _endpoint(state, release), methods=["POST"]),
        ]
    return routes


Handler = Callable[["ServerState", Request], Any]


def _endpoint(state: ServerState, handler: Handler) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(state, request)
        except PdserveError as e:
            return from_exception(e)

    return endpoint


def is_admin(state: ServerState, request: Request) -> bool:
    given = request.headers.get("authorization", "").encode("latin-1")
    return bearer_matches(given, state.api_key, state.cluster_secret)


async def _body(request: Request, model: type[Body]) -> Body:
    return validate_body(await read_json(request, MAX_CONTROL_BODY_BYTES), model)


def _service(state: ServerState) -> HandoffService:
    if state.legs.handoffs is None:  # unreachable: the routes exist only on prefill nodes
        raise StatusError("not a prefill node", status=404, error_type="not_found_error")
    return state.legs.handoffs


def _reply(reply: BaseModel) -> Response:
    return JSONResponse(reply.model_dump(mode="json"))


# -- control channel (prefill nodes) ---------------------------------------------------


async def handshake(state: ServerState, request: Request) -> Response:
    return JSONResponse(_service(state).handshake().to_json())


async def renew(state: ServerState, request: Request) -> Response:
    body = await _body(request, RenewBody)
    table = _service(state).table
    outcomes = [table.renew(r.handoff_id, r.release_token, r.epoch) for r in body.handoffs]
    return _reply(RenewReply(outcomes=outcomes))


async def claim(state: ServerState, request: Request) -> Response:
    body = await _body(request, ClaimBody)
    service = _service(state)
    outcome = await service.apply(
        lambda t: t.claim(body.handoff_id, body.release_token, body.epoch, body.block_ids)
    )
    return _reply(ClaimReply(outcome=outcome, claim_timeout_s=service.table.claim_timeout_s))


async def done(state: ServerState, request: Request) -> Response:
    return await _finish_read(state, request, ok=True)


async def failed(state: ServerState, request: Request) -> Response:
    return await _finish_read(state, request, ok=False)


async def _finish_read(state: ServerState, request: Request, ok: bool) -> Response:
    body = await _body(request, RefBody)
    outcome = await _service(state).apply(
        lambda t: t.finish_read(body.handoff_id, body.release_token, body.epoch, ok=ok)
    )
    return _reply(OutcomeReply(outcome=outcome))


async def release(state: ServerState, request: Request) -> Response:
    body = await _body(request, ReleaseBody)

    def act(table: HandoffTable) -> Outcome:
        return table.release(
            body.handoff_id, body.release_token, body.epoch, reason=body.reason.as_recorded
        )

    outcome = await _service(state).apply(act)
    return _reply(OutcomeReply(outcome=outcome))


# -- the abort API (every node) -----------------------------------------------------------


async def abort_requests(state: ServerState, request: Request) -> Response:
    admin = is_admin(state, request)
    body = AbortRequest.from_json(await read_json(request, MAX_CONTROL_BODY_BYTES))
    ids, token = list(body.ids), body.release_token
    if not admin and not token:
        return error_response(
            401, "the admin API key or a release token is required", "authentication_error"
        )
    if not admin and not _token_covers(state, ids, str(token)):
        return error_response(403, "the release token does not cover every id", "permission_error")
    results = {i: AbortOutcome.NOT_FOUND for i in ids}
    running = {i: state.live.resolve(i) for i in ids} if admin else {}
    running_ids = sorted(set().union(*running.values()))
    if running_ids:  # before the handoffs' aborts, which abort prefill legs with no error
        await state.client.abort(running_ids, _aborted_by_operator())
    if state.legs.handoffs is not None:
        results.update(await state.legs.handoffs.abort(ids, token if not admin else None, admin))
    results.update({i: AbortOutcome.ABORTED for i, request_ids in running.items() if request_ids})
    return JSONResponse({"results": [{"id": i, "outcome": results[i].value} for i in ids]})


def _aborted_by_operator() -> RequestAbortedError:
    return RequestAbortedError(
        "aborted by the server: an operator aborted this request (POST /v1/abort_requests)"
    )


def _token_covers(state: ServerState, ids: list[str], token: str) -> bool:
    """A release token acts on its own handoffs only (`HandoffTable.covers`)."""
    return state.legs.handoffs is not None and state.legs.handoffs.table.covers(ids, token)
