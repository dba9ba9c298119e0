"""The router's choices and selective P/D, on backends with hand-made summaries (no processes)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pdserve.config import ProxyConfig, RoutingPolicy
from pdserve.errors import ConfigError
from pdserve.kv_cache.prefix_summary import CachedPrefixes, prompt_chain
from pdserve.proxy.pool import Backend, BackendPool
from pdserve.proxy.routing import (
    DECODE_LOAD_TOKENS,
    Prompt,
    Router,
    add_routing_args,
    routing_options,
)

BLOCK = 4
SYSTEM = list(range(100, 132))  # 8 blocks


class ByteTokenizer:
    """Token ids are the bytes of the text (what the router needs: encode, a template)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, str]], tools: Any = None) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def make_router(policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE, min_tokens: int = 0) -> Router:
    return Router(policy, policy, min_tokens, ByteTokenizer())  # type: ignore[arg-type]


def make_pool(role: str = "decode", n: int = 2) -> BackendPool:
    pool = BackendPool(role, [f"http://127.0.0.1:{i + 1}" for i in range(n)])
    for b in pool.backends:
        b.cached = CachedPrefixes(BLOCK, 0, frozenset())
    return pool


def holding(backend: Backend, tokens: list[int]) -> None:
    backend.cached = CachedPrefixes(BLOCK, 1, frozenset(prompt_chain(tokens, BLOCK)))


def test_cache_aware_goes_where_the_prefix_is_unless_the_load_outweighs_it() -> None:
    router, pool = make_router(), make_pool()
    a, b = pool.backends
    holding(b, [*SYSTEM, 1, 2, 3, 4, 5])
    prompt = Prompt([*SYSTEM, 1, 2, 3, 4, 9, 9])
    assert router.choose(pool, prompt) is b  # 36 tokens cached there, none on a
    b.pending_tokens = 30  # a prefill queued there: still cheaper than 36 tokens
    assert router.choose(pool, prompt) is b
    b.pending_tokens = 40
    assert router.choose(pool, prompt) is a
    b.pending_tokens = 0
    b.num_outstanding = 2  # decodes running there: 2 x DECODE_LOAD_TOKENS > 36
    assert 2 * DECODE_LOAD_TOKENS > 36 and router.choose(pool, prompt) is a
    prefill = make_pool("prefill")
    holding(prefill.backends[1], [*SYSTEM, 1, 2, 3, 4, 5])
    prefill.backends[1].num_outstanding = 2  # on a prefill node only pending tokens count
    assert router.choose(prefill, prompt) is prefill.backends[1]


def test_a_leg_counts_the_tokens_it_makes_its_node_compute() -> None:
    router, pool = make_router(), make_pool()
    a, b = pool.backends
    holding(b, [*SYSTEM, 1])
    prompt = Prompt([*SYSTEM, 1, 2])
    assert router.tokens_to_compute(a, prompt, reads_kv=False) == 34
    assert router.tokens_to_compute(b, prompt, reads_kv=False) == 2
    assert router.tokens_to_compute(a, prompt, reads_kv=True) == 0  # a decode leg reads it
    assert router.tokens_to_compute(a, None, reads_kv=False) == 0


def test_without_a_prompt_or_with_least_loaded_the_load_decides() -> None:
    pool = make_pool()
    a, b = pool.backends
    holding(b, [*SYSTEM, 1])
    a.num_outstanding, b.num_outstanding = 0, 1
    prompt = Prompt([*SYSTEM, 1, 2])
    assert make_router().choose(pool, None) is a
    assert make_router(RoutingPolicy.LEAST_LOADED).choose(pool, prompt) is a


def test_round_robin_takes_each_up_node_in_turn() -> None:
    router, pool = make_router(RoutingPolicy.ROUND_ROBIN), make_pool(n=3)
    picks = [router.choose(pool, None) for _ in range(6)]
    assert [p.url[-1] for p in picks if p] == list("123123")
    pool.backends[1].up = False
    assert {p.url for p in (router.choose(pool, None) for _ in range(4)) if p} == {
        pool.backends[0].url,
        pool.backends[2].url,
    }


def test_a_prompt_sent_counts_as_cached_before_the_summary_says_so() -> None:
    router, pool = make_router(), make_pool()
    a, b = pool.backends
    turn = Prompt([*SYSTEM, 5, 6])
    router.sent(b, turn)
    a.num_outstanding = 0
    assert router.choose(pool, Prompt([*SYSTEM, 5, 6, 7, 8])) is b


def test_a_failed_leg_s_blocks_count_as_they_did_before_it_was_sent() -> None:
    from pdserve.proxy.routing import num_cached_tokens

    router, pool = make_router(), make_pool()
    b = pool.backends[1]
    first, second, third = (Prompt([*SYSTEM, t, t, t, t]) for t in (1, 2, 3))
    router.sent(b, first)
    lost = router.sent(b, second)
    later = router.sent(b, third)
    router.failed(b, lost)  # the system prompt's blocks: a later leg was sent with them
    assert num_cached_tokens(b, Prompt([*SYSTEM, 2, 2, 2, 2, 0])) == 32  # its own: gone
    assert num_cached_tokens(b, Prompt([*SYSTEM, 3, 3, 3, 3, 0])) == 36
    router.failed(b, later)  # ... and failed too: the first leg's send vouches for them
    assert num_cached_tokens(b, Prompt([*SYSTEM, 3, 3, 3, 3, 0])) == 32
    assert num_cached_tokens(b, Prompt([*SYSTEM, 1, 1, 1, 1, 0])) == 36


def test_selective_pd_runs_short_or_cached_prompts_whole_on_the_decode_node() -> None:
    router, pool = make_router(min_tokens=16), make_pool()
    a, b = pool.backends
    assert router.runs_whole(a, Prompt(list(range(15))))
    assert not router.runs_whole(a, Prompt(list(range(40))))
    holding(b, [*SYSTEM, 1, 2])
    assert router.runs_whole(b, Prompt([*SYSTEM, 1, 2, 3, 4]))  # 32 cached, 4 to compute
    assert not router.runs_whole(b, None)
    assert not make_router(min_tokens=0).runs_whole(a, Prompt([1]))


def test_prompts_are_tokenized_as_the_nodes_do_and_junk_is_left_to_them() -> None:
    router = make_router()
    assert router.prompt({"prompt": "ab"}, chat=False).token_ids == [97, 98]  # type: ignore[union-attr]
    assert router.prompt({"prompt": [5, 6]}, chat=False).token_ids == [5, 6]  # type: ignore[union-attr]
    chat = router.prompt({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert bytes(chat.token_ids) == b"<user>hi<assistant>"  # type: ignore[union-attr, arg-type]
    for body, is_chat in (({"prompt": ["a", "b"]}, False), ({"messages": "x"}, True), ({}, False)):
        assert router.prompt(body, chat=is_chat) is None


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    add_routing_args(parser)
    return parser.parse_args(list(argv))


def test_policies_are_set_for_both_legs_or_each_and_an_unknown_one_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    opts = routing_options(parse("--routing", "round-robin", "--decode-routing", "least-loaded"))
    assert opts["prefill_routing"] is RoutingPolicy.ROUND_ROBIN
    assert opts["decode_routing"] is RoutingPolicy.LEAST_LOADED
    assert routing_options(parse("--model", "none"))["decode_routing"] is RoutingPolicy.LEAST_LOADED
    with pytest.raises(SystemExit):
        parse("--routing", "fastest")
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_cache_aware_without_a_model_and_bad_limits_are_config_errors() -> None:
    urls = {"prefill_urls": ("http://a",), "decode_urls": ("http://b",)}
    with pytest.raises(ConfigError, match="needs the nodes' model"):
        ProxyConfig(**urls, model=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_concurrency"):
        ProxyConfig(**urls, max_concurrency=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="disagg_min_tokens"):
        ProxyConfig(**urls, disagg_min_tokens=-1)  # type: ignore[arg-type]


def test_a_prompt_sent_counts_every_full_block_for_the_next_longer_prompt() -> None:
    """The node holds all of a computed prompt's full blocks, the last one too (it only
    cannot serve a prompt its own last token): a turn that extends it reuses all."""
    from pdserve.proxy.routing import num_cached_tokens

    router, pool = make_router(), make_pool()
    b = pool.backends[1]
    router.sent(b, Prompt(SYSTEM))  # 8 full blocks of 4
    assert num_cached_tokens(b, Prompt([*SYSTEM, 1, 2])) == 32
    assert num_cached_tokens(b, Prompt(SYSTEM)) == 28  # its own last token: never a hit
