"""KVCacheManager: per-request blocks, prefix-cache lookups and their accounting."""

from __future__ import annotations

import random

import pytest

from pdserve.kv_cache.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4


def make_manager(
    num_blocks: int = 8, block_size: int = BLOCK_SIZE, enable_caching: bool = True
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_caching)


def tokens(num_tokens: int, first: int = 100) -> list[int]:
    return list(range(first, first + num_tokens))


def compute(kv: KVCacheManager, request_id: str, token_ids: list[int]) -> None:
    """Allocate for `token_ids` with any prefix hits and mark them all computed."""
    hits = kv.find_cached_prefix(token_ids)
    assert kv.allocate(request_id, len(token_ids), hits)
    kv.cache_full_blocks(request_id, token_ids, len(token_ids))


# -- allocate / free ------------------------------------------------------------------------


def test_allocate_rounds_up_to_whole_blocks_and_only_grows_when_needed() -> None:
    kv = make_manager(8)
    assert kv.allocate("a", 9)
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate("a", 12)
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate("a", 13)
    assert len(kv.block_ids("a")) == 4
    assert kv.num_free_blocks == 4
    assert kv.usage() == pytest.approx(0.5)


def test_allocate_returns_false_when_short_and_changes_nothing() -> None:
    kv = make_manager(4)
    assert kv.allocate("a", 12)
    assert not kv.allocate("b", 8)
    assert not kv.holds("b")
    assert kv.num_free_blocks == 1
    assert not kv.allocate("a", 20)  # growing needs 2 more
    assert len(kv.block_ids("a")) == 3


def test_free_releases_every_block() -> None:
    kv = make_manager(8)
    kv.allocate("a", 10)
    kv.allocate("b", 5)
    kv.free("a")
    assert not kv.holds("a")
    assert kv.block_ids("a") == []
    assert kv.num_free_blocks == 6
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks


def test_free_is_idempotent_and_ignores_unknown_ids() -> None:
    kv = make_manager(8)
    kv.allocate("a", 10)
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == kv.num_blocks


# -- prefix cache ----------------------------------------------------------------------------


def test_repeated_prefix_hits_cached_blocks() -> None:
    kv = make_manager(8)
    prompt = tokens(10)
    compute(kv, "a", prompt)
    a_blocks = kv.block_ids("a")

    hits = kv.find_cached_prefix([*prompt[:8], 1, 2, 3])
    assert [b.block_id for b in hits] == a_blocks[:2]  # the two full blocks; the partial one never


def test_prefix_hit_never_covers_the_prompts_last_token() -> None:
    kv = make_manager(8)
    prompt = tokens(8)  # exactly two full blocks
    compute(kv, "a", prompt)
    assert len(kv.find_cached_prefix(prompt)) == 1
    assert len(kv.find_cached_prefix([*prompt, 5])) == 2


def test_prefix_hash_is_chained_over_earlier_blocks() -> None:
    kv = make_manager(16)
    x, y, z, q = tokens(4, 100), tokens(4, 200), tokens(4, 300), tokens(4, 400)
    compute(kv, "a", [*x, *y, 0])  # caches x, then y after x
    compute(kv, "c", [*z, *q, 0])  # caches z
    hits = kv.find_cached_prefix([*z, *y, 0])
    assert [b.block_id for b in hits] == kv.block_ids("c")[:1]  # y after z is a different block


def test_only_full_computed_blocks_are_cached() -> None:
    kv = make_manager(8)
    prompt = tokens(13)
    kv.allocate("a", len(prompt))
    kv.cache_full_blocks("a", prompt, 6)  # one full block computed so far
    assert len(kv.find_cached_prefix(prompt)) == 1
    kv.cache_full_blocks("a", prompt, 13)
    assert len(kv.find_cached_prefix(prompt)) == 3


def test_caching_disabled_finds_no_prefix() -> None:
    kv = make_manager(8, enable_caching=False)
    prompt = tokens(10)
    compute(kv, "a", prompt)
    assert kv.find_cached_prefix(prompt) == []


def test_shared_prefix_blocks_are_reference_counted() -> None:
    kv = make_manager(8)
    prompt = tokens(10)
    compute(kv, "a", prompt)
    hits = kv.find_cached_prefix(prompt)
    assert kv.allocate("b", len(prompt), hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.num_free_blocks == 8 - 3 - 1  # b added only its own last block

    kv.free("a")
    assert kv.num_free_blocks == 8 - 3  # the shared blocks are still b's
    assert [b.block_id for b in kv.find_cached_prefix(prompt)] == kv.block_ids("b")[:2]
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks


def test_freed_prefix_is_evicted_tail_first_and_loses_its_hash() -> None:
    kv = make_manager(4)
    prompt = tokens(9)
    compute(kv, "a", prompt)  # blocks 0,1 full and hashed, block 2 partial
    kv.free("a")
    assert len(kv.find_cached_prefix(prompt)) == 2

    assert kv.allocate("b", 8)  # the never-used block and a's partial tail go first
    assert len(kv.find_cached_prefix(prompt)) == 2
    assert kv.allocate("b", 12)  # needs one more: a's second block is evicted
    assert len(kv.find_cached_prefix(prompt)) == 1
    assert kv.allocate("b", 16)  # and now the first
    assert kv.find_cached_prefix(prompt) == []


def test_allocate_counts_touched_cached_blocks_that_sit_in_the_free_queue() -> None:
    kv = make_manager(4)
    prompt = tokens(9)
    compute(kv, "a", prompt)
    kv.free("a")
    assert kv.num_free_blocks == 4

    hits = kv.find_cached_prefix(prompt)  # 2 cached blocks, both in the free queue
    # 17 tokens = 5 blocks: 3 new on top of 2 hits, but taking the hits leaves only 2 free.
    assert not kv.allocate("b", 17, hits)
    assert not kv.holds("b")
    assert kv.num_free_blocks == 4
    assert len(kv.find_cached_prefix(prompt)) == 2  # nothing was evicted

    assert kv.allocate("b", 16, hits)
    assert kv.num_free_blocks == 0


def test_hits_held_by_another_request_do_not_reserve_free_blocks() -> None:
    kv = make_manager(5)
    prompt = tokens(9)
    compute(kv, "a", prompt)  # 3 blocks in use, 2 free
    hits = kv.find_cached_prefix(prompt)
    assert kv.allocate("b", 16, hits)  # 2 hits (in use, not in the free queue) + 2 new
    assert kv.num_free_blocks == 0


@pytest.mark.parametrize("seed", range(5))
def test_free_count_equals_pool_size_after_any_mix(seed: int) -> None:
    rng = random.Random(seed)
    kv = make_manager(12)
    prefixes = [tokens(8, 100), tokens(8, 200)]
    live: dict[str, list[int]] = {}
    for i in range(200):
        if live and rng.random() < 0.4:
            request_id = rng.choice(sorted(live))
            if rng.random() < 0.5:
                kv.free(request_id)
                del live[request_id]
            else:  # decode a few tokens
                grown = live[request_id] + [rng.randrange(50)] * rng.randint(1, 5)
                if kv.allocate(request_id, len(grown)):
                    kv.cache_full_blocks(request_id, grown, len(grown))
                    live[request_id] = grown
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            request_id = f"r{i}"
            if kv.allocate(request_id, len(prompt), kv.find_cached_prefix(prompt)):
                kv.cache_full_blocks(request_id, prompt, len(prompt))
                live[request_id] = prompt
        in_use = {b for r in live for b in kv.block_ids(r)}
        assert kv.num_free_blocks == kv.num_blocks - len(in_use)
    for request_id in live:
        kv.free(request_id)
    assert kv.num_free_blocks == kv.num_blocks
