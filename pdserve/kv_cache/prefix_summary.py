"""What a node's prefix cache holds, told to the proxy so that it can route by it.

Where each piece runs:

    engine process   BlockPool (record_events) queues (stored, hash) for every block hash
                     that enters or leaves the prefix cache; StepOutputs carry them
    node API process PrefixIndex applies them in order → GET /admin/prefix_cache answers
                     a PrefixCacheSummary (the set, each hash cut to 8 bytes, base64)
    proxy            parse_summary → CachedPrefixes; prompt_chain(token ids) hashes the
                     request's full blocks the way the node does, and `num_cached_tokens`
                     counts the leading ones the node holds

The proxy's count is exact, not an estimate from past routing decisions (vllm-router's
approximate tree): the hashes are the node's own chained content hashes (`hash_block`),
so a hit means the node will reuse those blocks, unless it evicts them before the request
arrives. An 8-byte cut keeps the summary small (about 11 characters of base64 per
block); a false match needs a 64-bit collision, and costs only a worse route.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.kv_cache.block_pool import BlockHash, hash_block

HASH_BYTES = 8
"""Each hash's first bytes in a summary."""


class PrefixCacheSummary(BaseModel):
    """`GET /admin/prefix_cache`: the node's cached block hashes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    block_size: int
    version: int
    """Bumped by every change; `?since=VERSION` answers `unchanged` when it still holds."""
    num_hashes: int
    hashes: str
    """base64 of the concatenated `HASH_BYTES`-byte cuts, in no particular order."""


class PrefixIndex:
    """The node API process's copy of its engine's prefix cache (hash cuts)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.version = 0
        self._counts: dict[bytes, int] = {}
        """Cut → how many cached blocks have it (two full hashes may share a cut)."""

    def apply(self, events: Iterable[tuple[bool, BlockHash]]) -> None:
        for stored, block_hash in events:
            cut = block_hash[:HASH_BYTES]
            if stored:
                self._counts[cut] = self._counts.get(cut, 0) + 1
            elif (n := self._counts.get(cut, 0)) > 1:
                self._counts[cut] = n - 1
            else:
                self._counts.pop(cut, None)
            self.version += 1

    def __len__(self) -> int:
        return len(self._counts)

    def summary(self) -> PrefixCacheSummary:
        packed = base64.b64encode(b"".join(self._counts)).decode()
        return PrefixCacheSummary(
            block_size=self.block_size,
            version=self.version,
            num_hashes=len(self._counts),
            hashes=packed,
        )


class MalformedSummary(ValueError):
    """A node's summary that does not parse: the proxy ignores it, counts and logs it."""


@dataclass(frozen=True)
class CachedPrefixes:
    """The proxy's view of one node's prefix cache."""

    block_size: int
    version: int
    hashes: frozenset[bytes]

    def num_cached_tokens(self, chain: Sequence[bytes]) -> int:
        """Tokens at the start of a prompt whose blocks the node holds (`chain` is
        `prompt_chain` of the prompt for this block size)."""
        n = 0
        for cut in chain:
            if cut not in self.hashes:
                break
            n += 1
        return n * self.block_size


EMPTY = CachedPrefixes(block_size=1, version=-1, hashes=frozenset())


def parse_summary(data: object) -> CachedPrefixes:
    """A node's `/admin/prefix_cache` body, checked; MalformedSummary if it is not one."""
    try:
        summary = PrefixCacheSummary.model_validate(data)
        packed = base64.b64decode(summary.hashes, validate=True)
    except (ValidationError, binascii.Error, ValueError) as e:
        raise MalformedSummary(str(e)) from e
    if summary.block_size < 1 or len(packed) != summary.num_hashes * HASH_BYTES:
        raise MalformedSummary(
            f"block_size {summary.block_size}, {len(packed)} bytes for "
            f"{summary.num_hashes} hashes of {HASH_BYTES}"
        )
    cuts = frozenset(packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES))
    return CachedPrefixes(summary.block_size, summary.version, cuts)


def prompt_chain(token_ids: Sequence[int], block_size: int, stored: bool = False) -> list[bytes]:
    """The cuts of a prompt's full-block hashes, as a node would look them up: the last
    token is never a hit (`KVCacheManager.find_cached_prefix`). `stored`: every full block
    instead, as the node holds them once it has computed the prompt."""
    chain: list[bytes] = []
    parent: BlockHash | None = None
    num_blocks = len(token_ids) // block_size if stored else (len(token_ids) - 1) // block_size
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        chain.append(parent[:HASH_BYTES])
    return chain
