"""Tokenizer and chat template, from a GGUF file's metadata or a Hugging Face directory.

Both run on the `tokenizers` library. From GGUF, two vocabularies:
- byte-level BPE (`tokenizer.ggml.model` gpt2: SmolLM2, Llama 3, Qwen2/3, Phi-4): GGUF
  files record which pre-tokenizer split their training used (`tokenizer.ggml.pre`), and
  `_PRE_TOKENIZERS` reproduces llama.cpp's table for the ones we support;
- SentencePiece BPE (`llama`: Gemma, Phi-3, Llama 2): pieces with scores, spaces as "▁",
  bytes outside the vocabulary as <0xNN> pieces (byte fallback). `tokenizers` builds such
  a tokenizer from SentencePiece's model file, which a GGUF file does not carry: the
  merges are derived from the pieces and their scores here (`_spm_merges`), as
  transformers' own GGUF and SentencePiece converters derive them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pdserve import tools as tool_calling
from pdserve.errors import InvalidRequestError, ModelLoadError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_with_split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    "llama-bpe": lambda: _byte_level_with_split(_LLAMA3_SPLIT),
    "qwen2": lambda: _byte_level_with_split(_QWEN2_SPLIT),
}

_TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
"""What pdserve passes a chat template itself."""

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """Text <-> token ids, special tokens and the model's chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` serializes it (what llguidance reads)."""
        return str(self._tok.to_str())

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """The text one token decodes to on its own (for logprob entries)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat as the model's template writes it. Tools (OpenAI's `tools`) and the
        tool calls and results in `messages` go to a template that knows them as Hugging
        Face templates take them, and to one that does not as pdserve's Hermes rendering
        (`pdserve/tools.py`). `template_kwargs` (a request's `chat_template_kwargs`, such as
        Qwen3's `enable_thinking`) are the template's extra variables."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template", param="messages")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        extra: dict[str, Any] = dict(template_kwargs or {})
        reserved = sorted(set(extra) & _TEMPLATE_VARIABLES)
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {reserved}: the request's own fields do",
                param="chat_template_kwargs",
            )
        if tool_calling.template_knows_tools(self.chat_template):
            messages = tool_calling.for_template(messages)
            if tools:
                extra["tools"] = tools
        else:
            messages = tool_calling.hermes_messages(messages, tools)
        try:
            return self._template.render(
                **extra,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos or "",
                eos_token=eos or "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = fields.get("tokenizer.ggml.model")
        builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
        if kind not in builders:
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {kind!r}; pdserve reads byte-level BPE "
                "(gpt2) and SentencePiece BPE (llama)"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        tok = builders[kind](fields, tokens)
        types = fields.get("tokenizer.ggml.token_type") or []
        tok.add_tokens(
            [
                AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                for i in range(len(types))
                if types[i] in (_CONTROL, _USER_DEFINED)
            ]
        )
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(t) for t in (eos, eot) if t is not None]
        bos = fields.get("tokenizer.ggml.bos_token_id")
        return cls(
            tok,
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            bos_token_id=int(bos) if bos is not None else None,
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`)."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json (pdserve reads fast tokenizers)")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
            cfg = _read_json(path / "tokenizer_config.json")
        except Exception as e:
            raise ModelLoadError(f"cannot read the tokenizer in {path}: {e}") from e
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, dict) else value
            return tok.token_to_id(text) if isinstance(text, str) else None

        eos_ids = list(eos_token_ids)
        cfg_eos = token_id(cfg.get("eos_token"))
        if cfg_eos is not None and cfg_eos not in eos_ids:
            eos_ids.append(cfg_eos)
        return cls(
            tok,
            eos_token_ids=eos_ids,
            bos_token_id=token_id(cfg.get("bos_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    def save_hf(self, path: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (used to export a GGUF model)."""
        self._tok.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {"add_bos_token": self.add_bos_token}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        if self.eos_token_id is not None:
            cfg["eos_token"] = self.id_to_token(self.eos_token_id)
        if self.bos_token_id is not None:
            cfg["bos_token"] = self.id_to_token(self.bos_token_id)
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def _byte_level_bpe(fields: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    pre = fields.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


_SPACE = "\u2581"  # SentencePiece's "▁"


def _sentencepiece_bpe(fields: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    """A SentencePiece BPE vocabulary as llama.cpp runs it: the text with spaces as "▁"
    (and one in front when `add_space_prefix`, as Llama 2 and Phi-3; Gemma says false),
    never split into words, merged by the pieces' scores, unknown bytes as <0xNN>."""
    scores = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores, vocab),
        unk_token=tokens[int(unk)] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(bpe)
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _spm_merges(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """BPE merges from SentencePiece pieces: each piece is the merge of every split of it
    into two pieces of the vocabulary, ranked by the piece's score (higher first), ties
    by the parts' ids (transformers' `SentencePieceExtractor` order)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in ranked]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
