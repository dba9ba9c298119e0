"""IncrementalDetokenizer on a real (tiny) byte-level BPE: whole characters and stop strings."""

from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.model.tokenizer import Tokenizer
from pdserve.sampling_params import SamplingParams

TRAINING_TEXT = [
    "héllo wörld 你好 🙂",
    "hello world, hello there",
    "wörld peace and héllo again",
    "你好 你好 🙂🙂 smile",
] * 3
# 日本語 and 🎉 are not in the training text: they are encoded byte by byte.
TEXT = "héllo wörld 你好 🙂 日本語 🎉 bye"
REPLACEMENT = "\ufffd"


@functools.cache
def make_tokenizer() -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(TRAINING_TEXT, trainer)
    return Tokenizer(hf, eos_token_ids=[hf.token_to_id("<eos>")])


def make_detokenizer(prompt: str = "", **params: object) -> IncrementalDetokenizer:
    tok = make_tokenizer()
    prompt_ids = tok.encode(prompt) if prompt else []
    return IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))  # type: ignore[arg-type]


def stream(detok: IncrementalDetokenizer, text: str, finish: bool = True) -> list[str]:
    """Push `text`'s tokens one by one; the deltas taken after each (the last one final)."""
    ids = make_tokenizer().encode(text)
    deltas = []
    for i, token_id in enumerate(ids):
        detok.push(token_id)
        deltas.append(detok.take_delta(finished=finish and i == len(ids) - 1))
    return deltas


def test_text_is_split_inside_characters_by_the_tokenizer() -> None:
    """Guard for the tests below: some tokens of TEXT are partial UTF-8 characters."""
    tok = make_tokenizer()
    pieces = [tok.decode([t]) for t in tok.encode(TEXT)]
    assert any(REPLACEMENT in piece for piece in pieces)
    assert tok.decode(tok.encode(TEXT)) == TEXT


@pytest.mark.parametrize("prompt", ["", "hello there ", "你好 🙂 "])
def test_deltas_concatenate_to_the_decoded_text(prompt: str) -> None:
    detok = make_detokenizer(prompt)
    deltas = stream(detok, TEXT)
    assert "".join(deltas) == make_tokenizer().decode(make_tokenizer().encode(TEXT)) == TEXT
    assert detok.text == TEXT
    assert detok.stop_string is None


@pytest.mark.parametrize("stop", [(), ("zzz",)])
def test_no_delta_splits_a_multibyte_character(stop: tuple[str, ...]) -> None:
    deltas = stream(make_detokenizer(stop=stop), TEXT)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == TEXT
    for char in "你🙂日本語🎉":
        assert any(char in d for d in deltas)


def test_special_tokens_are_skipped() -> None:
    tok = make_tokenizer()
    detok = make_detokenizer()
    stream(detok, "héllo", finish=False)
    detok.push(tok.eos_token_id)  # type: ignore[arg-type]
    assert detok.take_delta(finished=True) == ""
    assert detok.text == "héllo"


# -- stop strings ----------------------------------------------------------------------------


def test_stop_string_cuts_the_text_before_it() -> None:
    detok = make_detokenizer(stop=["你好"])
    deltas = stream(detok, TEXT, finish=False)
    assert detok.stop_string == "你好"
    assert detok.text == "héllo wörld "
    assert "".join(deltas) == "héllo wörld "

    detok.push(make_tokenizer().encode(" more")[0])  # the request is stopping: ignored
    assert detok.text == "héllo wörld "
    assert detok.take_delta(finished=True) == ""


def test_stop_string_included_on_request() -> None:
    detok = make_detokenizer(stop=["你好"], include_stop_str_in_output=True)
    deltas = stream(detok, TEXT, finish=False)
    assert detok.stop_string == "你好"
    assert detok.text == "héllo wörld 你好"
    assert "".join(deltas) == "héllo wörld 你好"


def test_earliest_stop_string_wins() -> None:
    detok = make_detokenizer(stop=["🙂", "wör", "bye"])
    stream(detok, TEXT)
    assert detok.stop_string == "wör"
    assert detok.text == "héllo "


def test_stop_string_split_across_tokens_is_found() -> None:
    stop = "lo wö"
    tok = make_tokenizer()
    assert not any(stop in tok.decode([t]) for t in tok.encode(TEXT))  # spans two tokens
    detok = make_detokenizer(stop=[stop])
    deltas = stream(detok, TEXT)
    assert detok.stop_string == stop
    assert detok.text == "hél"
    assert "".join(deltas) == "hél"


def test_stop_string_completed_by_a_multibyte_character_is_found() -> None:
    detok = make_detokenizer(stop=["語 🎉"])
    stream(detok, TEXT)
    assert detok.stop_string == "語 🎉"
    assert detok.text == "héllo wörld 你好 🙂 日本"


def test_possible_stop_prefix_is_held_back_until_ruled_out() -> None:
    stop = "wörld!"  # TEXT has "wörld " instead
    tok = make_tokenizer()
    detok = make_detokenizer(stop=[stop])
    emitted = ""
    saw_prefix_at_end = False
    for token_id in tok.encode(TEXT):
        detok.push(token_id)
        emitted += detok.take_delta(finished=False)
        assert TEXT.startswith(emitted)
        if detok.text.endswith("wörld"):
            saw_prefix_at_end = True
            assert "wörld" not in emitted
    assert saw_prefix_at_end
    assert "wörld 你好" in emitted  # released once it could no longer become the stop string
    assert len(emitted) >= len(TEXT) - (len(stop) - 1)
    emitted += detok.take_delta(finished=True)
    assert emitted == TEXT
    assert detok.stop_string is None
