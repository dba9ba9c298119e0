"""pdserve: an LLM inference server with prefill/decode disaggregation.

The public names load on first use (PEP 562), and only `LLM(...)` imports the engine
and torch, while the proxy, the CLI and a node's API process, which import other pdserve
modules, never pay for torch (~1.4 s of CPU at start; a tiny-model node's API process
keeps 58 MB resident instead of 257 MB).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.outputs import CompletionOutput, RequestOutput
    from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "pdserve.llm",
    "CompletionOutput": "pdserve.outputs",
    "RequestOutput": "pdserve.outputs",
    "SamplingParams": "pdserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
