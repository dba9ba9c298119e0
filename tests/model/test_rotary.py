"""The rotary tables every node computes: the same bits on any node, whatever its threads."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.model.arch import ModelArch
from pdserve.model.decoder import Rotary, rope_inv_freq

LLAMA3_SCALING = (
    ("factor", 32.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)


def _arch(head_dim: int, theta: float, scaling: tuple[tuple[str, object], ...] | None) -> ModelArch:
    return ModelArch(
        architecture="llama", vocab_size=320, hidden_size=4 * head_dim, intermediate_size=256,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
        rope_theta=theta, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_scaling=scaling,
    )  # fmt: skip


@pytest.mark.parametrize(
    "head_dim,theta,scaling",
    [(32, 1e4, None), (64, 1e5, None), (128, 5e5, LLAMA3_SCALING)],
    ids=["32", "64", "128-llama3"],
)
def test_tables_are_the_float32_angles_cos_and_sin_rounded_once(
    head_dim: int, theta: float, scaling: tuple[tuple[str, object], ...] | None
) -> None:
    """Each entry is the correctly rounded cos/sin of its float32 angle (position x inverse
    frequency, as Hugging Face computes it), at every thread count. torch's float32 cos is
    within an ulp but not rounded once (5% of a 8k x 64 table differ), and a node once
    computed rows 256 on, which torch's second thread takes, 1.5e-4 off (decoder.py)."""
    arch = _arch(head_dim, theta, scaling)
    inv_freq = rope_inv_freq(arch).tolist()
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            rotary = Rotary(arch, 2048)
            for p in (0, 1, 255, 256, 257, 1000, 2047):
                angles = [float(torch.tensor(float(p)) * torch.tensor(f)) for f in inv_freq] * 2
                cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float32)
                sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float32)
                assert torch.equal(rotary.cos[p], cos) and torch.equal(rotary.sin[p], sin), (n, p)
    finally:
        torch.set_num_threads(threads)
