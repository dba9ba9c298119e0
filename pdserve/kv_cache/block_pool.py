"""The pool of KV blocks: reference counts, the free queue and the prefix cache.

Life of a block:

    free, no hash ──allocate──▶ in use (ref ≥ 1) ──last free──▶ free, hashed (cached)
         ▲                         ▲    │ full block computed:        │    │
         │                         │    └ cache() gives it a hash     │    │
         │                         └──────── touch() (prefix hit) ────┘    │
         └────────────── allocate() evicts: drops the hash ────────────────┘

A freed block keeps its hash and contents, so a later request with the same prefix can
reuse it until `allocate` takes it for someone else. The free queue is ordered for
eviction: blocks freed earlier go first, and a request frees its blocks tail first so the
start of a prefix (the part most likely shared) is evicted last.

`num_free_blocks` counts every block with ref_count 0, cached or not; when the engine is
idle it equals the pool size (invariant 1 of the design).

With `record_events` on (a serving node), every hash that enters or leaves the prefix
cache is also queued for `take_events`: the API process keeps an index of them that the
proxy routes by (`kv_cache/prefix_summary.py`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained content hash: a block's hash covers every token before it too."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.record_events = False
        self._events: list[tuple[bool, BlockHash]] = []
        """(stored, hash) in order, while `record_events` is on."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` free blocks (evicting cached ones); the caller checked capacity."""
        if count > len(self._free):
            raise RuntimeError(f"allocate({count}) with only {len(self._free)} free blocks")
        out = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.record_events:
                    self._events.append((False, block.block_hash))
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference to cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; unreferenced ones join the free queue."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record a full block's content hash so later prompts can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:  # an identical block is already cached: keep that one
            block.block_hash = block_hash
            self._cached[block_hash] = block
            if self.record_events:
                self._events.append((True, block_hash))

    def take_events(self) -> list[tuple[bool, BlockHash]]:
        """The prefix cache's changes since the last call: (stored, hash), oldest first."""
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def num_evictable_among(self, blocks: Iterable[KVBlock]) -> int:
        """How many of `blocks` sit in the free queue (touching them shrinks it)."""
        return sum(1 for b in blocks if b.ref_count == 0)
