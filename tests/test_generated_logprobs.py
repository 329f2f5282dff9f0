"""Generated tokens' logprobs against transformers: at every step, the chosen token's logprob and
the top N equal the log-softmax of transformers' logits for the same tokens, processed as
docs/sampling.md says logprobs see them: the grammar mask, then logit bias, repetition penalty
(transformers' own processors), presence / frequency penalties (OpenAI's formula), then the
temperature; top-k, top-p and min-p truncate only what is sampled, not what is reported.
float32 on both sides (pinned), to 1e-4, greedy and sampled."""

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, TemperatureLogitsWarper

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams
from sampling.grammar import Grammar
from tests.models import load_hf

TOP = 5
NEW_TOKENS = 10
PROMPT = [1, 40, 41, 42, 300, 301, 40, 41]
BIAS = {504: -4.0, 248: 3.0, 40: -3.0}  # 504 and 248: greedy picks the first, bias turns it to the second
GRAMMAR = Grammar("regex", "[a-z ]{4,60}")
CASES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=3),
    "greedy with penalties and bias": dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.6,
                                           frequency_penalty=0.9, logit_bias=BIAS),
    "sampled with penalties and bias": dict(temperature=1.4, top_k=50, top_p=0.95, seed=7, repetition_penalty=0.8,
                                            presence_penalty=-0.5, frequency_penalty=1.2, logit_bias=BIAS),
    "grammar": dict(temperature=1.1, top_p=0.9, seed=11, grammar=GRAMMAR, repetition_penalty=1.2,
                    logit_bias=BIAS),
}


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def generated(model_dir) -> dict[str, tuple[list[int], list]]:
    """Each case's output tokens and their logprobs, all cases in one batch of the engine (float32)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32"))
    for name, settings in CASES.items():
        params = SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=TOP, ignore_eos="grammar" not in name,
                                **settings)
        engine.add_request(GenerationRequest(name, PROMPT, params))
    streams = engine.run_to_completion()
    return {name: ([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.logprobs])
            for name, outs in streams.items()}


def grammar_masks(model_dir, grammar: Grammar, output: list[int], vocab_size: int) -> list[torch.Tensor]:
    """llguidance's own answer, step by step: [V] bool, the tokens the grammar allows after output[:t]."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size), grammar.source())
    masks = []
    for token in output:
        words = np.frombuffer(bytes(matcher.compute_bitmask()), dtype="<u4")  # bit t % 32 of word t // 32
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
        masks.append(torch.from_numpy(bits.astype(bool)))
        assert matcher.consume_token(token)
    return masks


def reference_logprobs(model, model_dir, settings: dict, output: list[int]) -> torch.Tensor:
    """[steps, V]: what step t's logprobs must be, from transformers' logits for PROMPT + output[:t]."""
    ids = torch.tensor([PROMPT + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()  # [steps, V]: each step's next-token logits
    vocab = logits.shape[-1]
    masks = grammar_masks(model_dir, settings["grammar"], output, vocab) if "grammar" in settings else None
    processors = []
    if "logit_bias" in settings:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in settings["logit_bias"].items()}))
    if "repetition_penalty" in settings:
        processors.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    temperature = settings["temperature"] or 1.0  # greedy rows are not divided
    rows = []
    for t in range(len(output)):
        history = ids[:, :len(PROMPT) + t]  # [1, prompt + t]
        scores = logits[t:t + 1].clone()  # [1, V]
        if masks is not None:
            scores[0, ~masks[t]] = float("-inf")
        for processor in processors:
            scores = processor(history, scores)
        counts = torch.bincount(torch.tensor(output[:t], dtype=torch.long), minlength=vocab).float()  # [V]
        scores = scores - settings.get("frequency_penalty", 0.0) * counts \
            - settings.get("presence_penalty", 0.0) * (counts > 0).float()
        scores = TemperatureLogitsWarper(temperature)(history, scores)
        rows.append(scores.log_softmax(-1)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("case", list(CASES))
def test_generated_logprobs_equal_transformers_log_softmax_of_the_processed_logits(model_dir, generated, case):
    settings = CASES[case]
    output, logprobs = generated[case]
    assert len(output) == len(logprobs) >= 3  # a grammar may end the output early, never at once
    reference = reference_logprobs(load_hf(model_dir, torch.float32), model_dir, settings, output)
    for t, (token, got) in enumerate(zip(output, logprobs)):
        want = reference[t]
        assert got.token_id == token
        assert got.logprob == pytest.approx(want[token].item(), abs=1e-4), (case, t)
        top = want.topk(TOP)
        finite = int(top.values.isfinite().sum())  # past the tokens a grammar allows, the order is arbitrary
        assert [i for i, _ in got.top[:finite]] == top.indices[:finite].tolist(), (case, t)
        assert [lp for _, lp in got.top[:finite]] == pytest.approx(top.values[:finite].tolist(), abs=1e-4)
        assert all(lp < -1e30 for _, lp in got.top[finite:])  # forbidden: no mass (float32's lowest)
        if not settings["temperature"]:
            assert token == int(want.argmax())  # greedy: the processed distribution's best
        assert want[token].isfinite()  # sampled: never a token the processing forbade


def test_each_row_gets_the_top_n_it_asked_for_and_a_forbidden_token_the_float32_lowest():
    """The sampler alone (no model): rows asking for different N in one batch each get their own N
    (the table is computed once, for the largest), a row that asks none gets none, and a token the
    processing forbade is reported at float32's lowest, -3.4e38, a number JSON can carry."""
    from sampling import Sampler
    from tests.sampling_helpers import batch_of

    vocab = 20  # logprobs <= 20: the whole vocabulary can be asked for
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0, logprobs=4),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3, bad_words_ids=[[7]])]
    logits[3, 7] = 100.0  # the best token, banned: never chosen, reported without mass
    out = Sampler(torch.device("cpu"), vocab)(logits.clone(), batch_of(params, vocab))
    want = logits.log_softmax(-1)
    assert [len(t) if t is not None else None for t in out.top_logprobs] == [1, 4, None, 3]
    assert out.logprobs[2] is None
    for row in (0, 1):
        ids = want[row].topk(len(out.top_logprobs[row])).indices.tolist()
        assert [t for t, _ in out.top_logprobs[row]] == ids
        assert out.logprobs[row] == pytest.approx(want[row].max().item(), abs=1e-5)
    assert out.token_ids[3] != 7
    banned = logits[3:].clone()
    banned[0, 7] = -float("inf")
    assert out.logprobs[3] == pytest.approx(banned.log_softmax(-1)[0].max().item(), abs=1e-5)
    everything = Sampler(torch.device("cpu"), vocab)(logits[3:].clone(), batch_of(
        [SamplingParams(temperature=0.0, logprobs=vocab, bad_words_ids=[[7]])], vocab)).top_logprobs[0]
    assert everything[-1] == (7, -3.4e38)
