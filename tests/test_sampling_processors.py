"""Penalties, bans and biases equal transformers' own logits processors (or OpenAI's formula)."""

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor)

from sampling import SamplingParams
from sampling.processors import apply_all
from tests.sampling_helpers import batch_of

VOCAB, ROWS, PROMPT, OUTPUT = 40, 6, 12, 8
EOS = 2


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 12, (ROWS, PROMPT + OUTPUT), generator=g)  # small id range: many repeats
    return torch.randn(ROWS, VOCAB, generator=g) * 3, ids


def ours(logits, ids, params_list, output_len=OUTPUT):
    batch = batch_of(params_list, VOCAB, prompts=[r[: ids.shape[1] - output_len].tolist() for r in ids],
                     outputs=[r[ids.shape[1] - output_len:].tolist() for r in ids], eos=[EOS])
    out = logits.clone()
    apply_all(out, batch.processors)
    return out


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty(data, penalty):
    logits, ids = data
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.allclose(ours(logits, ids, [SamplingParams(repetition_penalty=penalty)] * ROWS), expected)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram(data, n):
    logits, ids = data
    expected = NoRepeatNGramLogitsProcessor(n)(ids, logits.clone())
    assert torch.equal(ours(logits, ids, [SamplingParams(no_repeat_ngram_size=n)] * ROWS), expected)


def test_bad_words(data):
    logits, ids = data
    words = [[5], [ids[0, -1].item(), 7], [ids[1, -2].item(), ids[1, -1].item(), 9], [EOS], [3, 4, 5, 6]]
    expected = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)(ids, logits.clone())
    got = ours(logits, ids, [SamplingParams(bad_words_ids=words)] * ROWS)
    assert torch.equal(got, expected)
    assert got[0, 7] == -float("inf") and got[1, 9] == -float("inf") and torch.isfinite(got[:, EOS]).all()


@pytest.mark.parametrize("min_new", [4, 8, 9])
def test_min_new_tokens(data, min_new):
    logits, ids = data
    expected = MinNewTokensLengthLogitsProcessor(PROMPT, min_new, EOS)(ids, logits.clone())
    assert torch.equal(ours(logits, ids, [SamplingParams(min_new_tokens=min_new)] * ROWS), expected)


def test_presence_and_frequency_penalties_follow_openai(data):
    logits, ids = data
    presence, frequency = 0.5, 0.8
    expected = logits.clone()
    for r in range(ROWS):
        counts = torch.bincount(ids[r, PROMPT:], minlength=VOCAB).float()  # the output only
        expected[r] -= counts * frequency + (counts > 0).float() * presence
    got = ours(logits, ids, [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * ROWS)
    assert torch.allclose(got, expected)


def test_logit_bias_and_rows_without_controls_are_untouched(data):
    logits, ids = data
    params = [SamplingParams(logit_bias={3: 5.0, 7: -100.0})] + [SamplingParams()] * (ROWS - 1)
    got = ours(logits, ids, params)
    assert got[0, 3] == logits[0, 3] + 5.0 and got[0, 7] == logits[0, 7] - 100.0
    assert torch.equal(got[1:], logits[1:])


def test_mixed_rows_in_one_batch(data):
    """Each row gets its own control, and only its own."""
    logits, ids = data
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(no_repeat_ngram_size=2),
              SamplingParams(min_new_tokens=20), SamplingParams(), SamplingParams(presence_penalty=1.0),
              SamplingParams(bad_words_ids=[[4]])]
    got = ours(logits, ids, params)
    assert torch.allclose(got[0], RepetitionPenaltyLogitsProcessor(1.5)(ids[:1], logits[:1].clone())[0])
    assert torch.equal(got[1], NoRepeatNGramLogitsProcessor(2)(ids[1:2], logits[1:2].clone())[0])
    assert got[2, EOS] == -float("inf")
    assert torch.equal(got[3], logits[3])
    assert got[5, 4] == -float("inf")


def test_bans_at_the_shortest_history_that_allows_them():
    """Boundaries random data rarely meets: a history exactly n tokens long (no-repeat n-grams),
    and exactly a bad word's prefix (bad words). Mutants skipping them survived `make mutants`."""
    logits = torch.zeros(1, VOCAB)
    ids = torch.tensor([[5, 5, 5]])  # the n-gram (5, 5, 5) is complete: 5 may not follow (5, 5) again
    got = ours(logits, ids, [SamplingParams(no_repeat_ngram_size=3)], output_len=0)
    assert torch.equal(got, NoRepeatNGramLogitsProcessor(3)(ids, logits.clone())) and got[0, 5] == -float("inf")
    ids = torch.tensor([[7, 8]])  # the whole history is the bad word's prefix: its last token is banned
    got = ours(logits, ids, [SamplingParams(bad_words_ids=[[7, 8, 9]])], output_len=0)
    want = NoBadWordsLogitsProcessor([[7, 8, 9]], eos_token_id=EOS)(ids, logits.clone())
    assert torch.equal(got, want) and got[0, 9] == -float("inf")


def test_a_row_too_short_to_ban_does_not_stop_the_rows_after_it():
    """The n-gram ban skips a row whose history is shorter than n, and goes on to the next rows."""
    ids = torch.tensor([[5, 5, 5], [6, 6, 6]])
    params = [SamplingParams(no_repeat_ngram_size=5), SamplingParams(no_repeat_ngram_size=2)]
    got = ours(torch.zeros(2, VOCAB), ids, params, output_len=0)
    assert torch.isfinite(got[0]).all() and got[1, 6] == -float("inf")


def test_penalties_leave_a_row_with_no_context_untouched(data):
    """A row whose context has no real token yet (a prompt of prompt-table ids only, no output):
    transformers' processors change none of its logits, nor ours (whose ids are padded)."""
    logits, ids = data
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)] * 2
    batch = batch_of(params, VOCAB, prompts=[[], ids[1, :PROMPT].tolist()], outputs=[[], ids[1, PROMPT:].tolist()])
    out = logits[:2].clone()
    apply_all(out, batch.processors)
    assert torch.equal(out[0], logits[0]) and not torch.equal(out[1], logits[1])
