"""A resumed request (the engine's half of decode migration, deployments/ingress/migration.py) goes on as
if it had never stopped: the same tokens after the cut, the same streamed text, the same counts,
colocated and through P then D."""

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams

PROMPT = [5, 17, 93, 41, 8, 260, 77, 301, 12]
NEW_TOKENS = 24
# Seeded sampling with every control that reads the output so far: the noise's step, penalties,
# n-gram blocking, min_new_tokens; a stop string that never matches holds text back.
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50,
                        repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                        no_repeat_ngram_size=2, seed=1234, logprobs=0, stop=["\x07\x07\x07"])


def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=32))


def stream(llm: LLMEngine, request: GenerationRequest) -> list:
    llm.add_request(request)
    return llm.run_to_completion()[request.request_id]


def logprob_of(outputs: list, cut: int) -> float:
    return sum(lp.logprob for lp in [lp for o in outputs for lp in o.logprobs][:cut])


def text_after(outputs: list, cut: int) -> str:
    """The text the uninterrupted stream released after its first ``cut`` tokens."""
    seen, text = 0, ""
    for output in outputs:
        seen += len(output.new_token_ids)
        if seen > cut or (seen == cut and not output.new_token_ids):
            text += output.new_text
    return text


@pytest.fixture(scope="module")
def whole(model_dirs):
    llm = engine(model_dirs["llama"])
    outputs = stream(llm, GenerationRequest("whole", PROMPT, PARAMS))
    assert outputs[-1].num_output_tokens == NEW_TOKENS
    return llm, outputs


@pytest.mark.parametrize("cut", [1, 7, NEW_TOKENS - 1])
def test_resumed_generation_continues_the_same_sampling(whole, cut):
    llm, outputs = whole
    final = outputs[-1]
    request = GenerationRequest(f"resumed{cut}", PROMPT, PARAMS, resumed_output_ids=final.output_token_ids[:cut],
                                resumed_logprob=logprob_of(outputs, cut))
    again = stream(llm, request)
    assert [t for o in again for t in o.new_token_ids] == final.output_token_ids[cut:]  # none lost, none twice
    assert again[-1].output_token_ids == final.output_token_ids and again[-1].text == final.text
    assert "".join(o.new_text for o in again) == text_after(outputs, cut)
    assert [o.num_output_tokens for o in again if o.new_token_ids] == list(range(cut + 1, NEW_TOKENS + 1))
    assert again[-1].cumulative_logprob == pytest.approx(final.cumulative_logprob, abs=1e-4)
    assert llm.blocks.counts().held == 0


@pytest.mark.parametrize("cut", [1, 10])
def test_resumed_through_prefill_then_decode(model_dirs, whole, cut):
    _, outputs = whole
    final = outputs[-1]
    prefill_engine, decode_engine = engine(model_dirs["llama"]), engine(model_dirs["llama"])
    request = GenerationRequest(f"pd{cut}", PROMPT, PARAMS, resumed_output_ids=final.output_token_ids[:cut],
                                resumed_logprob=logprob_of(outputs, cut))
    first = prefill_engine.prefill([request])[request.request_id]
    assert first.new_token_ids == [final.output_token_ids[cut]] and first.num_output_tokens == cut + 1
    assert first.prefill.kv.meta.num_tokens == len(PROMPT) + cut  # the prompt and the tokens resumed
    rest = decode_engine.decode([(request, first.prefill)])[request.request_id]
    assert rest.output_token_ids == final.output_token_ids and rest.num_output_tokens == NEW_TOKENS
    assert rest.cumulative_logprob == pytest.approx(final.cumulative_logprob, abs=1e-4)
    assert prefill_engine.blocks.counts().held == 0 and decode_engine.blocks.counts().held == 0


def test_a_stop_string_across_the_cut_still_stops(whole):
    llm, outputs = whole
    final = outputs[-1]
    text = final.text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # three characters the stream writes mid-way
    params = replace(PARAMS, stop=[stop])
    cut_here = stream(llm, GenerationRequest("stopped", PROMPT, params))[-1]
    assert cut_here.finish_reason == "stop_sequence" and cut_here.text == text[: text.index(stop)]
    # Resume one token before the stop's last token was generated: the stop still matches.
    cut = len(cut_here.output_token_ids) - 1
    again = stream(llm, GenerationRequest("stopped-again", PROMPT, params,
                                          resumed_output_ids=cut_here.output_token_ids[:cut]))
    assert again[-1].finish_reason == "stop_sequence" and again[-1].text == cut_here.text
    assert again[-1].output_token_ids == cut_here.output_token_ids


def test_a_resumed_request_is_checked(whole):
    llm, _ = whole
    with pytest.raises(ValueError, match="resumed_output_ids: a resumed request has one choice"):
        GenerationRequest("x", PROMPT, PARAMS, n=2, resumed_output_ids=[1])
    with pytest.raises(ValueError, match="resumed_output_ids: token id"):
        llm.add_request(GenerationRequest("x", PROMPT, PARAMS, resumed_output_ids=[llm.vocab_size]))
    with pytest.raises(ValueError, match="resumed_output_ids: the request already has max_new_tokens"):
        llm.add_request(GenerationRequest("x", PROMPT, PARAMS, resumed_output_ids=[1] * NEW_TOKENS))
