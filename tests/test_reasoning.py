"""`pdserve/reasoning.py`: a thinking model's `<think>` reasoning apart from its answer,
whole and streamed, for every way a stream can cut the text."""

from __future__ import annotations

import pytest

from pdserve.reasoning import ThinkParser, split, thinks

CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    ("\n<think>a</think>b", "a", "b"),
    ("<think>cut by max_tokens", "cut by max_tokens", None),
    ("<think></think>", "", None),
    ("Paris.", None, "Paris."),
    ("Paris </think> later", None, "Paris </think> later"),
    ("<thin", None, "<thin"),
    ("", None, None),
    ("<think>x</thin", "x</thin", None),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_split(text: str, reasoning: str | None, content: str | None) -> None:
    assert split(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_every_cut_of_a_stream_gives_the_whole_answer(
    text: str, reasoning: str | None, content: str | None
) -> None:
    """Deltas of every size at every position: the pieces join to the whole answer's
    fields, and no piece of a tag reaches either field where the whole answer has none."""
    for size in range(1, len(text) + 1):
        for start in range(size):
            pieces = [text[:start]] + [text[i : i + size] for i in range(start, len(text), size)]
            parser = ThinkParser()
            out = [parser.feed(p) for p in pieces] + [parser.finish()]
            got_reasoning = "".join(r for r, _ in out)
            got_content = "".join(c for _, c in out)
            assert (got_reasoning if parser.reasoned else None) == reasoning, (pieces, out)
            assert (got_content or None) == content, (pieces, out)


def test_a_model_thinks_when_its_template_closes_the_tag() -> None:
    assert thinks("{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    assert not thinks("<|im_start|>{{ m.content }}") and not thinks(None)
