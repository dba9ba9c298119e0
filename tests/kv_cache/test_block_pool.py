"""BlockPool: reference counts, the free queue (eviction order) and the hash index."""

from __future__ import annotations

import random

import pytest

from pdserve.kv_cache.block_pool import BlockPool, hash_block


def make_pool(num_blocks: int = 8, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, enable_caching)


# -- allocate / free and reference counts ------------------------------------------------


def test_allocate_hands_out_distinct_blocks_with_one_reference() -> None:
    pool = make_pool(8)
    blocks = pool.allocate(3)
    assert len({b.block_id for b in blocks}) == 3
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 5


def test_allocate_more_than_free_raises() -> None:
    pool = make_pool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_block_returns_to_free_queue_only_when_last_reference_drops() -> None:
    pool = make_pool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2

    pool.free([block])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 3

    pool.free([block])
    assert block.ref_count == 0
    assert pool.num_free_blocks == 4


def test_double_free_raises() -> None:
    pool = make_pool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])
    assert pool.num_free_blocks == 4


def test_free_of_never_allocated_block_raises() -> None:
    pool = make_pool(4)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([pool.blocks[0]])


@pytest.mark.parametrize("seed", range(5))
def test_free_count_equals_pool_size_after_any_mix(seed: int) -> None:
    rng = random.Random(seed)
    pool = make_pool(16)
    held = []  # one entry per reference taken
    for step in range(300):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            blocks = pool.allocate(rng.randint(1, pool.num_free_blocks))
            for b in blocks:
                if rng.random() < 0.5:
                    pool.cache(b, hash_block(None, [seed, step, b.block_id]))
            held.extend(blocks)
        elif op < 0.6 and held:
            block = rng.choice(held)
            pool.touch([block])
            held.append(block)
        elif op < 0.8:
            # touch a cached block that may sit in the free queue (a prefix hit)
            cached = [b for b in pool.blocks if b.block_hash is not None]
            if cached:
                block = rng.choice(cached)
                pool.touch([block])
                held.append(block)
        elif held:
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
        in_use = {b.block_id for b in held}
        assert pool.num_free_blocks == pool.num_blocks - len(in_use)
    pool.free(held)
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


# -- hashing and the prefix-cache index ----------------------------------------------------


def test_hash_block_is_deterministic_and_chained() -> None:
    tokens = [1, 2, 3, 4]
    assert hash_block(None, tokens) == hash_block(None, list(tokens))
    assert hash_block(None, tokens) != hash_block(None, [1, 2, 3, 5])
    parent_a = hash_block(None, [9, 9, 9, 9])
    parent_b = hash_block(None, [8, 8, 8, 8])
    assert hash_block(parent_a, tokens) != hash_block(parent_b, tokens)
    assert hash_block(parent_a, tokens) != hash_block(None, tokens)


def test_cached_block_is_found_by_its_hash() -> None:
    pool = make_pool(4)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache(block, h)
    assert block.block_hash == h
    assert pool.lookup(h) is block
    assert pool.lookup(hash_block(None, [2, 1])) is None


def test_freed_block_keeps_its_hash_until_evicted() -> None:
    pool = make_pool(4)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache(block, h)
    pool.free([block])
    assert pool.lookup(h) is block
    assert pool.num_free_blocks == 4


def test_caching_disabled_never_records_or_finds_hashes() -> None:
    pool = make_pool(4, enable_caching=False)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache(block, h)
    assert block.block_hash is None
    assert pool.lookup(h) is None


def test_identical_block_keeps_the_first_cached_copy() -> None:
    pool = make_pool(4)
    first, second = pool.allocate(2)
    h = hash_block(None, [1, 2])
    pool.cache(first, h)
    pool.cache(second, h)
    assert pool.lookup(h) is first
    assert second.block_hash is None


def test_hashed_block_is_not_rehashed() -> None:
    pool = make_pool(4)
    (block,) = pool.allocate(1)
    h1, h2 = hash_block(None, [1]), hash_block(None, [2])
    pool.cache(block, h1)
    pool.cache(block, h2)
    assert block.block_hash == h1
    assert pool.lookup(h2) is None


# -- eviction -------------------------------------------------------------------------------


def test_allocate_evicts_the_oldest_freed_block_and_drops_its_hash() -> None:
    pool = make_pool(3)
    a, b, c = pool.allocate(3)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.cache(a, ha)
    pool.cache(b, hb)
    pool.free([a])  # freed first: evicted first
    pool.free([b])
    pool.free([c])

    (taken,) = pool.allocate(1)
    assert taken is a
    assert a.block_hash is None
    assert pool.lookup(ha) is None
    assert pool.lookup(hb) is b  # not needed yet: still cached


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = make_pool(2)
    a, b = pool.allocate(2)
    h = hash_block(None, [1])
    pool.cache(a, h)
    pool.free([a, b])
    assert pool.num_evictable_among([a]) == 1

    pool.touch([a])
    assert a.ref_count == 1
    assert pool.num_free_blocks == 1
    assert pool.num_evictable_among([a]) == 0
    (taken,) = pool.allocate(1)
    assert taken is b  # `a` is in use again, so it cannot be evicted
    assert pool.lookup(h) is a


def test_num_evictable_among_counts_only_unreferenced_blocks() -> None:
    pool = make_pool(4)
    a, b, c = pool.allocate(3)
    pool.free([a, c])
    assert pool.num_evictable_among([a, b, c]) == 2
    assert pool.num_evictable_among([]) == 0
