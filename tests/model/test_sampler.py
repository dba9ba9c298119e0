"""sample(): greedy, top-k/top-p/min-p, seeded draws, penalties, min_tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.kv_types import RemoteToken
from pdserve.engine.request import Request
from pdserve.model.sampler import sample
from pdserve.sampling_params import SamplingParams

EOS = 3


def make_request(
    prompt_token_ids: list[int] | None = None,
    output_token_ids: list[int] = (),  # type: ignore[assignment]
    request_id: str = "r0",
    **params: object,
) -> Request:
    prompt = list(prompt_token_ids) if prompt_token_ids is not None else [100, 101]
    request = Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=None, **params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
    )
    request.token_ids.extend(output_token_ids)
    return request


def make_generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def logits_from_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs]).unsqueeze(0)


def draw_many(
    logits_row: torch.Tensor, num_draws: int, seed: int = 0, **params: object
) -> list[int]:
    """One unseeded request per row, all sharing `generator`: `num_draws` independent draws."""
    requests = [make_request(request_id=f"r{i}", **params) for i in range(num_draws)]
    tokens, _ = sample(logits_row.expand(num_draws, -1).clone(), requests, make_generator(seed))
    return tokens


# -- greedy and filters ----------------------------------------------------------------------


def test_greedy_picks_the_argmax_of_each_row() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    requests = [make_request(request_id=f"r{i}", temperature=0.0) for i in range(3)]
    tokens, logprobs = sample(logits, requests, make_generator())
    assert tokens == [1, 0, 3]
    assert logprobs == [None, None, None]


def test_greedy_ties_go_to_the_first_token() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 5.0]])
    requests = [make_request(request_id=f"r{i}", temperature=0.0) for i in range(2)]
    assert sample(logits, requests, make_generator())[0] == [1, 0]


def test_bf16_logits_sample_as_their_float32_widening() -> None:
    """The model hands over bf16 logits: greedy picks (ties included) compare them as they
    come, and logprobs, penalties and seeded draws compute on their float32 widening."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie

    def requests() -> list[Request]:  # fresh ones each time: a seeded request's draws advance
        return [
            make_request(request_id="greedy", temperature=0.0),
            make_request(request_id="logprobs", temperature=0.0, logprobs=3),
            make_request([5, 6, 7], request_id="pen", temperature=0.0, repetition_penalty=1.3),
            make_request(request_id="min", temperature=0.0, min_tokens=2),
            make_request(request_id="seeded", temperature=0.8, top_p=0.9, seed=7),
            make_request(request_id="unseeded", temperature=1.0),
        ]

    got = sample(logits, requests(), make_generator())
    assert got == sample(logits.float(), requests(), make_generator())
    assert got[0][0] == 7
    assert got[1][1] is not None and got[1][0] is None


def test_empty_batch_samples_nothing() -> None:
    assert sample(torch.empty(0, 8), [], make_generator()) == ([], [])


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(6, 32, generator=make_generator(1))
    greedy, _ = sample(logits, [make_request(temperature=0.0) for _ in range(6)], make_generator())
    top1, _ = sample(logits, [make_request(top_k=1) for _ in range(6)], make_generator())
    assert top1 == greedy == logits.argmax(dim=-1).tolist()


def test_top_k_draws_only_among_the_k_most_likely() -> None:
    logits = logits_from_probs(0.1, 0.3, 0.05, 0.25, 0.3)
    tokens = draw_many(logits, 500, top_k=2)
    assert set(tokens) == {1, 4}


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = logits_from_probs(0.3, 0.4, 0.3)
    assert set(draw_many(logits, 300, top_p=1e-6)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = logits_from_probs(0.5, 0.3, 0.15, 0.05)
    assert set(draw_many(logits, 500, top_p=0.75)) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = logits_from_probs(0.5, 0.3, 0.2)
    assert set(draw_many(logits, 500, min_p=0.5)) == {0, 1}  # 0.2 < 0.5 * 0.5
    assert set(draw_many(logits, 500, min_p=0.39)) == {0, 1, 2}


# -- random draws ----------------------------------------------------------------------------


def test_unseeded_draws_follow_the_distribution() -> None:
    tokens = draw_many(logits_from_probs(0.8, 0.2), 2000)
    assert tokens.count(0) / 2000 == pytest.approx(0.8, abs=0.04)


def test_temperature_sharpens_the_distribution() -> None:
    # at temperature 0.5 the odds square: 0.64 : 0.04
    tokens = draw_many(logits_from_probs(0.8, 0.2), 2000, temperature=0.5)
    assert tokens.count(0) / 2000 == pytest.approx(0.64 / 0.68, abs=0.03)


def test_same_generator_seed_gives_the_same_unseeded_draws() -> None:
    logits = torch.zeros(1, 50)
    assert draw_many(logits, 20, seed=5) == draw_many(logits, 20, seed=5)
    assert draw_many(logits, 20, seed=5) != draw_many(logits, 20, seed=6)


def test_a_seeded_request_continued_from_a_remote_token_draws_what_one_node_draws() -> None:
    """P/D: the prefill node samples the first token from the seed; the decode node's
    request, given that token, skips that draw, so every later draw is one node's."""
    logits = torch.linspace(0.0, 1.0, 50).unsqueeze(0)
    one_node = make_request(seed=42)
    first, _ = sample(logits.clone(), [one_node], make_generator())
    second, _ = sample(logits.clone(), [one_node], make_generator())

    prefill = make_request(seed=42)
    assert sample(logits.clone(), [prefill], make_generator())[0] == first
    decode = make_request(seed=42)
    decode.accept_remote_token(RemoteToken(first[0]))
    decode.token_ids.append(first[0])
    assert decode.num_remote_draws == 1
    assert sample(logits.clone(), [decode], make_generator())[0] == second
    assert decode.num_remote_draws == 0
    fresh = make_request(seed=42)
    assert sample(logits.clone(), [fresh], make_generator())[0] == first != second


def test_a_greedy_request_skips_no_draw_for_a_remote_token() -> None:
    request = make_request(temperature=0.0)
    request.accept_remote_token(RemoteToken(5))
    assert request.num_remote_draws == 0


def draw_sequence(
    request: Request, others: list[Request], seed: int, num_steps: int = 8
) -> list[int]:
    """Sample `num_steps` times with `request` in the middle of a batch of `others`."""
    vocab_logits = torch.linspace(0.0, 1.0, 50)
    batch = [*others[:1], request, *others[1:]]
    position = batch.index(request)
    generator = make_generator(seed)
    out = []
    for _ in range(num_steps):
        tokens, _ = sample(vocab_logits.expand(len(batch), -1).clone(), batch, generator)
        out.append(tokens[position])
    return out


def test_seeded_request_is_reproducible_whatever_shares_its_batch() -> None:
    alone = draw_sequence(make_request(seed=42), [], seed=0)
    in_batch = draw_sequence(
        make_request(seed=42),
        [make_request(request_id="x"), make_request(request_id="y", seed=7, top_k=5)],
        seed=123,
    )
    assert len(set(alone)) > 1  # really random draws
    assert in_batch == alone


def test_different_seeds_give_different_draws() -> None:
    assert draw_sequence(make_request(seed=1), [], 0) != draw_sequence(make_request(seed=2), [], 0)


# -- penalties and min_tokens ----------------------------------------------------------------


@pytest.mark.parametrize(("penalty", "expected"), [(0.4, 0), (0.6, 1)])
def test_presence_penalty_lowers_a_generated_tokens_logit_once(
    penalty: float, expected: int
) -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    request = make_request(output_token_ids=[0, 0, 0], temperature=0.0, presence_penalty=penalty)
    assert sample(logits, [request], make_generator())[0] == [expected]


@pytest.mark.parametrize(("count", "expected"), [(2, 0), (3, 1)])
def test_frequency_penalty_grows_with_each_occurrence(count: int, expected: int) -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    request = make_request(output_token_ids=[0] * count, temperature=0.0, frequency_penalty=0.2)
    assert sample(logits, [request], make_generator())[0] == [expected]


def test_presence_and_frequency_penalties_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    request = make_request(
        prompt_token_ids=[0, 0, 0], temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert sample(logits, [request], make_generator())[0] == [0]


@pytest.mark.parametrize(
    ("logits", "penalty", "expected"),
    [
        ([2.0, 1.5], 1.2, 0),  # 2.0 / 1.2 = 1.67 still above 1.5
        ([2.0, 1.5], 1.5, 1),  # 2.0 / 1.5 = 1.33
        ([-1.0, -1.4], 1.3, 0),  # negative logits are multiplied: -1.3
        ([-1.0, -1.4], 1.5, 1),  # -1.5
    ],
)
def test_repetition_penalty_scales_seen_tokens_towards_unlikely(
    logits: list[float], penalty: float, expected: int
) -> None:
    request = make_request(prompt_token_ids=[0], temperature=0.0, repetition_penalty=penalty)
    assert sample(torch.tensor([logits]), [request], make_generator())[0] == [expected]


def test_penalties_apply_only_to_their_own_row() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    penalized = make_request(output_token_ids=[0], temperature=0.0, presence_penalty=1.0)
    plain = make_request(output_token_ids=[0], request_id="plain", temperature=0.0)
    assert sample(logits, [penalized, plain], make_generator())[0] == [1, 0]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 5.0
    logits[0, 5] = 4.0
    logits[0, 6] = 3.0
    early = make_request(output_token_ids=[1], temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    assert sample(logits, [early], make_generator())[0] == [6]
    done = make_request(output_token_ids=[1, 1], temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    assert sample(logits, [done], make_generator())[0] == [EOS]


def test_min_tokens_masks_eos_for_random_draws_too() -> None:
    logits = torch.zeros(1, 4)
    logits[0, EOS] = 10.0
    assert EOS not in draw_many(logits, 200, min_tokens=1)


# -- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_from_the_raw_distribution_with_sorted_top_n() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)
    # the penalty moves the pick from token 0 to token 1; logprobs stay those of the model
    penalized = make_request(
        output_token_ids=[0], temperature=0.0, presence_penalty=2.0, logprobs=3
    )
    without = make_request(request_id="x", temperature=0.5)
    logits_before = logits.clone()
    tokens, entries = sample(logits, [penalized, without], make_generator())

    assert torch.equal(logits, logits_before)  # the caller's logits are left alone
    entry = entries[0]
    assert entry is not None
    assert entries[1] is None
    assert tokens[0] == entry.token_id == 1
    assert entry.logprob == pytest.approx(float(raw[0, 1]), abs=1e-6)
    assert [t for t, _ in entry.top] == [0, 1, 3]
    assert [v for _, v in entry.top] == pytest.approx(raw[0, [0, 1, 3]].tolist(), abs=1e-6)


def test_logprobs_zero_returns_only_the_chosen_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    tokens, entries = sample(logits, [make_request(temperature=0.0, logprobs=0)], make_generator())
    entry = entries[0]
    assert entry is not None
    assert entry.token_id == tokens[0] == 2
    assert entry.top == []
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 2]))


def test_each_request_gets_its_own_number_of_top_logprobs() -> None:
    logits = torch.randn(2, 10, generator=make_generator(4))
    requests = [
        make_request(temperature=0.0, logprobs=1),
        make_request(request_id="b", temperature=0.0, logprobs=5),
    ]
    _, entries = sample(logits, requests, make_generator())
    assert [len(e.top) for e in entries if e is not None] == [1, 5]
