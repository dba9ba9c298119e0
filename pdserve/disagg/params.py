"""Both processes: `kv_transfer_params`, what the two legs of a P/D request say about the
prompt's KV (parsed in the API process, carried to the engine's connector), and
`KVLayout`, what two nodes must share to exchange it (built in the engine process).

At the HTTP edge they use vLLM's field names (so existing P/D proxies can drive pdserve
nodes) plus pdserve's own; inside the engine they become one of two frozen types that
ride on the request for the KV connector:

    prefill leg  {"do_remote_decode": true[, "release_token"]} → RemoteDecode
    its answer   {"do_remote_prefill": true, "remote_*": …,
                  "epoch", "release_token", "lease_s",
                  "first_token_id"[, "first_token_logprobs"]}  (built by the prefill node)
    decode leg   that answer, passed through by the proxy      → RemotePrefill
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from pdserve.disagg.config import KVTransferConfig
from pdserve.disagg.transport import TransportInfo
from pdserve.engine.kv_types import KVHandshakeInfo, KVTransferSpec, RemoteToken
from pdserve.errors import InvalidRequestError
from pdserve.outputs import TokenLogprob

if TYPE_CHECKING:
    import torch

    from pdserve.outputs import RequestOutput


class FirstTokenLogprobs(BaseModel):
    """The prefill leg's logprob entry for its token: its logprob, and the top-n
    (token id, logprob) pairs, as the sampler computed them."""

    model_config = ConfigDict(extra="ignore")

    logprob: float
    top: list[tuple[int, float]]


class KVTransferParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # vLLM's fields
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    """The handoff id on the prefill node."""
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    # pdserve's fields
    epoch: str | None = None
    release_token: str | None = None
    lease_s: float | None = None
    first_token_id: int | None = None
    """The token the prefill leg sampled. A pdserve decode node continues from it over the
    KV of every prompt position, so P/D computes exactly what one node computes (a node
    recomputing the last position instead, as vLLM's decode does, rounds it differently
    in bf16). Absent (a vLLM prefill node): the decode node recomputes that position."""
    first_token_logprobs: FirstTokenLogprobs | None = None
    """The first token's logprob entry, when the prefill leg asked for logprobs."""


@dataclass(frozen=True)
class RemoteDecode(KVTransferSpec):
    """Prefill leg: keep the prompt's KV pinned for a remote decode node."""

    release_token: str | None = None
    """The caller's token for the handoff, else the node mints one. The proxy chooses it so
    that it can release an attempt it abandons (its client left, the leg timed out) even
    when the answer, and so the handoff id, never reached it."""


MIN_TOKEN_CHARS, MAX_TOKEN_CHARS = 22, 128
_TOKEN_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def is_valid_release_token(token: str) -> bool:
    """A caller-chosen release token is hard enough to guess."""
    return MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS and set(token) <= _TOKEN_ALPHABET


def remote_decode_from(params: KVTransferParams) -> RemoteDecode:
    """Validate a prefill leg's params: a chosen token must be hard to guess (400 if not)."""
    token = params.release_token
    if token is not None and not is_valid_release_token(token):
        raise InvalidRequestError(
            f"kv_transfer_params.release_token must be {MIN_TOKEN_CHARS}-{MAX_TOKEN_CHARS} "
            "URL-safe base64 characters (secrets.token_urlsafe(24) makes one)",
            param="kv_transfer_params.release_token",
        )
    return RemoteDecode(release_token=token)


@dataclass(frozen=True)
class HandoffRef:
    """What every control message about one handoff carries."""

    handoff_id: str
    release_token: str
    epoch: str | None = None


@dataclass(frozen=True)
class RemotePrefill(KVTransferSpec):
    """Decode leg: the prompt's KV sits in `block_ids` on the prefill node at `control_url`."""

    ref: HandoffRef
    engine_id: str
    control_url: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_s: float
    first_token: RemoteToken | None = None
    """The token the prefill leg sampled after the prompt (`first_token_id`), if sent."""


def remote_prefill_from(params: KVTransferParams, scheme: str = "http") -> RemotePrefill:
    """Validate a decode leg's params; a missing field is a 400 naming it. `scheme`: how
    this node reaches the prefill node (its own: `https` with TLS, `pdserve/tls.py`)."""
    required = (
        "remote_request_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_num_tokens",
        "release_token",
    )
    missing = [name for name in required if getattr(params, name) is None]
    if missing:
        raise InvalidRequestError(
            f"kv_transfer_params for a decode leg lack {', '.join(missing)}",
            param="kv_transfer_params",
        )
    assert params.remote_block_ids is not None and params.remote_num_tokens is not None
    if params.remote_num_tokens < 1 or any(b < 0 for b in params.remote_block_ids):
        raise InvalidRequestError(
            "kv_transfer_params: remote_num_tokens must be >= 1 and block ids >= 0",
            param="kv_transfer_params",
        )
    return RemotePrefill(
        ref=HandoffRef(str(params.remote_request_id), str(params.release_token), params.epoch),
        engine_id=params.remote_engine_id or "",
        control_url=f"{scheme}://{params.remote_host}:{params.remote_port}",
        block_ids=tuple(params.remote_block_ids),
        num_tokens=params.remote_num_tokens,
        lease_s=params.lease_s or KVTransferConfig.lease_s,
        first_token=_first_token(params),
    )


def _first_token(params: KVTransferParams) -> RemoteToken | None:
    """The prefill leg's token as sent; the decode node's connector checks that it is a
    token of its model (else it recomputes the last prompt position instead)."""
    if params.first_token_id is None:
        return None
    entry = params.first_token_logprobs
    logprob = None
    if entry is not None:
        logprob = TokenLogprob(params.first_token_id, entry.logprob, list(entry.top))
    return RemoteToken(params.first_token_id, logprob)


def first_token_params(output: RequestOutput) -> dict[str, Any]:
    """A prefill leg's sampled token (and its logprob entry) for its answer's params."""
    completion = output.outputs[0] if output.outputs else None
    if completion is None or not completion.token_ids:
        return {}
    fields: dict[str, Any] = {"first_token_id": completion.token_ids[0]}
    if completion.logprobs:
        entry = completion.logprobs[0]
        fields["first_token_logprobs"] = FirstTokenLogprobs(logprob=entry.logprob, top=entry.top)
    return fields


@dataclass(frozen=True)
class KVLayout:
    """What two nodes must share for one to read the other's blocks (checked at handshake)."""

    model_fingerprint: str
    kv_cache_dtype: str
    """The cache's format (kv_format.py): the model's dtype, or int8 with its scales."""
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int

    @classmethod
    def from_json_dict(cls, data: Any) -> KVLayout:
        """From the handshake's JSON; raises KeyError/TypeError on a bad dict."""
        if not isinstance(data, dict):
            raise TypeError("a KV layout must be an object")
        values = {f.name: data[f.name] for f in fields(cls)}
        for f in fields(cls):
            wanted = str if f.type == "str" else int
            if type(values[f.name]) is not wanted:
                raise TypeError(f"KV layout field {f.name} must be {wanted.__name__}")
        return cls(**values)

    def mismatch(self, other: KVLayout) -> str | None:
        """A readable description of the first difference, or None when compatible."""
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs (this node: {mine}, prefill node: {theirs})"
        return None


@dataclass(frozen=True)
class NodeKVInfo(KVHandshakeInfo):
    """What a P/D node's engine publishes for the handshake (`KVConnector.handshake_info`)."""

    layout: KVLayout
    transport: TransportInfo


def model_fingerprint(model: torch.nn.Module, arch_repr: str) -> str:
    """Shapes plus a sample of the weights: equal only for the same model and weights."""
    h = hashlib.blake2b(arch_repr.encode(), digest_size=8)
    for name, tensor in sorted(model.state_dict().items())[:4]:
        h.update(name.encode())
        h.update(tensor.flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()
