"""ModelConfig.batch_invariant: a request's tokens and logprobs do not depend on what else
runs with it. Each prompt alone, in one chunk with nothing cached, must equal the same
prompt among many others with small chunks (a prompt's last token scheduled alone, chunks
starting anywhere), after a prefix-cache hit, and with a decode batch growing and
shrinking around it: to the bit, in the machine's default dtype, in bf16 where it is
native, and with the AVX2 path forced.

Without the mode bf16 differs here (kernels chosen by row count, prefill attention blocked
by where a chunk starts); float32 differs in the last bits.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.errors import ConfigError
from pdserve.llm import LLM
from pdserve.model import cpu_kernels
from pdserve.model.cpu_isa import CpuIsa, effective
from pdserve.sampling_params import SamplingParams
from tests.conftest import cpu_level

SETTINGS = [
    pytest.param(("auto", None), id="default"),
    pytest.param(("bfloat16", None), id="bf16"),
    pytest.param(("auto", "avx2"), id="forced-avx2"),
]


@pytest.fixture(scope="module")
def model(tiny_kernels_model: Path) -> Path:
    return tiny_kernels_model


def _prompts() -> list[list[int]]:
    """20: decode steps of 16 rows and more, where the float32 AVX2 build's small-M linear
    takes panels of x (a loop of its own, which batch-invariant steps must not run)."""
    rng = random.Random(0)
    shared = [rng.randrange(5, 300) for _ in range(40)]
    return [
        (shared if i % 3 == 0 else []) + [rng.randrange(5, 300) for _ in range(rng.randint(3, 90))]
        for i in range(20)
    ]


def _run(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[Any]:
    return [(o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs])
            for o in llm.generate(prompts, sp)]  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_request_alone_equals_it_in_a_busy_batch(
    setting: tuple[str, str | None], model: Path
) -> None:
    dtype, isa = setting
    if isa is not None and effective() <= CpuIsa.AVX2:
        pytest.skip(f"the level here is already {effective().label}: 'default' runs it")
    if dtype == "bfloat16" and cpu_kernels.load(torch.bfloat16) is None:
        pytest.skip("bf16 is emulated here: batch_invariant is refused (test_refusals)")
    # The level must be forced with cpu_level (it clears the cached one): a bare
    # PDSERVE_CPU_ISA came too late, and this case ran the machine's own level.
    with cpu_level(isa) if isa else contextlib.nullcontext():
        _alone_equals_busy(setting, model)


def _alone_equals_busy(setting: tuple[str, str | None], model: Path) -> None:
    dtype, isa = setting
    opts = {"dtype": dtype, "batch_invariant": True, "max_model_len": 256}
    prompts = _prompts()
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)

    quiet = LLM(str(model), enable_prefix_caching=False, **opts)
    assert "batch-invariant" in quiet.engine.runner.ops.label
    assert isa is None or f"({isa}," in quiet.engine.runner.ops.label, quiet.engine.runner.ops.label
    alone = [_run(quiet, [p], sp)[0] for p in prompts]
    # 37 tokens a step: chunks start anywhere, some of one token; prompt 0 first, then
    # again among the rest, so prompts 0, 3, 6, ... hit the prefix cache.
    busy = LLM(str(model), max_num_batched_tokens=37, **opts)
    assert _run(busy, prompts[:1], sp) == alone[:1]
    together = _run(busy, prompts, sp)

    differ = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b]
    assert differ == [], f"prompts {differ} changed with their batch ({setting})"
    # Every prompt prefilled in the first step, then decode-only steps of all 20 rows.
    wide = _run(LLM(str(model), **opts), prompts, sp)
    differ = [i for i, (a, b) in enumerate(zip(alone, wide, strict=True)) if a != b]
    assert differ == [], f"prompts {differ} changed in a 20-row decode batch ({setting})"


def test_refusals(model: Path) -> None:
    """What cannot be made invariant is refused at start-up, naming why."""
    with pytest.raises(ConfigError, match="batch_invariant computes on dense weights"):
        LLM(str(model), batch_invariant=True, quantization="q8_0")
    with pytest.raises(ConfigError, match="needs the CPU kernels"):
        LLM(str(model), batch_invariant=True, kernels="torch")
    if cpu_kernels.load(torch.bfloat16) is None:
        with pytest.raises(ConfigError, match=r"bfloat16 kernels need"):
            LLM(str(model), batch_invariant=True, dtype="bfloat16")
