"""The prefix cache's summary: the pool's events, the node's index, the proxy's match."""

from __future__ import annotations

import base64

import pytest

from pdserve.kv_cache.block_pool import hash_block
from pdserve.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.kv_cache.prefix_summary import (
    HASH_BYTES,
    MalformedSummary,
    PrefixIndex,
    parse_summary,
    prompt_chain,
)

BLOCK_SIZE = 4


def cache_prompt(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """What the scheduler does for a prompt that ran: allocate, hash its full blocks, free."""
    assert kv.allocate(request_id, len(tokens), kv.find_cached_prefix(tokens))
    kv.cache_full_blocks(request_id, tokens, len(tokens))
    kv.free(request_id)


def test_events_name_every_hash_stored_and_evicted_in_order() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    kv.pool.record_events = True
    cache_prompt(kv, "a", list(range(9)))  # two full blocks cached, one partial
    first, second = prompt_chain(list(range(9)), BLOCK_SIZE)
    events = kv.pool.take_events()
    assert [(stored, h[:HASH_BYTES]) for stored, h in events] == [(True, first), (True, second)]
    assert kv.pool.take_events() == []
    kv.allocate("b", 3 * BLOCK_SIZE)  # takes every block: both cached ones are evicted
    assert sorted(stored for stored, _ in kv.pool.take_events()) == [False, False]


def test_the_pool_queues_nothing_unless_asked() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    cache_prompt(kv, "a", list(range(9)))
    assert kv.pool.take_events() == []


def test_the_proxy_counts_exactly_the_prefix_the_node_would_reuse() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    kv.pool.record_events = True
    index = PrefixIndex(BLOCK_SIZE)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    cache_prompt(kv, "turn1", [*system, 20, 21, 22, 23, 24])
    index.apply(kv.pool.take_events())
    cached = parse_summary(index.summary().model_dump())
    for prompt in ([*system, 20, 21, 22, 23, 99, 98], [*system, 30, 31], [9, *system], system):
        node = len(kv.find_cached_prefix(prompt)) * BLOCK_SIZE
        assert cached.num_cached_tokens(prompt_chain(prompt, BLOCK_SIZE)) == node


def test_the_index_follows_stores_and_evictions_and_bumps_its_version() -> None:
    index = PrefixIndex(BLOCK_SIZE)
    a, b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [5, 6, 7, 8])
    index.apply([(True, a), (True, b)])
    assert len(index) == 2 and index.version == 2
    index.apply([(False, a)])
    cached = parse_summary(index.summary().model_dump())
    assert cached.hashes == {b[:HASH_BYTES]} and cached.version == 3


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"block_size": 4, "version": 1, "num_hashes": 1},
        {"block_size": 4, "version": 1, "num_hashes": 1, "hashes": "not base64!"},
        {
            "block_size": 4,
            "version": 1,
            "num_hashes": 2,
            "hashes": base64.b64encode(b"x" * 8).decode(),
        },
        {"block_size": 0, "version": 1, "num_hashes": 0, "hashes": ""},
        {"block_size": "four", "version": 1, "num_hashes": 0, "hashes": ""},
    ],
)
def test_a_malformed_summary_is_refused(body: object) -> None:
    with pytest.raises(MalformedSummary):
        parse_summary(body)
