"""SamplingParams validation, each sampling option's effect, seeds, logprobs and stop handling."""

from __future__ import annotations

import math

import pytest
import torch

from tierkv.engine.sampler import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    find_stop_string,
    make_generator,
    stop_reason,
)
from tierkv.errors import ConfigError

sample = Sampler()


def run(logits: torch.Tensor, params: list[SamplingParams], gens=None, prompt=None, output=None):
    batch = SamplingBatch.build(params, logits.shape[-1], "cpu", gens, prompt, output)
    return sample(logits, batch)


def frequencies(probs: list[float], params: SamplingParams, rows: int = 20000) -> torch.Tensor:
    """Empirical distribution of one draw from each of `rows` identical rows."""
    torch.manual_seed(0)
    logits = torch.tensor(probs).log().expand(rows, -1).clone()
    tokens = run(logits, [params] * rows).token_ids
    return torch.bincount(tokens, minlength=len(probs)).float() / rows


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("options, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"seed": "abc"}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_values_name_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**options)


def test_unknown_option_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        SamplingParams(temprature=0.5)
    assert "temprature" in str(err.value) and "temperature" in str(err.value)
    with pytest.raises(ConfigError, match="'n'"):
        SamplingParams.from_dict({"max_tokens": 4, "n": 2})


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[7])
    assert p.stop == ("###",) and p.stop_token_ids == (7,)
    assert p.max_tokens == 64 and p.temperature == 1.0 and not p.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams.from_dict({"max_tokens": 3}).max_tokens == 3


# --- each option ----------------------------------------------------------------------------

def test_greedy_takes_the_argmax_whatever_the_seed():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0, seed=s) for s in range(3)] + [SamplingParams(top_k=1)] * 3
    gens = [make_generator(p, "cpu") for p in params]
    assert torch.equal(run(logits, params, gens).token_ids, logits.argmax(-1))


def test_temperature_one_follows_the_distribution_and_lower_sharpens_it():
    probs = [0.6, 0.3, 0.1]
    torch.testing.assert_close(frequencies(probs, SamplingParams()), torch.tensor(probs), atol=0.015, rtol=0)
    sharp = torch.tensor(probs) ** 2  # T = 0.5 squares the probabilities
    torch.testing.assert_close(frequencies(probs, SamplingParams(temperature=0.5)), sharp / sharp.sum(),
                               atol=0.015, rtol=0)


def test_top_k_keeps_the_k_most_likely_in_proportion():
    freq = frequencies([0.1, 0.5, 0.15, 0.25], SamplingParams(top_k=2))
    assert freq[0] == 0 and freq[2] == 0
    assert math.isclose(float(freq[1]), 0.5 / 0.75, abs_tol=0.015)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.5, 0.3, 0.15, 0.05]
    # 0.5 + 0.3 reaches 0.8: token 2 is not needed
    assert (frequencies(probs, SamplingParams(top_p=0.8)) > 0).tolist() == [True, True, False, False]
    assert (frequencies(probs, SamplingParams(top_p=0.81)) > 0).tolist() == [True, True, True, False]
    # a tiny top_p still keeps the most likely token
    assert frequencies(probs, SamplingParams(top_p=0.01)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_far_below_the_best():
    freq = frequencies([0.5, 0.3, 0.15, 0.05], SamplingParams(min_p=0.2))  # floor 0.1
    assert (freq > 0).tolist() == [True, True, True, False]


def test_repetition_penalty_only_touches_seen_tokens_of_its_row():
    logits = torch.tensor([[2.0, 1.9, -1.0, -3.0], [2.0, 1.9, -1.0, -3.0], [-1.0, -1.2, -5.0, -5.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, repetition_penalty=1.5)]
    # row 0: seen 2.0 -> 1.33 < 1.9; row 1: no penalty; row 2: seen -1.0 -> -1.5 < -1.2
    out = run(logits, params, prompt=[[0], [0], [3]], output=[[], [], [0]])
    assert out.token_ids.tolist() == [1, 0, 1]


def test_presence_and_frequency_penalties_count_output_tokens():
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0, presence_penalty=1.5),
              SamplingParams(temperature=0, frequency_penalty=0.4),
              SamplingParams(temperature=0, frequency_penalty=0.4)]
    out = run(logits, params, prompt=[[]] * 3, output=[[0], [0, 0], [0, 0, 0]])
    # 3 - 1.5 < 2; 3 - 0.8 > 2; 3 - 1.2 < 2
    assert out.token_ids.tolist() == [1, 0, 1]


# --- seeds --------------------------------------------------------------------------------

def seeded_run(seed: int, row: int, batch: int, steps: int = 40) -> list[int]:
    """Tokens drawn for the seeded request at `row` of a batch of otherwise unseeded rows."""
    torch.manual_seed(1000 + batch)  # unseeded rows vary with the global RNG
    logits = torch.zeros(batch, 64)  # uniform: every draw is pure noise
    params = [SamplingParams()] * batch
    params[row] = SamplingParams(seed=seed)
    gens = [make_generator(p, "cpu") for p in params]
    return [int(run(logits, params, gens).token_ids[row]) for _ in range(steps)]


def test_same_seed_same_tokens_whatever_the_batch():
    alone = seeded_run(seed=42, row=0, batch=1)
    assert seeded_run(seed=42, row=0, batch=1) == alone
    assert seeded_run(seed=42, row=3, batch=5) == alone
    assert seeded_run(seed=43, row=0, batch=1) != alone
    assert len(set(alone)) > 10  # really sampled, not a constant


# --- logprobs -----------------------------------------------------------------------------

def test_logprobs_are_the_models_before_penalties():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0.7, logprobs=0, seed=1), SamplingParams(temperature=0)]
    out = run(logits, params, [make_generator(p, "cpu") for p in params], prompt=[[0, 1]] * 3, output=[[]] * 3)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    values, ids = raw.topk(3, dim=-1)
    assert torch.equal(out.top_ids, ids)
    torch.testing.assert_close(out.top_logprobs, values)
    assert run(logits, [SamplingParams()] * 3).logprobs is None


# --- stopping -----------------------------------------------------------------------------

def test_stop_reason():
    p = SamplingParams(max_tokens=3, stop_token_ids=[9])
    assert stop_reason(p, 2, 1, eos_token_ids=[2]) == "stop"
    assert stop_reason(p, 9, 1, eos_token_ids=[2]) == "stop"
    assert stop_reason(p, 5, 2, eos_token_ids=[2]) is None
    assert stop_reason(p, 5, 3, eos_token_ids=[2]) == "length"
    ignoring = SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[9])
    assert stop_reason(ignoring, 2, 1, eos_token_ids=[2]) is None
    assert stop_reason(ignoring, 9, 1, eos_token_ids=[2]) == "stop"
    assert stop_reason(SamplingParams(max_tokens=None), 5, 10**6, eos_token_ids=[2]) is None


def test_stop_string_split_across_steps_is_found_and_cut():
    p = SamplingParams(stop=["END", "\n\n"])
    text = ""
    cut = None
    for piece in ["Hello wor", "ld E", "N", "D and more"]:
        text += piece
        cut = find_stop_string(text, len(piece), p)
        if cut is not None:
            break
    assert piece == "D and more" and text[:cut] == "Hello world "
    keep = SamplingParams(stop=["END", "\n\n"], include_stop_str_in_output=True)
    assert "Hello world END and more"[: find_stop_string("Hello world END and more", 10, keep)] == "Hello world END"


def test_earliest_stop_string_wins_and_old_text_is_not_rescanned():
    p = SamplingParams(stop=["b", "cd"])
    assert find_stop_string("xxcdb", 3, p) == 2
    # the text before the new characters was checked on earlier steps
    assert find_stop_string("ab" + "zz", 2, p) is None
    assert find_stop_string("abc", 1, SamplingParams(stop=["x"])) is None
