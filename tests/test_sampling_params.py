"""SamplingParams: normalisation of convenience values and validation of every field."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import MAX_LOGPROBS, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["1"]}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_value_raises_invalid_request_naming_the_param(
    kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert excinfo.value.param == param
    assert excinfo.value.http_status == 400
    assert param in excinfo.value.message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 128},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"min_tokens": 4, "max_tokens": 4},
        {"max_tokens": 0, "prompt_logprobs": 0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"stop": [f"s{i}" for i in range(16)]},
        {"seed": 0},
        {"seed": 2**63 - 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_single_stop_string_becomes_a_tuple() -> None:
    params = SamplingParams(stop="###")
    assert params.stop == ("###",)
    assert params.max_stop_str_len == 3


def test_stop_lists_become_tuples() -> None:
    params = SamplingParams(stop=["a", "bcd"], stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert params.stop == ("a", "bcd")
    assert params.stop_token_ids == (1, 2)
    assert params.max_stop_str_len == 3
    assert SamplingParams().max_stop_str_len == 0


def test_top_k_minus_one_means_disabled() -> None:
    params = SamplingParams(top_k=-1)
    assert params.top_k == 0
    assert params == SamplingParams()


def test_greedy_below_epsilon_temperature() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
