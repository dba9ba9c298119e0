"""Which node serves each leg, and whether a request is disaggregated at all.

Life of one decision (`legs.serve_request`):

    the body → `Router.prompt`: the prompt's token ids, tokenized as the nodes do (the
        chat template for messages); None when it cannot be (a batch, a bad body: the
        node will say why), and every policy then falls back to load alone
    decode node first → `Router.choose(decode pool)`
    `Router.runs_whole`: the prompt's tokens that node does not cache are fewer than
        `disagg_min_tokens` → one leg, the whole request on that decode node (a short
        prompt, or a conversation whose history the node holds); else P/D: the prefill
        leg on `Router.choose(prefill pool)`, the decode leg on the node chosen above

Policies (`--routing`, or per leg `--prefill-routing` / `--decode-routing`):
- `least-loaded`: fewest legs in flight from this proxy, then the lowest KV use.
- `round-robin`: each node in turn.
- `cache-aware`: the lowest estimated cost in tokens of compute before this request's
  first token: the prompt tokens the node does not cache, plus the tokens of the legs
  this proxy sent it that have not produced their first token yet (`pending_tokens`),
  plus `DECODE_LOAD_TOKENS` per decode in flight on a decode node (each one slows every
  step of the batch). What a node caches is its own
  summary (`kv_cache/prefix_summary.py`, polled with the health checks), plus the blocks
  of prompts this proxy sent it lately (`Backend.remember`), hashed the same way: a
  summary is up to one poll old, and the next turn of a chat comes right after the last.
  A prefill leg's blocks count from the moment it is sent: a burst of prompts sharing a
  system prompt then goes to one node, whose scheduler computes the shared blocks once.
  Either way a decision costs a few hash lookups per prompt block per node.

Nodes of either role are candidates only while up (`pool.py`: health hysteresis and the
circuit breaker).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import ProxyConfig, RoutingPolicy
from pdserve.errors import PdserveError
from pdserve.kv_cache.prefix_summary import prompt_chain
from pdserve.model.tokenizer import Tokenizer
from pdserve.proxy.pool import Backend, BackendPool

logger = logging.getLogger(__name__)

DECODE_LOAD_TOKENS = 32
"""What one request decoding on a node costs a newcomer there, in prompt tokens: one more
row in every decode step. A judgement, not a measurement: small, so that a conversation
whose history (hundreds of tokens) a decode node holds stays there until that node runs
about history/32 more requests than another; `pdserve bench routing` (docs/benchmarks.md)
is where a better value would show."""
RECENT_S = 10.0
"""How long a prompt this proxy sent a node counts as cached there without its summary
saying so (the summary usually catches up within one poll)."""


@dataclass
class Prompt:
    """A request's prompt as token ids, and its block-hash chains by block size."""

    token_ids: Sequence[int]
    _chains: dict[int, list[bytes]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chain(self, block_size: int) -> list[bytes]:
        """Every full block's hash cut: what a node holds once it computed the prompt. A
        lookup stops one short of a prompt that ends on a block boundary (`lookup`)."""
        if block_size not in self._chains:
            self._chains[block_size] = prompt_chain(self.token_ids, block_size, stored=True)
        return self._chains[block_size]

    def lookup(self, block_size: int) -> list[bytes]:
        """The blocks a node can serve from its cache: never the prompt's last token."""
        return self.chain(block_size)[: (self.num_tokens - 1) // block_size]


class Router:
    def __init__(
        self,
        prefill_policy: RoutingPolicy,
        decode_policy: RoutingPolicy,
        disagg_min_tokens: int,
        tokenizer: Tokenizer | None,
        reads_prompts: bool = True,
    ) -> None:
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self.disagg_min_tokens = disagg_min_tokens
        self.tokenizer = tokenizer
        """None: only token-id prompts are read (a model without a tokenizer)."""
        self.reads_prompts = reads_prompts
        """False: no policy needs the prompt (no cache-aware leg, no selective P/D), so
        none is read and no node's summary is polled."""
        self._turns: dict[str, itertools.count[int]] = {}

    def prompt(self, body: dict[str, Any], chat: bool) -> Prompt | None:
        """The request's prompt as the nodes will tokenize it, or None."""
        if not self.reads_prompts:
            return None
        raw = None if chat else body.get("prompt")
        if isinstance(raw, list) and raw and all(type(t) is int for t in raw):
            return Prompt(raw)
        if self.tokenizer is None or not (chat or isinstance(raw, str)):
            return None  # a batch, a bad body: the node says why
        try:
            if chat:
                from pdserve.openai_api.errors import validate_body
                from pdserve.openai_api.protocol import ChatCompletionRequest

                request = validate_body(body, ChatCompletionRequest)
                spec = request.tool_spec()
                tools = spec.template_tools() if spec is not None else None
                text = self.tokenizer.apply_chat_template(request.chat_messages(), tools=tools)
                ids = self.tokenizer.encode(text)
            else:
                ids = self.tokenizer.encode(str(raw))
        except PdserveError:
            return None  # the node refuses it with the reason
        return Prompt(ids) if ids else None

    def choose(
        self, pool: BackendPool, prompt: Prompt | None, exclude: Collection[str] = frozenset()
    ) -> Backend | None:
        """The node of `pool` for a leg, by the pool's policy; None if none is up."""
        policy = self.policies[pool.role]
        if policy is RoutingPolicy.CACHE_AWARE and prompt is not None:
            return min(pool.candidates(exclude), key=lambda b: self._cost(b, prompt), default=None)
        if policy is RoutingPolicy.ROUND_ROBIN:
            candidates = pool.candidates(exclude)
            if not candidates:
                return None
            turn = next(self._turns.setdefault(pool.role, itertools.count()))
            return candidates[turn % len(candidates)]
        return pool.choose(exclude)

    def _cost(self, backend: Backend, prompt: Prompt) -> tuple[int, float]:
        uncached = prompt.num_tokens - num_cached_tokens(backend, prompt)
        decoding = backend.num_outstanding if backend.role == "decode" else 0
        load = backend.pending_tokens + DECODE_LOAD_TOKENS * decoding
        return uncached + load, backend.kv_usage

    def tokens_to_compute(self, backend: Backend, prompt: Prompt | None, reads_kv: bool) -> int:
        """What a leg sent to `backend` makes it compute before its first token: the prompt
        tokens it does not cache, or none for a decode leg that reads them (`reads_kv`)."""
        if prompt is None or reads_kv:
            return 0
        return prompt.num_tokens - num_cached_tokens(backend, prompt)

    def runs_whole(self, decode: Backend, prompt: Prompt | None) -> bool:
        """Skip the prefill leg: the decode node computes fewer than `disagg_min_tokens`
        of the prompt itself, fewer than a P/D handoff is worth."""
        if prompt is None or self.disagg_min_tokens <= 0:
            return False
        uncached = prompt.num_tokens - num_cached_tokens(decode, prompt)
        return uncached < self.disagg_min_tokens

    def sent(self, backend: Backend, prompt: Prompt | None) -> Sent:
        """`backend` will cache `prompt`'s full blocks: count them until its summary does
        (from its first summary on: before it, the node's block size is unknown)."""
        now = time.monotonic()
        if prompt is None or backend.cached.version < 0:
            return Sent(now, {})
        return Sent(now, backend.remember(prompt.chain(backend.cached.block_size), now))

    def failed(self, backend: Backend, sent: Sent) -> None:
        """The leg `sent` failed: its blocks count as cached on `backend` only once its
        summary (or another leg) says so."""
        backend.forget(sent.before, sent.at_s)


@dataclass(frozen=True)
class Sent:
    """A leg's prompt as `Router.sent` counted it, to take back if the leg fails."""

    at_s: float
    before: Mapping[bytes, float | None]
    """When each of its blocks was last sent to the node before, if ever."""


def make_router(config: ProxyConfig) -> Router:
    """The proxy's router; it loads the model's tokenizer (no weights) when a policy or
    selective P/D needs token ids."""
    tokenizer = None
    wants = RoutingPolicy.CACHE_AWARE in (config.prefill_routing, config.decode_routing)
    reads_prompts = config.model is not None and (wants or config.disagg_min_tokens > 0)
    if reads_prompts and config.model is not None:
        from pdserve.model.files import load_tokenizer

        tokenizer = load_tokenizer(config.model)
    return Router(
        config.prefill_routing,
        config.decode_routing,
        config.disagg_min_tokens,
        tokenizer,
        reads_prompts,
    )


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    """The router's flags, shared by `pdserve proxy` and `pdserve up`."""
    policies = [p.value for p in RoutingPolicy]
    parser.add_argument(
        "--routing",
        choices=policies,
        default=None,
        help=f"both legs' policy (default {ProxyConfig.prefill_routing.value})",
    )
    parser.add_argument("--prefill-routing", choices=policies, default=None)
    parser.add_argument("--decode-routing", choices=policies, default=None)
    parser.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=ProxyConfig.disagg_min_tokens,
        help="a prompt with fewer tokens than this not cached on the decode node skips "
        "the prefill node (0: always P/D)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=ProxyConfig.max_concurrency,
        help="requests in flight through the proxy; more wait in a queue",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=ProxyConfig.max_queue,
        help="requests waiting; beyond, 429 with Retry-After at once",
    )
    parser.add_argument("--max-queue-wait-s", type=float, default=ProxyConfig.max_queue_wait_s)
    parser.add_argument(
        "--max-concurrency-per-key",
        type=int,
        default=ProxyConfig.max_concurrency_per_key,
        help="requests in flight per API key (0: no limit)",
    )


def routing_options(args: argparse.Namespace) -> dict[str, Any]:
    """ProxyConfig fields from `add_routing_args`' flags."""
    default = RoutingPolicy.LEAST_LOADED if args.model == "none" else ProxyConfig.prefill_routing
    both = args.routing or default.value
    return {
        "prefill_routing": RoutingPolicy(args.prefill_routing or both),
        "decode_routing": RoutingPolicy(args.decode_routing or both),
        "disagg_min_tokens": args.disagg_min_tokens,
        "max_concurrency": args.max_concurrency,
        "max_queue": args.max_queue,
        "max_queue_wait_s": args.max_queue_wait_s,
        "max_concurrency_per_key": args.max_concurrency_per_key,
    }


def num_cached_tokens(backend: Backend, prompt: Prompt) -> int:
    """Leading prompt tokens `backend` holds, in whole blocks: each block in its summary or
    sent to it in the last `RECENT_S`. O(the prompt's blocks): two set lookups a block.
    None before the node's first summary (its block size is unknown)."""
    cached = backend.cached
    if cached.version < 0:
        return 0
    since = time.monotonic() - RECENT_S
    n = 0
    for cut in prompt.lookup(cached.block_size):
        if cut not in cached.hashes and not backend.sent_since(cut, since):
            break
        n += 1
    return n * cached.block_size
