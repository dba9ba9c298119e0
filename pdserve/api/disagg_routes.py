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
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.disagg import control_plane
from pdserve.disagg.handoff_service import HandoffService
from pdserve.disagg.messages import AbortOutcome, AbortRequest
from pdserve.errors import PdserveError, RequestAbortedError, StatusError
from pdserve.openai_api.auth import bearer_matches
from pdserve.openai_api.errors import from_exception, read_json

if TYPE_CHECKING:
    from pdserve.api.state import ServerState


def disagg_routes(state: ServerState) -> list[Route]:
    routes = [Route("/v1/abort_requests", _endpoint(state, abort_requests), methods=["POST"])]
    if state.legs.handoffs is not None:
        routes.append(Route("/kv/handshake", _endpoint(state, handshake), methods=["GET"]))
        routes += [
            Route(path, _endpoint(state, control), methods=["POST"])
            for path in control_plane.ROUTES
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


def _service(state: ServerState) -> HandoffService:
    if state.legs.handoffs is None:  # unreachable: the routes exist only on prefill nodes
        raise StatusError("not a prefill node", status=404, error_type="not_found_error")
    return state.legs.handoffs


# -- control channel (prefill nodes; the rules: disagg/control_plane.py) ---------------


async def handshake(state: ServerState, request: Request) -> Response:
    return JSONResponse(_service(state).handshake().to_json())


async def control(state: ServerState, request: Request) -> Response:
    """The node's control credential is checked by its auth middleware (server.py)."""
    data = await read_json(request, control_plane.MAX_BODY_BYTES)
    operation = control_plane.operation(request.url.path, data)
    result = await _service(state).apply(operation.act)
    return JSONResponse(operation.answer(result).model_dump(mode="json"))


# -- the abort API (every node) -----------------------------------------------------------


async def abort_requests(state: ServerState, request: Request) -> Response:
    admin = is_admin(state, request)
    body = AbortRequest.from_json(await read_json(request, control_plane.MAX_BODY_BYTES))
    ids, token = list(body.ids), body.release_token
    control_plane.authorize_abort(admin, token, lambda: _token_covers(state, ids, str(token)))
    running = {i: state.live.resolve(i) for i in ids} if admin else {}
    running_ids = sorted(set().union(*running.values()))
    if running_ids:  # before the handoffs' aborts, which abort prefill legs with no error
        await state.client.abort(running_ids, _aborted_by_operator())
    results: dict[str, AbortOutcome] = {}
    if state.legs.handoffs is not None:
        results.update(await state.legs.handoffs.abort(ids, token if not admin else None, admin))
    results.update({i: AbortOutcome.ABORTED for i, request_ids in running.items() if request_ids})
    return JSONResponse(control_plane.abort_answer(ids, results))


def _aborted_by_operator() -> RequestAbortedError:
    return RequestAbortedError(
        "aborted by the server: an operator aborted this request (POST /v1/abort_requests)"
    )


def _token_covers(state: ServerState, ids: list[str], token: str) -> bool:
    """A release token acts on its own handoffs only (`HandoffTable.covers`)."""
    return state.legs.handoffs is not None and state.legs.handoffs.table.covers(ids, token)
