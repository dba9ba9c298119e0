"""How one attempt of a leg ended, and what follows from it: the one place where the proxy
decides, for each way a leg can end on a node, what the node's health learns, whether the
attempt's handoff is let go, whether another node may take the leg, and how the request
is counted when the attempt ends it.

    leg       ends                 health                 handoff        next
    prefill   OK                   a good leg             (handed on)    the decode leg
              REFUSED (4xx)        a good leg             -              the client gets it
              FAILED (5xx)         a bad leg              -              another prefill node
              BROKEN (timeout..)   a bad leg              released *     another prefill node
              UNREACHABLE          a bad leg, node down   -              another prefill node
              CLIENT_GONE          -                      released *     -
    decode    OK (the head)        a good leg             (the node's)   relay or assemble
              REFUSED (4xx)        a good leg             released       the client gets it
              FAILED (5xx)         a bad leg              released       the client gets it
              BROKEN               a bad leg              released       the client gets it
              UNREACHABLE          a bad leg, node down   kept           another decode node
              CLIENT_GONE          -                      released       -
    answer    OK                   -                      -              done
    (after    FAILED (error event) -                      -              the client gets it
    the head) BROKEN (mid-stream)  a bad leg              released       the client gets it
              CLIENT_GONE          -                      -              (the node frees)

    * by the attempt's own release token: the answer, and with it the handoff id, may
      never have reached the proxy.

A released handoff that the decode node already read is a no-op on the prefill node. The
request's outcome (`pdserve_proxy_requests{outcome}`) is `ok`, `client_gone`, or
`upstream_error` for every other end that ends it; each attempt also counts in
`pdserve_proxy_attempts{leg, end}`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Leg(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    """Until the decode node's answer head: the leg may still move to another node."""
    ANSWER = "answer"
    """The decode node answered 200: its stream relayed, or an answer assembled from it."""


class End(enum.Enum):
    OK = "ok"
    REFUSED = "refused"
    """An error status below 500: the request's own fault, which any node would find."""
    FAILED = "failed"
    """An error status of 500 or above, or an error event that ended a stream."""
    BROKEN = "broken"
    """A timeout, a broken connection or a body that does not parse: the node may have
    started on it."""
    UNREACHABLE = "unreachable"
    """The connection was never made: the node never saw the leg."""
    CLIENT_GONE = "client_gone"


@dataclass(frozen=True)
class Consequence:
    leg_ok: bool | None
    """The node's circuit breaker learns a good (True) or bad (False) leg; None: nothing
    about the node."""
    node_down: bool
    """Counted as a failed health check too: the node may be gone."""
    release: bool
    """The attempt's handoff is let go now."""
    retry: bool
    """Another node may take the leg."""


_P, _D, _A = Leg.PREFILL, Leg.DECODE, Leg.ANSWER
CONSEQUENCES: dict[tuple[Leg, End], Consequence] = {
    # (leg, end):         leg_ok, node_down, release, retry
    (_P, End.OK): Consequence(True, False, False, False),
    (_P, End.REFUSED): Consequence(True, False, False, False),
    (_P, End.FAILED): Consequence(False, False, False, True),
    (_P, End.BROKEN): Consequence(False, False, True, True),
    (_P, End.UNREACHABLE): Consequence(False, True, False, True),
    (_P, End.CLIENT_GONE): Consequence(None, False, True, False),
    (_D, End.OK): Consequence(True, False, False, False),
    (_D, End.REFUSED): Consequence(True, False, True, False),
    (_D, End.FAILED): Consequence(False, False, True, False),
    (_D, End.BROKEN): Consequence(False, False, True, False),
    (_D, End.UNREACHABLE): Consequence(False, True, False, True),
    (_D, End.CLIENT_GONE): Consequence(None, False, True, False),
    (_A, End.OK): Consequence(None, False, False, False),
    (_A, End.FAILED): Consequence(None, False, False, False),
    (_A, End.BROKEN): Consequence(False, False, True, False),
    (_A, End.CLIENT_GONE): Consequence(None, False, False, False),
}  # fmt: skip


def request_outcome(end: End) -> str:
    """The request's outcome label, for the end that ended it."""
    return {End.OK: "ok", End.CLIENT_GONE: "client_gone"}.get(end, "upstream_error")


def end_of_status(status: int) -> End:
    return End.OK if status == 200 else End.REFUSED if status < 500 else End.FAILED
