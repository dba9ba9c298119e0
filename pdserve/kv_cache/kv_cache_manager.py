"""Which blocks each request holds, and prefix-cache lookups for new requests.

A request's blocks cover its tokens in order; token t lives in block t // block_size at
offset t % block_size:

    tokens:  [0 ........ 15][16 ....... 31][32 .. 37]
    blocks:  [  block 7    ][  block 2    ][block 9 ]   (block_size 16, 38 tokens)
             full, hashed   full, hashed   partial: never shared, never hashed

Only full blocks are hashed and shared, so a request only ever writes into blocks it owns
alone. A prefix hit never covers a prompt's last token: the model must run on at least
one token to produce logits for the next.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of `token_ids` (last token excluded)."""
        bs = self.block_size
        hits: list[KVBlock] = []
        parent: BlockHash | None = None
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _num_needed(
        self, request_id: str, num_total_tokens: int, cached_prefix: Sequence[KVBlock]
    ) -> int:
        """New blocks from the pool that `num_total_tokens` need (0 if held already)."""
        held = self._blocks.get(request_id, [])
        return max(-(-num_total_tokens // self.block_size) - len(held) - len(cached_prefix), 0)

    def _fits(self, num_needed: int, cached_prefix: Sequence[KVBlock]) -> bool:
        reserved = self.pool.num_evictable_among(cached_prefix)
        return num_needed <= self.pool.num_free_blocks - reserved

    def can_allocate(
        self, request_id: str, num_total_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> bool:
        """Whether `allocate` with these arguments would succeed now."""
        return self._fits(
            self._num_needed(request_id, num_total_tokens, cached_prefix), cached_prefix
        )

    def allocate(
        self,
        request_id: str,
        num_total_tokens: int,
        cached_prefix: Sequence[KVBlock] = (),
    ) -> bool:
        """Grow the request's blocks to cover `num_total_tokens`; False if the pool is short.

        `cached_prefix` (first allocation only) are prefix-cache hits to share.
        """
        num_needed = self._num_needed(request_id, num_total_tokens, cached_prefix)
        if not self._fits(num_needed, cached_prefix):
            return False
        self.pool.touch(cached_prefix)
        new_blocks = [*cached_prefix, *self.pool.allocate(num_needed)]
        self._blocks.setdefault(request_id, []).extend(new_blocks)
        return True

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Hash blocks that became full now that `num_computed` tokens are in the cache."""
        blocks = self._blocks.get(request_id)
        if blocks is None or not self.pool.enable_caching:
            return
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_computed // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))
            self.pool.cache(blocks[i], hashes[-1])

    def free(self, request_id: str) -> None:
        """Release every block of the request (tail first, for eviction order). Idempotent."""
        blocks = self._blocks.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks
