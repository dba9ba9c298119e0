"""Incremental detokenization with stop strings.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a prefix
yields U+FFFD. Like Hugging Face's and vLLM's streamers, we decode a short window of
tokens (`prefix_offset:`) and only emit text once it no longer ends in U+FFFD, so a
multi-byte character is never split across two deltas.

Stop strings: the emitted text holds back the last `max_stop_len - 1` characters while a
stop string could still be completing across the boundary; when one matches, the text is
cut before it (or after it with `include_stop_str_in_output`).
"""

from __future__ import annotations

from pdserve.model.tokenizer import Tokenizer
from pdserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_INITIAL_WINDOW_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._params = params
        self._ids = list(prompt_ids[-_INITIAL_WINDOW_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        """All output text decoded so far (after a stop string cut, final)."""
        self._num_emitted = 0
        self.stop_string: str | None = None

    def push(self, token_id: int) -> None:
        """Add one generated token; may set `stop_string` (the request must then stop)."""
        if self.stop_string is not None:
            return
        self._ids.append(token_id)
        skip = self._params.skip_special_tokens
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            new_text = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._append(new_text)

    def _append(self, new_text: str) -> None:
        start = len(self.text)
        self.text += new_text
        stops = self._params.stop
        if not stops:
            return
        search_from = max(0, start - self._params.max_stop_str_len + 1)
        best: tuple[int, str] | None = None
        for stop in stops:
            i = self.text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            end = i + len(stop) if self._params.include_stop_str_in_output else i
            self.text = self.text[:end]
            self.stop_string = stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible partial stop string unless final."""
        limit = len(self.text)
        if not finished and self.stop_string is None and self._params.stop:
            limit = max(self._num_emitted, limit - self._params.max_stop_str_len + 1)
        delta = self.text[self._num_emitted : limit]
        self._num_emitted = limit
        return delta
