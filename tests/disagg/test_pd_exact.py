"""Design §8 and invariant 5: a request split across a prefill and a decode node gives the
tokens and logprobs the same request gives on one node, to the bit, in every dtype.

Each case runs on a cluster (prefill + decode + single node) in one numeric setting: the
machine's default dtype, bf16 (native or not: the two paths must compute the same numbers
either way), and the AVX2 kernels forced where the CPU is above them. The model is a tiny
one whose heads (32) fit the fused CPU kernels, so the kernel paths run, not only PyTorch's.

Logprobs are compared exactly, not only tokens: a decode node that recomputes the last prompt
position (vLLM's way, and pdserve's before the prefill leg's token rode along) differs there
in the last bits in every dtype, and flips near-tied tokens in bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.launch import stop_all
from tests.api.conftest import kv_counters, start_servers
from tests.disagg.conftest import (
    Cluster,
    completion,
    decode_leg,
    make_prompt,
    node_args,
    post,
    prefill_leg,
    wait_idle,
)

pytestmark = pytest.mark.timeout(180)


def _settings() -> list[Any]:
    from pdserve.model.cpu_isa import CpuIsa, effective

    above_avx2 = pytest.mark.skipif(
        effective() <= CpuIsa.AVX2,
        reason=f"the level here is already {effective().label}: 'default' runs the AVX2 path",
    )
    return [
        pytest.param(("auto", None), id="default"),
        pytest.param(("bfloat16", None), id="bf16"),
        pytest.param(("auto", "avx2"), id="forced-avx2", marks=above_avx2),
    ]


@pytest.fixture(scope="session")
def exact_clusters(tiny_kernels_model: Path) -> Iterator[Callable[..., Cluster]]:
    """One cluster per numeric setting, started on first use and kept for the session."""
    model = tiny_kernels_model
    clusters: dict[tuple[str, str | None], Cluster] = {}

    def get(setting: tuple[str, str | None]) -> Cluster:
        if setting not in clusters:
            dtype, isa = setting
            args = [a if a != "float32" else dtype for a in node_args(model)]
            env = {"PDSERVE_CPU_ISA": isa} if isa else None
            servers = start_servers(
                [*args, "--role", "prefill"], [*args, "--role", "decode"], args, env=env
            )
            clusters[setting] = Cluster(*servers, model=model)  # type: ignore[misc]
        return clusters[setting]

    yield get
    stop_all([s for c in clusters.values() for s in (c.prefill, c.decode, c.single)])


def choices(data: dict[str, Any]) -> tuple[list[int], list[float], list[Any]]:
    """(tokens, their logprobs, the top logprobs) of the answer's only choice."""
    choice = data["choices"][0]
    logprobs = choice["logprobs"]
    return choice["token_ids"], logprobs["token_logprobs"], logprobs["top_logprobs"]


def split_and_whole(cluster: Cluster, body: dict[str, Any]) -> tuple[Any, Any]:
    """The answer through both legs, and the single node's."""
    body = {**body, "logprobs": 3}
    whole = post(cluster.single, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    split = decode_leg(cluster.decode, body, kv)
    assert split.status_code == 200, split.text
    return choices(split.json()), choices(whole.json())


@pytest.mark.parametrize("setting", _settings())
@pytest.mark.parametrize("length", [1, 16, 17, 100, 300])
def test_greedy_tokens_and_logprobs_equal_the_single_node(
    exact_clusters: Callable[..., Cluster], setting: Any, length: int
) -> None:
    cluster = exact_clusters(setting)
    split, whole = split_and_whole(cluster, completion(make_prompt(length, seed=31), 16))
    # [300-*] once failed rarely, under load: one node's rotary cos table was off from row
    # 256 on, set at its start-up (fixed in decoder.py's Rotary.compute_tables; found with
    # these 300-token prompts, docs/benchmarks.md). On a mismatch the failure shows both
    # answers, asked twice, so a node that strays for its whole life shows itself.
    if split != whole:  # which node strayed, and does it again (a prefix-cache hit now)?
        decode = kv_counters(cluster.decode)
        again = split_and_whole(cluster, completion(make_prompt(length, seed=31), 16))
        pytest.fail(
            f"split {split} != whole {whole}; asked again: split {again[0]}, whole {again[1]}; "
            f"{kv_counters(cluster.prefill)['handoff_counters']}, "
            f"{ {k: decode[k] for k in ('num_prompt_tokens_computed', 'num_preemptions')} }"
        )
    wait_idle(cluster.prefill, 2.0)
    wait_idle(cluster.decode, 2.0)


@pytest.mark.parametrize("setting", _settings())
def test_seeded_sampling_equals_the_single_node(
    exact_clusters: Callable[..., Cluster], setting: Any
) -> None:
    """The prefill leg draws the first token from the seed; the decode node skips that
    draw, so every later one is the single node's."""
    cluster = exact_clusters(setting)
    for seed in range(3):
        body = completion(make_prompt(40, seed=seed), 12, temperature=1.0, top_p=0.95, seed=seed)
        split, whole = split_and_whole(cluster, body)
        assert split == whole


@pytest.mark.parametrize("setting", _settings())
def test_min_tokens_penalties_and_logit_bias_equal_the_single_node(
    exact_clusters: Callable[..., Cluster], setting: Any
) -> None:
    """The prefill leg samples its token under the request's own rules (min_tokens masks
    EOS and stop tokens, penalties and logit_bias apply), though the leg itself stops
    after one token."""
    cluster = exact_clusters(setting)
    body = completion(
        make_prompt(30, seed=4), 10, min_tokens=5, stop_token_ids=[7], repetition_penalty=1.3
    )
    split, whole = split_and_whole(cluster, body)
    assert split == whole
    banned = {str(whole[0][0]): -100.0, str(whole[0][1]): 4.0}  # the first token, then a boost
    split, biased = split_and_whole(cluster, {**body, "logit_bias": banned})
    assert split == biased and biased[0][0] != whole[0][0]


@pytest.fixture(params=["qwen3", "gemma3", "phi3"])
def family_cluster(request: pytest.FixtureRequest, tiny_kernels_family: Any) -> Iterator[Cluster]:
    """A prefill, a decode and a single node on a tiny model of the family (kernel sizes);
    one family's at a time."""
    model = tiny_kernels_family(request.param)
    args = node_args(model)
    servers = start_servers([*args, "--role", "prefill"], [*args, "--role", "decode"], args)
    yield Cluster(*servers, model=model)  # type: ignore[misc]
    stop_all(servers)


def test_each_family_p_d_equals_the_single_node(family_cluster: Cluster) -> None:
    """Invariant 5 for the families beyond Llama: greedy and seeded answers through both
    legs equal the single node's, tokens and logprobs, with prompts shorter and longer
    than Gemma 3's sliding window (24 tokens in the tiny model)."""
    for length in (17, 100, 300):
        split, whole = split_and_whole(family_cluster, completion(make_prompt(length, 5), 12))
        assert split == whole, length
    body = completion(make_prompt(60, seed=6), 10, temperature=1.0, seed=3)
    split, whole = split_and_whole(family_cluster, body)
    assert split == whole
    wait_idle(family_cluster.prefill, 2.0)
    wait_idle(family_cluster.decode, 2.0)


def test_a_decode_leg_without_the_first_token_still_answers(
    exact_clusters: Callable[..., Cluster],
) -> None:
    """Params from a vLLM prefill node carry no first token: the decode node recomputes the
    last prompt position (vLLM's way: the same tokens here, not the same bits)."""
    cluster = exact_clusters(("auto", None))
    body = completion(make_prompt(50, seed=5), 8)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    vllm_like = {k: v for k, v in kv.items() if not k.startswith("first_token")}
    response = decode_leg(cluster.decode, body, vllm_like)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 8
    wait_idle(cluster.prefill, 2.0)


@pytest.mark.parametrize("token", [-1, 10**6])
def test_a_first_token_outside_the_vocabulary_is_not_used(
    exact_clusters: Callable[..., Cluster], token: int
) -> None:
    """Params come from clients: a token the model does not have is never embedded; the
    decode node recomputes the last prompt position instead."""
    cluster = exact_clusters(("auto", None))
    body = completion(make_prompt(20, seed=6), 4)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    response = decode_leg(cluster.decode, body, {**kv, "first_token_id": token})
    assert response.status_code == 200, response.text
    assert token not in response.json()["choices"][0]["token_ids"]
    wait_idle(cluster.prefill, 1.0)
    wait_idle(cluster.decode, 1.0)


def test_a_first_token_that_is_not_an_integer_is_a_400(
    exact_clusters: Callable[..., Cluster],
) -> None:
    cluster = exact_clusters(("auto", None))
    body = completion(make_prompt(20, seed=7), 4)
    kv = prefill_leg(cluster.prefill, body)["kv_transfer_params"]
    response = decode_leg(cluster.decode, body, {**kv, "first_token_id": "x"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert decode_leg(cluster.decode, body, kv).status_code == 200  # the handoff still held
