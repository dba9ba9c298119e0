"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.envs import force_hub_offline
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine

Prompt = str | Sequence[int]
"""A text prompt, or token ids."""

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
}


def engine_config(**kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (`block_size=8, dtype="float32"`)."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, value in kwargs.items():
        owner = next((n for n, c in _SECTIONS.items() if key in _field_names(c)), None)
        if owner is None:
            raise TypeError(f"unknown engine option {key!r}")
        sections[owner][key] = value
    return EngineConfig(
        model=ModelConfig(**sections["model"]),
        cache=CacheConfig(**sections["cache"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
    )


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class LLM:
    """Generate offline: `LLM("default").generate(["Hello"], SamplingParams(max_tokens=8))`."""

    def __init__(self, model: str = "default", **options: Any) -> None:
        from pdserve.engine.engine import LLMEngine  # torch: not for `engine_config`'s users

        force_hub_offline()
        self.engine: LLMEngine = LLMEngine(engine_config(model=model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        params_list = _broadcast(params or SamplingParams(), len(batch))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(batch, params_list, strict=True)]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return list(params)
