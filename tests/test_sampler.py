"""SamplingParams validation, each sampling option's effect, seeds, logprobs and stop handling."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_cases import oracle_keep, safe_top_p

from tierkv.engine.sampler import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    find_stop_string,
    greedy_tokens,
    make_generator,
    stop_reason,
)
from tierkv.errors import ConfigError
from tierkv.kernels import ShapeError
from tierkv.kernels import reference as ref

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
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
])
def test_bad_values_name_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**options)


def test_unknown_option_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        SamplingParams(temprature=0.5)
    assert "temprature" in str(err.value) and "temperature" in str(err.value)
    with pytest.raises(ConfigError, match="'beam_width'"):
        SamplingParams.from_dict({"max_tokens": 4, "beam_width": 2})
    assert SamplingParams.from_dict({"max_tokens": 4, "n": 2}).n == 2  # n > 1 is served (forked choices)
    with pytest.raises(ConfigError, match="n must be an int >= 1"):
        SamplingParams.from_dict({"n": 0})


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


@pytest.mark.parametrize("rows, vocab", [(1, 128256), (3, 49152), (2, 151936), (2, 1000), (1, 129 * 128)])
def test_greedy_tokens_is_torch_argmax_with_ties_infinities_and_nan(rows, vocab):
    """The two-stage argmax picks the first of tied maxima, as torch.argmax does, in every case."""
    g = torch.Generator().manual_seed(vocab)
    cases = [torch.randn(rows, vocab, generator=g), torch.full((rows, vocab), -math.inf)]
    tied = torch.zeros(rows, vocab)
    tied[:, [vocab // 3, vocab // 2, vocab - 1]] = 5.0  # the max in three slices: the first must win
    tied[-1, 7] = 5.0  # and earlier still within the first slice, on the last row only
    cases.append(tied)
    nan = torch.randn(rows, vocab, generator=g)
    nan[0, vocab - 2] = math.nan  # torch.argmax treats NaN as the largest value
    cases.append(nan)
    for logits in cases:
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(tied).tolist()[-1] == 7


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


def test_min_tokens_keeps_eos_and_stop_ids_out_until_that_many_tokens():
    # rows 0-2 would take token 2 (eos) or 9 (a stop id); each row has sampled a different count
    logits = torch.full((4, 12), -5.0)
    logits[:, 2], logits[:, 9], logits[:, 4], logits[:, 7] = 4.0, 3.0, 1.0, 0.5
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    params = [p, p, p, SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)]
    batch = SamplingBatch.build(params, 12, "cpu", num_output=[0, 2, 3, 0], eos_token_ids=[2])
    # rows 0 and 1 are short of 3 tokens: neither eos nor 9; row 2 has its 3; row 3 ignores eos
    # and so only bans its stop ids (none): eos is an ordinary token for it
    assert sample(logits, batch).token_ids.tolist() == [4, 4, 2, 2]
    # a token still on its way back counts: num_output, not the output ids the host has
    assert SamplingBatch.build([p], 12, "cpu", output_ids=[[5, 5]], num_output=[3], eos_token_ids=[2]).banned is None
    assert SamplingBatch.build([p], 12, "cpu", output_ids=[[5, 5]], eos_token_ids=[2]).banned is not None
    # the log-probabilities stay the model's (vLLM's processors act after them)
    params = [SamplingParams(temperature=0, min_tokens=1, logprobs=0)]
    out = sample(logits[:1], SamplingBatch.build(params, 12, "cpu", num_output=[0], eos_token_ids=[2]))
    assert out.token_ids.item() == 9 and out.logprobs.item() == pytest.approx(torch.log_softmax(logits[0], -1)[9].item())
    # stop_reason agrees: an eos or stop id ends the output only once min_tokens are out
    assert stop_reason(SamplingParams(min_tokens=2), 2, 1, eos_token_ids=[2]) is None
    assert stop_reason(SamplingParams(min_tokens=2), 2, 2, eos_token_ids=[2]) == "stop"
    # a stop id past the vocabulary is never sampled: nothing to ban, and no error (was an
    # IndexError, a 500 through the server, found by schemathesis)
    far = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9, 284294])
    out = sample(logits[:1], SamplingBatch.build([far], 12, "cpu", num_output=[0], eos_token_ids=[2]))
    assert out.token_ids.tolist() == [4]


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


# --- the top-k / top-p filter (the reference, which serves CPU) ---------------------------------

def filter_before_ties(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The sampler's filter as it was before tierkv.kernels.top_k_top_p_filter (ties ranked by the sort)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(logits.shape[-1])[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def filter_cases(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of every kind at once: k of 1, 2, mid, V-1, V, > V and off (0, -1); p tiny, 1 and safe
    midpoints; logit scales 0.3..4; a row with ties everywhere, one with -inf entries and one of
    +0.0 / -0.0 tied at the top."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.3, 1.0, 2.0, 4.0, 1.0, 1.0, 0.5, 3.0, 1.0, 2.0, 1.0, 1.0])
    logits = torch.randn(len(scales), vocab, generator=g) * scales[:, None]
    logits[4] = (logits[4] * 3).round() / 3                   # ~20 values, each tied many times
    logits[5, torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")
    logits[6, :7] = torch.tensor([0.0, -0.0, 0.0, -0.0, -0.0, 0.0, 0.0])
    logits[6, 7:] = -logits[6, 7:].abs() - 0.1                 # the seven zeros are the top run
    top_k = torch.tensor([1, 2, vocab // 7, vocab - 1, 3, 5, 2, vocab, vocab + 9, 0, -1,
                          int(torch.randint(1, vocab, (1,), generator=g))])
    top_p = safe_top_p(logits, g)
    top_p[0], top_p[1] = 1e-9, 1.0                            # the top run alone; off
    return logits, top_k, top_p


@pytest.mark.parametrize("vocab", [8, 17, 300, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filter_matches_the_definition(vocab, seed):
    logits, top_k, top_p = filter_cases(vocab, seed)
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        want = logits.masked_fill(~oracle_keep(logits, k, p), float("-inf"))
        assert torch.equal(ref.top_k_top_p_filter(logits, k, p), want), (k, p)
    # k = 2 on the row led by seven zeros of either sign keeps all seven, signs as they were
    zeros = ref.top_k_top_p_filter(logits, top_k, None)[6, :7]
    assert int(top_k[6]) == 2 and torch.equal(zeros.signbit(), logits[6, :7].signbit())
    assert int((ref.top_k_top_p_filter(logits, top_k, None)[6] != float("-inf")).sum()) == 7


def test_filter_keeps_every_token_tied_at_the_boundary():
    torch.manual_seed(5)
    row = torch.randint(0, 6, (40,)).float()        # 6 values, each several times
    ordered = row.sort(descending=True).values
    for k in range(1, 41):
        kept = ref.top_k_top_p_filter(row[None], torch.tensor([k]), None)[0] != float("-inf")
        # every token as large as the k-th largest, however many that is
        assert torch.equal(kept, row >= ordered[k - 1]), k
    # p below the top value's own mass: the whole top run stays, nothing else
    kept = ref.top_k_top_p_filter(row[None], None, torch.tensor([1e-6]))[0] != float("-inf")
    assert torch.equal(kept, row == row.max()) and int(kept.sum()) > 1


def test_filter_is_the_old_sort_on_rows_without_ties():
    # CPU outcomes are unchanged: without ties, bit for bit the old code, also when p equals a
    # cumulative mass exactly (the old "mass before >= p drops" decides the same way)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(48, 500, generator=g) * torch.linspace(0.2, 5, 48)[:, None]
    assert all(len(row.unique()) == 500 for row in logits)
    probs = logits.sort(dim=-1, descending=True).values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs                      # the old code's mass before each rank
    ranks = torch.randint(1, 500, (48,), generator=g)
    top_p = torch.rand(48, generator=g)
    top_p[::2] = before[torch.arange(0, 48, 2), ranks[::2]]    # exactly on a boundary
    top_p[1::6] = 1.0
    top_k = torch.randint(1, 520, (48,), generator=g)
    on = top_p < 1
    for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
        assert torch.equal(ref.top_k_top_p_filter(logits, k, p)[on], filter_before_ties(logits, k, p)[on])
    # the exact-boundary rows kept exactly the ranks before it
    kept = (ref.top_k_top_p_filter(logits, None, top_p) != float("-inf")).sum(dim=-1)
    assert torch.equal(kept[::2], ranks[::2])
    # p = 1 is off, as SamplingParams documents. The old code dropped the tail of such a row
    # wherever the fp32 cumsum had rounded up to 1 (tokens of mass < 1e-7, but only when another
    # row of the batch used top_p): a row's outcome no longer depends on its batch mates.
    assert (ref.top_k_top_p_filter(logits, None, top_p)[~on] != float("-inf")).all()


def test_filter_rejects_bad_arguments():
    logits = torch.randn(3, 10)
    with pytest.raises(ShapeError, match="top_k"):
        ref.top_k_top_p_filter(logits, torch.tensor([1, 2]), None)
    with pytest.raises(ShapeError, match="top_p"):
        ref.top_k_top_p_filter(logits, None, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ShapeError, match="logits"):
        ref.top_k_top_p_filter(logits[0], None, None)


def test_top_k_tie_at_the_boundary_samples_every_tied_token():
    # before, the sort kept exactly two of the three tied tokens (which two was up to the sort)
    freq = frequencies([0.1, 0.3, 0.3, 0.3], SamplingParams(top_k=2))
    assert freq[0] == 0
    torch.testing.assert_close(freq[1:], torch.full((3,), 1 / 3), atol=0.015, rtol=0)


def test_top_p_mass_is_of_the_whole_row_not_of_the_top_k_survivors():
    # the mass before token 1 is 0.4 of the row (< 0.5, kept); over the top-2 survivors it would
    # be 0.4 / 0.7 (>= 0.5, dropped)
    freq = frequencies([0.4, 0.3, 0.2, 0.1], SamplingParams(top_k=2, top_p=0.5))
    assert freq[2] == 0 and freq[3] == 0
    assert math.isclose(float(freq[1]), 0.3 / 0.7, abs_tol=0.015)
