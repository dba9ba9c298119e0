"""A thinking model's reasoning, apart from its answer: `<think>…</think>` (Qwen3, the
DeepSeek-R1 distills) becomes the chat answer's `reasoning_content`, as vLLM's `qwen3`
reasoning parser returns it, streamed and not.

    "<think>\\nLet me see.\\n</think>\\n\\nParis."
        -> reasoning "\\nLet me see.\\n", content "\\n\\nParis."

- A model whose chat template writes `</think>` thinks (`thinks`): no flag to set, and a
  model without one is never parsed.
- An output that opens with `<think>` is reasoning until `</think>`, then content; one cut
  before `</think>` (max_tokens) is reasoning only.
- An output that does not open with it is content, all of it: Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`, whose template writes an empty
  `<think></think>` into the prompt, answers so. (Qwen3's Thinking-2507 models open the tag
  in the prompt instead; their reasoning comes back as content, tags included.)
- Streamed, text that may be the start of a tag is held back until the next delta shows
  what it is, so a tag never reaches the client and never splits across the two fields.
"""

from __future__ import annotations

from enum import Enum

OPEN, CLOSE = "<think>", "</think>"


def thinks(chat_template: str | None) -> bool:
    """Whether a model with this chat template writes `<think>` reasoning."""
    return bool(chat_template) and CLOSE in str(chat_template)


def split(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output: None where there is none."""
    parser = ThinkParser()
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if parser.reasoned else None), (content or None)


class _State(Enum):
    START = "start"
    """Nothing seen but, perhaps, the start of `<think>`."""
    THINKING = "thinking"
    ANSWERING = "answering"


class ThinkParser:
    """An output's text, delta by delta, split into (reasoning, content) deltas."""

    def __init__(self) -> None:
        self._held = ""
        """Text not given out yet: it may be the start of a tag."""
        self._state = _State.START
        self.reasoned = False
        """Whether the output opened with `<think>`: only then has the answer a
        `reasoning_content`."""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        if self._state is _State.START:
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                self._state, self.reasoned = _State.THINKING, True
                text = stripped[len(OPEN) :]
            elif OPEN.startswith(stripped):  # "", or "<th" so far: wait for more
                self._held = text
                return "", ""
            else:
                self._state = _State.ANSWERING
        if self._state is _State.ANSWERING:
            return "", text
        end = text.find(CLOSE)
        if end >= 0:
            self._state = _State.ANSWERING
            return text[:end], text[end + len(CLOSE) :]
        keep = _partial_suffix(text, CLOSE)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The rest, once the output has ended."""
        rest, self._held = self._held, ""
        return (rest, "") if self._state is _State.THINKING else ("", rest)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
