"""Structured outputs: a request's grammar, and the token masks that keep its output in it.

Built on llguidance (Microsoft's grammar engine, what vLLM's `guidance` backend runs). Why
it and not xgrammar (vLLM's and SGLang's default): it installs with no dependencies (the
xgrammar wheel declares torch, transformers and triton), it builds a matcher for a JSON
schema in ~1 ms with no per-grammar pass over the vocabulary, and it reports a bad schema,
regex or grammar as a message we can answer 400 with. Measured on the default model's
49k-token vocabulary (2 cores, AMX class): the tokenizer once per process 0.24 s, a
matcher 0.8 ms (then copied from a cache in microseconds), the masks of one step 0.33 ms
for one request and 2.1 ms for 32 (computed in parallel, outside the GIL).

Two halves, one per process:
- The API process turns a request's `response_format` or `structured_outputs` into one
  grammar text (`grammar_for`) and checks it (`check`), so a bad one is a 400 before the
  engine sees the request or any KV is allocated.
- The engine process builds each request's matcher on a worker thread (`Grammars`), so a
  slow grammar never stalls the loop for the other requests: the request waits to be
  scheduled until its matcher is ready. The sampler masks the rows of requests that have
  one (`apply_masks`), and the scheduler advances the matcher with each token it appends.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher, LLTokenizer

JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (no free whitespace between tokens): a small model left free to indent
can spend its whole budget on whitespace, and compact JSON parses the same."""

ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's `structured_outputs` request field: exactly one of its constraints."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @classmethod
    def parse(cls, raw: Any) -> StructuredOutputs:
        if not isinstance(raw, dict):
            raise InvalidRequestError(
                "structured_outputs must be an object", param="structured_outputs"
            )
        known = {"json", "regex", "choice", "grammar", "json_object"}
        unknown = sorted(set(raw) - known - {"disable_any_whitespace", "whitespace_pattern"})
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs.{unknown[0]} is not supported (use one of "
                f"{', '.join(sorted(known))})",
                param="structured_outputs",
            )
        given = [k for k in known if raw.get(k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(sorted(given)) or 'none'})",
                param="structured_outputs",
            )
        return cls(**{k: raw.get(k) for k in known})


def grammar_for(response_format: Any, structured: Any) -> str | None:
    """The llguidance grammar text a request asks for (None: unconstrained). At most one
    of OpenAI's `response_format` and vLLM's `structured_outputs`; a bad one is a 400."""
    from llguidance import LLMatcher

    fmt = _response_format(response_format)
    if structured is not None and fmt is not None:
        raise InvalidRequestError(
            "send response_format or structured_outputs, not both", param="structured_outputs"
        )
    if fmt is not None:
        return LLMatcher.grammar_from_json_schema(fmt, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if structured is None:
        return None
    so = StructuredOutputs.parse(structured)
    param = "structured_outputs"
    if so.json_object:
        return LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if so.json is not None:
        schema = _json_value(so.json, f"{param}.json")
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if so.regex is not None:
        _require(isinstance(so.regex, str), f"{param}.regex must be a string", param)
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        ok = (
            isinstance(so.choice, list) and so.choice and all(isinstance(c, str) for c in so.choice)
        )
        _require(bool(ok), f"{param}.choice must be a non-empty list of strings", param)
        # Lark string literals take JSON's escapes: each choice matches exactly.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    _require(isinstance(so.grammar, str), f"{param}.grammar must be a string", param)
    assert so.grammar is not None
    text = so.grammar
    if "::=" in text:  # GBNF (llama.cpp's, and xgrammar's EBNF): llguidance converts it
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions on bad input
            raise InvalidRequestError(f"{param}.grammar: {e}", param=param) from None
    return LLMatcher.grammar_from_lark(text)


def check(grammar: str, param: str) -> None:
    """A 400 naming what is wrong with `grammar` (unsupported JSON Schema keywords and
    formats, regex and Lark syntax), before the request reaches the engine."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequestError(f"{param}: {messages[0] if messages else 'invalid'}", param=param)


def _response_format(raw: Any) -> Any:
    """OpenAI's `response_format` as a JSON schema, or None for text."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise InvalidRequestError(
            "response_format must be an object with a type", param="response_format"
        )
    kind = raw["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = raw.get("json_schema")
        _require(
            isinstance(spec, dict),
            "response_format.json_schema must be an object",
            "response_format",
        )
        assert isinstance(spec, dict)
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            return {}  # OpenAI allows a json_schema without a schema: any JSON
        return _json_value(schema, "response_format.json_schema.schema")
    raise InvalidRequestError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param="response_format",
    )


def _json_value(raw: Any, where: str) -> Any:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where} is not valid JSON: {e}", param=where) from None
    _require(isinstance(raw, (dict, bool)), f"{where} must be a JSON schema object", where)
    return raw


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


# -- the engine's half --------------------------------------------------------------------


class Grammars:
    """The engine's matchers: built on one worker thread from a cache of ready ones (a
    copy of a cached matcher is a few microseconds; building one can take up to a second
    for a large grammar, and llguidance builds it outside the GIL)."""

    CACHE_SIZE = 256

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self._source = (tokenizer_json, vocab_size, list(eos_token_ids))
        self._tokenizer: LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str) -> Future[LLMatcher]:
        """A fresh matcher for `grammar`, built on the worker thread. Its error state
        (`get_error()`) says why when the grammar does not fit this tokenizer."""
        return self._pool.submit(self._build, grammar)

    def _build(self, grammar: str) -> LLMatcher:
        from llguidance import LLMatcher, LLTokenizer

        with self._lock:
            if self._tokenizer is None:
                text, vocab_size, eos = self._source
                self._tokenizer = LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
        template = LLMatcher(self._tokenizer, grammar)
        with self._lock:
            self._cache[grammar] = template
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_executor: Any = None
_mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


@dataclass(frozen=True)
class Masks:
    """The allowed tokens of some rows of a step: row indices and [rows, vocab] flags."""

    rows: list[int]
    allowed: Any  # numpy bool-like uint8 array


def start_masks(matchers: list[tuple[int, LLMatcher]], vocab: int) -> Future[Masks] | None:
    """Compute the masks of the rows (i, matcher) on a worker thread, to be ready when the
    logits are (the runner starts this before the forward pass: llguidance computes them
    outside the GIL, in parallel across rows); None when no row has a grammar."""
    if not matchers:
        return None
    return _mask_thread.submit(_masks, matchers, vocab)


def _masks(matchers: list[tuple[int, LLMatcher]], vocab: int) -> Masks:
    global _executor
    import numpy as np
    from llguidance import LLExecutor

    if _executor is None:
        _executor = LLExecutor()
    words = (vocab + 31) // 32
    bits = np.full((len(matchers), words), -1, dtype=np.int32)
    _executor.unsafe_compute_mask_ptr(
        [(m, k) for k, (_, m) in enumerate(matchers)], bits.ctypes.data, words * 4, len(matchers)
    )
    # Bit t of word w allows token 32 w + t (little-endian words: byte order = bit order).
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return Masks([i for i, _ in matchers], allowed)


def apply_masks(logits: torch.Tensor, masks: Masks) -> torch.Tensor:
    """`logits` with -inf on every token a row's grammar forbids: a new tensor in the same
    dtype (the model's output is an inference tensor)."""
    import torch

    forbidden = torch.zeros(logits.shape, dtype=torch.bool)
    width = masks.allowed.shape[1]
    rows = torch.tensor(masks.rows, dtype=torch.long)
    forbidden[rows, :width] = torch.from_numpy(masks.allowed == 0)
    forbidden[rows, width:] = True  # padding rows of a padded LM head are no tokens
    return logits.masked_fill(forbidden.to(logits.device), float("-inf"))
