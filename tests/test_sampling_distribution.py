"""The top-k -> top-p -> exponential-race sampler: distributions and the operator's formula."""

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare
import torch

from sampling import Sampler, SamplingParams
from sampling.noise import exponential_noise
from sampling.topk_topp import EPS, top_k_top_p_sample
from tests.sampling_helpers import batch_of

VOCAB = 64
DRAWS = 20_000


def exact_distribution(logits: torch.Tensor, top_k: int, top_p: float) -> np.ndarray:
    """The truncated, renormalised distribution in float64, written plainly."""
    l = logits.double().clone()
    if 1 <= top_k <= len(l):
        l[l < torch.topk(l, top_k).values[-1]] = -float("inf")
    probs = torch.softmax(l, -1)
    if top_p < 1.0:
        order = torch.argsort(probs, descending=True)
        before = torch.cumsum(probs[order], 0) - probs[order]
        probs[order[before > top_p]] = 0.0
    return (probs / probs.sum()).numpy()


@pytest.fixture(scope="module")
def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2.0


@pytest.mark.parametrize("top_k,top_p,sample", list(itertools.product([0, 10], [1.0, 0.8], [False, True])))
def test_all_eight_combinations(logits, top_k, top_p, sample):
    params = SamplingParams(top_k=top_k, top_p=top_p, temperature=1.0 if sample else 0.0)
    batch = batch_of([params] * DRAWS, VOCAB)
    tokens = np.array(Sampler(torch.device("cpu"), VOCAB)(logits.expand(DRAWS, VOCAB).clone(), batch).token_ids)
    if not sample:  # without the race the operator is an argmax, whatever the truncation
        assert (tokens == int(logits.argmax())).all()
        return
    expected = exact_distribution(logits, top_k, top_p)
    observed = np.bincount(tokens, minlength=VOCAB)
    assert observed[expected == 0].sum() == 0, "sampled a token the truncation removed"
    support = expected > 0
    if top_k or top_p < 1:
        assert support.sum() < VOCAB
    statistic, p_value = chisquare(observed[support], expected[support] * DRAWS)
    assert p_value > 1e-3, (statistic, p_value)


def test_top_p_guess_fallback_to_full_sort_is_exact():
    # A flat row: the 32 guessed candidates carry far less than top_p, so the full sort runs.
    vocab = 400
    flat = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.3
    probs = torch.softmax(flat.double(), -1)
    assert probs.topk(32).values.sum() < 0.9
    batch = batch_of([SamplingParams(top_p=0.9)] * DRAWS, vocab)
    tokens = np.array(Sampler(torch.device("cpu"), vocab)(flat.expand(DRAWS, vocab).clone(), batch).token_ids)
    expected = exact_distribution(flat, 0, 0.9)
    observed = np.bincount(tokens, minlength=vocab)
    assert observed[expected == 0].sum() == 0
    assert chisquare(observed[expected > 0], expected[expected > 0] * DRAWS).pvalue > 1e-3


def test_min_p_keeps_tokens_within_the_ratio_of_the_best(logits):
    batch = batch_of([SamplingParams(min_p=0.2)] * 4000, VOCAB)
    tokens = set(Sampler(torch.device("cpu"), VOCAB)(logits.expand(4000, VOCAB).clone(), batch).token_ids)
    probs = torch.softmax(logits.double(), -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert tokens <= allowed and len(tokens) == len(allowed)


# ---- the operator's formula, checked by hand (seeds/003) -----------------------------------

def fixed_noise(q: torch.Tensor):
    """q [R, V] read as the operator reads it: q[b, j] for row b's j-th candidate."""
    return lambda rows, positions: q[rows][:, positions]


def op(logits, top_k, top_p, q, limit=1024):
    return top_k_top_p_sample(torch.tensor(logits), torch.tensor(top_k), torch.tensor(top_p),
                              None if q is None else fixed_noise(torch.tensor(q)), top_k_limit=limit).tolist()


LOGITS = [[0.0, 1.0, 2.0, 3.0]]
EQUAL_Q = [[1.0, 1.0, 1.0, 1.0]]


def test_hand_checked_cases():
    # No q: argmax, whatever top-k and top-p say.
    assert op(LOGITS, [2], [0.5], None) == [3]
    # Equal noise: the race picks the most probable kept token.
    assert op(LOGITS, [0], [1.0], EQUAL_Q) == [3]
    # Tiny q at index 0 makes token 0 win when nothing sorts or truncates the row...
    assert op(LOGITS, [0], [1.0], [[1e-6, 1.0, 1.0, 1.0]]) == [0]
    # ...but top-k = 2 keeps tokens 3 and 2, in that order: q[0] is token 3's, q[1] token 2's.
    assert op(LOGITS, [2], [1.0], [[1e-6, 1.0, 1.0, 1.0]]) == [3]
    assert op(LOGITS, [2], [1.0], [[1.0, 1e-3, 1.0, 1.0]]) == [2]
    # top-k outside [1, min(V, 1024)] is skipped for that row: token 0 wins again.
    assert op(LOGITS, [2000], [1.0], [[1e-6, 1.0, 1.0, 1.0]], limit=1024) == [0]
    assert op([[0.0] * 2048], [1500], [1.0], [[1e-6] + [1.0] * 2047], limit=1024) == [0]
    # top-p: probs 0.5, 0.3, 0.15, 0.05; with p = 0.7 the mass before token 2 is 0.8 > 0.7:
    # tokens 2 and 3 are dropped, so a tiny q on their places does not help them.
    probs = [[float(np.log(x)) for x in (0.5, 0.3, 0.15, 0.05)]]
    assert op(probs, [0], [0.7], [[1.0, 1.0, 1e-6, 1e-6]]) == [0]
    assert op(probs, [0], [0.7], [[1.0, 1e-3, 1e-6, 1e-6]]) == [1]
    # p = 0.85: mass before token 2 is 0.8 <= 0.85, so token 2 is kept; token 3 (0.95) is not.
    assert op(probs, [0], [0.85], [[1.0, 1.0, 1e-6, 1e-7]]) == [2]
    # The same probabilities in reverse token order: top-p sorts them, q follows the sort.
    reverse = [probs[0][::-1]]
    assert op(reverse, [0], [0.7], [[1.0, 1e-3, 1.0, 1e-9]]) == [2]
    # top_p >= 1 skips top-p.
    assert op(probs, [0], [1.0], [[1.0, 1.0, 1.0, 1e-6]]) == [3]
    # The race is argmax(probs / (q + eps)): with q = 0 everywhere, eps decides: the argmax.
    assert op(probs, [0], [1.0], [[0.0, 0.0, 0.0, 0.0]]) == [0]
    # Ties at the top-k edge: the lowest ids, as a stable sort lists them (kept: 0, 1).
    assert {op([[1.0, 1.0, 1.0, 1.0, 0.0]], [2], [1.0], [q])[0]
            for q in ([1e-6, 1, 1, 1, 1], [1, 1e-6, 1, 1, 1], [1, 1, 1e-6, 1e-6, 1])} == {0, 1}


def test_noise_is_exponential_and_keyed_by_seed_step_index():
    ids = torch.arange(50_000)
    q = exponential_noise(torch.tensor([7]), torch.tensor([0]), torch.tensor([3]), ids)[0].double()
    assert abs(q.mean().item() - 1.0) < 0.02 and abs(q.var().item() - 1.0) < 0.05
    again = exponential_noise(torch.tensor([7, 9]), torch.tensor([0, 0]), torch.tensor([3, 3]), ids)
    assert torch.equal(again[0].double(), q)  # another row beside it changes nothing
    assert not torch.equal(again[1].double(), q)
    other_step = exponential_noise(torch.tensor([7]), torch.tensor([0]), torch.tensor([4]), ids)[0].double()
    assert not torch.equal(other_step, q)
    assert EPS == 1e-8


def test_greedy_rows_take_torchs_argmax_ties_nan_and_masked_rows_included():
    """The CPU's greedy pick (numpy's argmax, faster) is torch's argmax: the first of tied maxima,
    a NaN counted as the maximum, index 0 for a row masked to -inf, strided views too."""
    from sampling.sampler import greedy

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    logits[0, 10] = logits[0, 700] = logits[0].max() + 1.0  # a tie: the first wins
    logits[1] = -float("inf")
    logits[2, 40] = logits[2, 50] = float("nan")
    for view in (logits, logits[:, :999], logits[::2]):
        assert torch.equal(greedy(view), view.argmax(-1))
    assert greedy(logits)[:3].tolist() == [10, 0, 40]


def test_an_all_greedy_bfloat16_batch_takes_the_float32_argmax_without_widening_all_its_logits():
    """A batch that reads only the argmax (every row greedy, no controls, no logprobs) of 16-bit
    logits gets the argmax of their float32 values (ties, NaN and a masked row included) and never
    holds a float32 copy of all of them: one came in fresh pages at every step (issue 51, session 9)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sampling.sampler import GREEDY_CHUNK_VALUES

    vocab = 4096
    rows = 3 * GREEDY_CHUNK_VALUES // vocab + 5  # three full chunks and one not
    logits = torch.randn(rows, vocab + 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    logits[0, 10] = logits[0, 700] = logits[0].max() + 1.0  # a tie: the first wins
    logits[1] = -float("inf")
    logits[rows - 1, 40] = logits[rows - 1, 50] = float("nan")
    expected = logits[:, :vocab].float().argmax(-1).tolist()

    class Float32Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                self.largest = max(self.largest, out.numel())
            return out

    batch = batch_of([SamplingParams(temperature=0.0)] * rows, vocab)
    assert batch.argmax_only
    with Float32Sizes() as sizes:
        out = Sampler(torch.device("cpu"), vocab)(logits, batch)
    assert out.token_ids == expected and out.token_ids[:2] == [10, 0] and out.token_ids[-1] == 40
    assert out.logprobs == [None] * rows
    assert 0 < sizes.largest <= GREEDY_CHUNK_VALUES
    assert not batch_of([SamplingParams(temperature=0.0, logprobs=1)], vocab).argmax_only
    assert not batch_of([SamplingParams(temperature=0.0, repetition_penalty=1.1)], vocab).argmax_only
    assert not batch_of([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)], vocab).argmax_only


# ---- boundaries random data rarely meets (survivors of `make mutants`, docs/testing.md) -------

def test_top_k_at_its_bounds_keeps_exactly_k():
    """k = 1 sampled (do_sample forces the race) is the argmax; k equal to the operator's limit
    still applies; k = 64 and 65 (either side of the candidate-width split) keep their top k."""
    rising = [[j * 1e-3 for j in range(2048)]]  # token 0 the least likely, 2047 the most
    assert op(rising, [1024], [1.0], [[1e-6] + [1.0] * 2047], limit=1024) == [2047]  # k = the limit: token 0 cut
    logits = torch.randn(300, generator=torch.Generator().manual_seed(8)) * 2
    for k in (1, 64, 65):
        params = SamplingParams(top_k=k, do_sample=True)
        assert not params.greedy
        tokens = Sampler(torch.device("cpu"), 300)(logits.expand(2000, 300).clone(), batch_of([params] * 2000, 300))
        top = set(logits.topk(k).indices.tolist())
        assert set(tokens.token_ids) <= top and (k == 1 or len(set(tokens.token_ids)) > k // 4), k
    # Rows of another k in the same candidate group (the group's width is the largest k), and a
    # k past the operator's 1024 that the engine's sampler keeps (its limit is the vocabulary).
    mixed = [SamplingParams(top_k=3), SamplingParams(top_k=60)] * 1000
    tokens = Sampler(torch.device("cpu"), 300)(logits.expand(2000, 300).clone(), batch_of(mixed, 300)).token_ids
    assert set(tokens[::2]) <= set(logits.topk(3).indices.tolist())
    wide = torch.randn(3000, generator=torch.Generator().manual_seed(11)) * 0.1
    tokens = Sampler(torch.device("cpu"), 3000)(wide.expand(500, 3000).clone(),
                                                batch_of([SamplingParams(top_k=2000)] * 500, 3000)).token_ids
    assert set(tokens) <= set(wide.topk(2000).indices.tolist())


def test_min_p_of_one_keeps_only_the_best():
    tokens = Sampler(torch.device("cpu"), 300)(torch.randn(300, generator=torch.Generator().manual_seed(9)).expand(
        500, 300).clone(), batch_of([SamplingParams(min_p=1.0)] * 500, 300)).token_ids
    assert set(tokens) == {int(torch.randn(300, generator=torch.Generator().manual_seed(9)).argmax())}


def test_logits_wider_than_the_vocabulary_never_give_a_padding_token():
    """A model's output may be padded past its vocabulary (the sampler slices it off)."""
    logits = torch.randn(64, VOCAB + 16, generator=torch.Generator().manual_seed(10))
    logits[:, VOCAB:] = 50.0  # padding columns that would win every draw
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.5)]
    out = Sampler(torch.device("cpu"), VOCAB)(logits, batch_of(params * 16, VOCAB))
    assert max(out.token_ids) < VOCAB


def test_do_sample_decides_greedy_before_temperature_and_top_k():
    assert SamplingParams(do_sample=False, temperature=1.0).greedy
    assert SamplingParams(do_sample=True, temperature=0.0).greedy  # nothing to sample from at temperature 0
    assert not SamplingParams(do_sample=True, top_k=1).greedy
    assert SamplingParams(top_k=1).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(top_k=2).greedy and not SamplingParams().greedy
