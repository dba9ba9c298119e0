"""Build OpenAI response bodies (full and streamed) from engine outputs.

Only completions get here: finish_reason "stop" or "length" (None while a stream runs), or
"tool_calls" for a chat whose answer holds tool calls (`pdserve/tools.py` parses them out
of the text; a stream sends each call whole in one delta). A request that failed or was
aborted inside the engine is an error for the caller instead (`AsyncEngineClient.generate`
raises), never a body with a finish_reason of its own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve import reasoning
from pdserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pdserve.sampling_params import SamplingParams
from pdserve.tools import Parsed, ToolCallParser, ToolSpec


@dataclass(frozen=True)
class Echo:
    """A completion's `echo`: the prompt's text goes before the answer's, and with
    `logprobs` its tokens' entries before the answer's (the first token's are null)."""

    text: str
    token_text: Callable[[int], str]
    """A token's text on its own (the prompt's first token has no entry to carry it)."""


@dataclass
class ChoiceBuilder:
    request_id: str
    params: SamplingParams
    chat: bool
    model: str
    include_usage: bool
    return_token_ids: bool = False
    tools: ToolSpec | None = None
    """A chat's tools: calls are parsed out of its answers unless tool_choice is none."""
    echo: Echo | None = None
    thinks: bool = False
    """A thinking model's chat: its `<think>` reasoning goes to `reasoning_content`
    (`pdserve/reasoning.py`), the rest to `content` (and to the tool call parser)."""
    index_base: int = 0
    """Added to each choice's index: prompt `i` of a completions call with several has
    choices `i * n` to `i * n + n - 1`."""
    created: int = field(default_factory=lambda: int(time.time()))
    _roles_sent: set[int] = field(default_factory=set)
    _num_tokens_sent: dict[int, int] = field(default_factory=dict)
    """Per choice: tokens whose ids and logprobs went out in a chunk."""
    _prompt_sent: bool = False
    _last: RequestOutput | None = None
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)
    """Per choice of a stream with tools: its tool call parser."""
    _thinkers: dict[int, reasoning.ThinkParser] = field(default_factory=dict)
    """Per choice of a thinking model's chat stream: its reasoning splitter."""
    _prompt_logprobs: list[TokenLogprob | None] | None = None
    _offsets: dict[int, int] = field(default_factory=dict)
    """Per choice of a completions stream that has begun: where its next token's
    `text_offset` is (the length of the token texts sent so far)."""

    @classmethod
    def for_request(cls, body: Any, chat: bool, model: str, thinks: bool = False) -> ChoiceBuilder:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            params=body.sampling_params(),
            chat=chat,
            model=model,
            include_usage=body.include_usage,
            return_token_ids=body.return_token_ids,
            tools=body.tool_spec() if chat else None,
            thinks=thinks and chat,
        )

    def for_prompt(self, index: int, echo: Echo | None) -> ChoiceBuilder:
        """The builder of prompt `index` of a completions call with several."""
        return ChoiceBuilder(self.request_id, self.params, self.chat, self.model,
                             self.include_usage, self.return_token_ids, self.tools, echo,
                             self.thinks, index_base=index * self.params.n,
                             created=self.created)  # fmt: skip

    def _parser(self, index: int) -> ToolCallParser | None:
        if self.tools is None or not self.tools.parses_calls:
            return None
        if index not in self._parsers:
            self._parsers[index] = ToolCallParser(self.tools)
        return self._parsers[index]

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = f"{self._object}.chunk" if chunk and self.chat else self._object
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self, output: RequestOutput) -> dict[str, Any]:
        prompt = len(output.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in output.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        }

    def full_response(self, output: RequestOutput) -> dict[str, Any]:
        choices = [self._full_choice(c, output) for c in output.outputs]
        response = {**self._envelope(choices, chunk=False), "usage": self.usage(output)}
        if self.return_token_ids:
            response["prompt_token_ids"] = list(output.prompt_token_ids)
        return response

    def _full_choice(self, c: CompletionOutput, output: RequestOutput) -> dict[str, Any]:
        index = self.index_base + c.index
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            text = c.text
            if self.thinks:
                message["reasoning_content"], content = reasoning.split(c.text)
                message["content"], text = content, content or ""
            parser = self._parser(c.index)
            if parser is not None:
                parsed = parser.parse(text)
                if parsed.calls:
                    message["content"] = parsed.content.strip() or None
                    message["tool_calls"] = [call.as_openai() for call in parsed.calls]
                    choice["finish_reason"] = _finish_with_calls(c.finish_reason)
            choice["message"] = message
            choice["logprobs"] = _chat_logprobs(c.logprobs)
        else:
            choice["text"], choice["logprobs"] = self._text_and_logprobs(c.text, c.logprobs,
                                                                         output, 0)  # fmt: skip
        choice["stop_reason"] = c.stop_reason  # the stop string or token id that ended it (vLLM's)
        if self.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def _text_and_logprobs(
        self,
        text: str,
        entries: list[TokenLogprob] | None,
        output: RequestOutput,
        offset: int,
        echo: bool = True,
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's `text` and `logprobs` (OpenAI's legacy shape), the prompt's
        before them when it is echoed here. `text_offset` counts the token texts from
        `offset` (as vLLM does): a token that ends mid-character has text of its own, so a
        stream's offsets add up to the whole answer's."""
        rows: list[tuple[str, float | None, dict[str, float] | None]] = []
        if echo and self.echo is not None:
            text = self.echo.text + text
            prompt = output.prompt_logprobs
            if entries is not None and prompt is not None:
                first = self.echo.token_text(output.prompt_token_ids[0])
                rows.append((first, None, None))
                rows += [_row(e) for e in prompt[1:] if e is not None]
        if entries is None:
            return text, None
        rows += [_row(e) for e in entries]
        offsets = []
        for token, _, _ in rows:
            offsets.append(offset)
            offset += len(token)
        return text, {
            "tokens": [token for token, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets,
        }

    def stream_chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        """Chunks for what changed in this output (one per choice with news). Joined, they
        carry what `full_response` would: a token whose step added no text (a UTF-8
        character not complete yet, text held back by a stop string) has its id and
        logprobs sent with the next chunk of its choice, and `prompt_token_ids` comes
        with the first chunk (the proxy assembles non-streaming answers from streams)."""
        if output.prompt_logprobs is None:  # sent once by the engine (and at the end)
            output = replace(output, prompt_logprobs=self._prompt_logprobs)
        self._prompt_logprobs = output.prompt_logprobs
        self._last = output
        chunks = []
        for c in output.outputs:
            num_sent = self._num_tokens_sent.get(c.index, 0)
            new_ids = c.token_ids[num_sent:]
            news = c.delta_text or (self.return_token_ids and new_ids)
            if not (news or c.finished or (self.chat and c.index not in self._roles_sent)):
                continue
            self._num_tokens_sent[c.index] = len(c.token_ids)
            # A completion's first chunk carries its logprobs even with no token in it: the
            # echoed prompt's, and the empty lists of `max_tokens: 0` (issue 52: the proxy,
            # which assembles answers from streams, returned null for prompt scoring).
            opens = not self.chat and c.index not in self._offsets
            new_logprobs = None
            if c.logprobs is not None and (new_ids or opens):
                new_logprobs = c.logprobs[num_sent:]
            choice: dict[str, Any] = {
                "index": self.index_base + c.index,
                "finish_reason": c.finish_reason,
            }
            if self.chat:
                thought, text = self._think(c) if self.thinks else ("", c.delta_text)
                delta: dict[str, Any] = {"content": text}
                if c.index not in self._roles_sent:
                    delta["role"] = "assistant"
                    self._roles_sent.add(c.index)
                    if self.thinks:  # the field is there, null or not, as in a whole answer
                        delta["reasoning_content"] = thought or None
                if thought:
                    delta["reasoning_content"] = thought
                parser = self._parser(c.index)
                if parser is not None:
                    self._add_calls(delta, choice, parser, text, c.finished, c.finish_reason)
                choice["delta"] = delta
                choice["logprobs"] = _chat_logprobs(new_logprobs)
            else:
                # The echo goes with the choice's first chunk, which comes once the prompt
                # is computed (with its first token), and carries the prompt's logprobs.
                at = self._offsets.get(c.index, 0)
                choice["text"], logprobs = self._text_and_logprobs(
                    c.delta_text, new_logprobs, output, at, echo=opens
                )
                choice["logprobs"] = logprobs
                self._offsets[c.index] = at + sum(map(len, logprobs["tokens"] if logprobs else ()))
            choice["stop_reason"] = c.stop_reason
            if self.return_token_ids:
                choice["token_ids"] = list(new_ids)
            chunk = self._envelope([choice], chunk=True)
            if self.return_token_ids and not self._prompt_sent:
                chunk["prompt_token_ids"] = list(output.prompt_token_ids)
                self._prompt_sent = True
            chunks.append(chunk)
        return chunks

    def _think(self, c: CompletionOutput) -> tuple[str, str]:
        """A thinking model's streamed delta as (reasoning, content), a tag's start held
        back until the next delta shows what it is."""
        thinker = self._thinkers.setdefault(c.index, reasoning.ThinkParser())
        thought, content = thinker.feed(c.delta_text)
        if c.finished:
            more_thought, more_content = thinker.finish()
            thought, content = thought + more_thought, content + more_content
        return thought, content

    @staticmethod
    def _add_calls(
        delta: dict[str, Any],
        choice: dict[str, Any],
        parser: ToolCallParser,
        text: str,
        finished: bool,
        finish_reason: str | None,
    ) -> None:
        """A streamed chat delta with tools: text that may be a call held back, each call
        whole in `tool_calls` (OpenAI's delta shape, its arguments in one piece), and the
        whitespace between calls dropped."""
        num_before = parser.num_calls
        parsed = parser.feed(text)
        if finished:
            rest = parser.finish()
            parsed = Parsed(parsed.content + rest.content, parsed.calls)
        content = parsed.content
        if parser.num_calls and not content.strip():
            content = ""
        delta["content"] = content
        if parsed.calls:
            delta["tool_calls"] = [
                {"index": num_before + k, **call.as_openai()} for k, call in enumerate(parsed.calls)
            ]
        if finished and parser.num_calls:
            choice["finish_reason"] = _finish_with_calls(finish_reason)

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.include_usage or self._last is None:
            return None
        return {**self._envelope([], chunk=True), "usage": self.usage(self._last)}


def merge_answers(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One completions answer from the answers to each of its prompts: prompt `i`'s
    choices are numbered from `i * n` (as a node numbers them), the usage is the sum."""
    merged = {**answers[0], "choices": []}
    merged.pop("prompt_token_ids", None)  # per prompt: on its choices (as a node does)
    for i, answer in enumerate(answers):
        ids = answer.get("prompt_token_ids")
        for choice in answer.get("choices", []):
            # j-th sample of prompt i, whether its answer numbered it j (a node's answer
            # to one prompt) or i * n + j already (this node's builders for prompt i)
            choice = {**choice, "index": i * n + int(choice.get("index", 0)) % n}
            merged["choices"].append(choice if ids is None else {**choice, "prompt_token_ids": ids})
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = {
            key: sum(int(u.get(key) or 0) for u in usages)
            for key in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
        cached = sum(int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                     for u in usages)  # fmt: skip
        merged["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    return merged


def _finish_with_calls(reason: str | None) -> str | None:
    """An answer that ends in tool calls ends with "tool_calls" (OpenAI's), unless it ran
    out of tokens ("length" stays: the last call may be cut)."""
    return "tool_calls" if reason == "stop" else reason


def _row(e: TokenLogprob) -> tuple[str, float | None, dict[str, float] | None]:
    """A token's text, logprob and top alternatives, as completions' logprobs list them."""
    return e.decoded.get(e.token_id, ""), e.logprob, {e.decoded.get(t, ""): lp for t, lp in e.top}


def _chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None

    def item(token_id: int, logprob: float, e: TokenLogprob) -> dict[str, Any]:
        text = e.decoded.get(token_id, "")
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob, e), "top_logprobs": [item(t, lp, e) for t, lp in e.top]}
            for e in entries
        ]
    }
