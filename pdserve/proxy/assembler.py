"""One completion answer assembled from the chunks of its stream.

Why: the proxy reads every decode leg as a stream, also for a client that did not ask for
one, so that `--decode-timeout-s` bounds the silence between tokens and never the length
of an answer (a non-streaming leg is silent until it ends). The client still gets the
answer the node would have sent without streaming.

How chunks fold into the answer (the shapes of OpenAI's stream, which nodes follow):
    top-level fields (id, created, model, prompt_token_ids, ...): the first non-null value;
        `object` loses its `.chunk` suffix
    usage: the last chunk that has one (the leg asks for `include_usage`)
    choices, by index:
        delta (chat) → message: `role` the last non-null, text fields joined; `tool_calls`
            merged by their `index` (id, type and name from the chunk that has them,
            `arguments` joined; the answer's calls in index order, without the index, as
            a non-streaming answer has them); `function_call` the same, as one call
        text: joined; token_ids: concatenated
        logprobs: each list inside (content, tokens, token_logprobs, ...) concatenated
        anything else (finish_reason, stop_reason, ...): the last non-null value
    an `{"error": ...}` event (the node gave up mid-stream): the answer is that error
"""

from __future__ import annotations

import copy
from typing import Any

JOINED_TEXT = ("text", "content", "refusal", "reasoning_content")
"""Choice and delta fields whose chunks are pieces of one string."""


class StreamAssembler:
    def __init__(self) -> None:
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._usage: Any = None
        self.error: dict[str, Any] | None = None
        """The error event that ended the stream, if one did."""

    def add(self, chunk: dict[str, Any]) -> None:
        """Fold one `data:` event (a parsed JSON object) into the answer."""
        if isinstance(chunk.get("error"), dict):
            self.error = chunk["error"]
            return
        for key, value in chunk.items():
            if key == "object" and isinstance(value, str):
                value = value.removesuffix(".chunk")
            if key not in ("choices", "usage") and self._top.get(key) is None:
                self._top[key] = value
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict):
                self._add_choice(choice)

    def answer(self) -> dict[str, Any]:
        """The non-streaming answer: choices in index order, usage last. A message with
        tool calls and no text has `content: null`, as a non-streaming answer has."""
        choices = [self._choices[i] for i in sorted(self._choices)]
        for choice in choices:
            message = choice.get("message")
            if (
                isinstance(message, dict)
                and message.get("tool_calls")
                and not message.get("content")
            ):
                message["content"] = None
        answer = {**self._top, "choices": choices}
        if self._usage is not None:
            answer["usage"] = self._usage
        return answer

    def _add_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        merged = self._choices.setdefault(index if isinstance(index, int) else 0, {})
        for key, value in choice.items():
            if key == "delta" and isinstance(value, dict):
                _merge_fields(merged.setdefault("message", {}), value)
            elif key == "logprobs":
                merged[key] = _merge_logprobs(merged.get(key), value)
            else:
                _merge_fields(merged, {key: value})


def _merge_fields(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        old = into.get(key)
        if key in JOINED_TEXT and isinstance(value, str):
            into[key] = (old if isinstance(old, str) else "") + value
        elif key == "tool_calls" and isinstance(value, list):
            into[key] = _merge_tool_calls(old if isinstance(old, list) else [], value)
        elif key == "function_call" and isinstance(value, dict):
            into[key] = _merge_call(old if isinstance(old, dict) else {}, value)
        elif key == "token_ids" and isinstance(value, list):
            into[key] = (old if isinstance(old, list) else []) + value
        elif value is not None or key not in into:
            into[key] = value


def _merge_logprobs(old: Any, new: Any) -> Any:
    if not isinstance(new, dict):
        return old if new is None else new
    if not isinstance(old, dict):
        return copy.deepcopy(new)
    for key, value in new.items():
        if isinstance(value, list) and isinstance(old.get(key), list):
            old[key] = old[key] + value
        elif value is not None or key not in old:
            old[key] = copy.deepcopy(value)
    return old


def _merge_tool_calls(calls: list[dict[str, Any]], pieces: list[Any]) -> list[dict[str, Any]]:
    """Stream pieces of tool calls (each with the `index` of its call) folded into whole
    calls, in index order."""
    by_index = {i: call for i, call in enumerate(calls)}
    for piece in pieces:
        if not isinstance(piece, dict):
            continue
        index = piece.get("index")
        index = index if isinstance(index, int) else len(by_index)
        fields = {k: v for k, v in piece.items() if k != "index"}
        by_index[index] = _merge_call(by_index.get(index, {}), fields)
    return [by_index[i] for i in sorted(by_index)]


def _merge_call(call: dict[str, Any], piece: dict[str, Any]) -> dict[str, Any]:
    """`arguments` joined (at the top, or in `function`); everything else first non-null."""
    for key, value in piece.items():
        if key == "arguments" and isinstance(value, str):
            call[key] = str(call.get(key) or "") + value
        elif key == "function" and isinstance(value, dict):
            call[key] = _merge_call(dict(call.get(key) or {}), value)
        elif call.get(key) is None:
            call[key] = value
    return call
