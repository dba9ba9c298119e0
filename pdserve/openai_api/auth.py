"""The one bearer-credential check every pdserve HTTP server uses (nodes' edge, the abort
API's admin check, the proxy)."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: bytes, *keys: str | None) -> bool:
    """Whether an `Authorization` header value is `Bearer K` for one of `keys`. Unset keys
    never match; each comparison takes constant time."""
    return any(hmac.compare_digest(authorization, f"Bearer {k}".encode()) for k in keys if k)


def key_matches(authorization: bytes, x_api_key: bytes, *keys: str | None) -> bool:
    """`bearer_matches`, or Anthropic's `x-api-key: K` header (its SDK's credential, for
    `/v1/messages`) for one of `keys`."""
    return bearer_matches(authorization, *keys) or any(
        hmac.compare_digest(x_api_key, k.encode()) for k in keys if k
    )
