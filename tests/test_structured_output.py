"""Grammar-constrained decoding in the engine: every seed's output parses and validates, through
one engine or through P and D, with n choices and beside unconstrained batch mates."""

import json
import re

import jsonschema
import numpy as np
import pydantic_core
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EOS, LENGTH, STOP
from engine.request import GenerationRequest
from sampling import SamplingParams
from sampling.grammar import Grammar, allowed_tokens, check_grammar

PROMPT = [1, 40, 41, 42, 43]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = Grammar("json_schema", json.dumps(SCHEMA))
JSON_OBJECT = Grammar("json_object")
SEEDS = range(1, 21)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny-llama"))


def constrained(grammar, seed, max_new_tokens=200, **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, grammar=grammar, **kw)


def requests(grammar, **kw):
    return [GenerationRequest(f"s{seed}", PROMPT, constrained(grammar, seed, **kw)) for seed in SEEDS]


def test_json_schema_output_validates_for_every_seed(engine):
    for out in engine.generate(requests(JSON_SCHEMA)).values():
        assert out.finish_reason == STOP, out.text  # the grammar completed, not the length
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_output_is_one_object_for_every_seed(engine):
    """Any JSON object: with random weights most seeds run past the length. Every seed's output is
    one object: whole where the grammar completed it, else the start of one (pydantic_core's
    partial parser, not the grammar engine, reads it as an object, and no whole object ends
    inside it)."""
    outs = engine.generate(requests(JSON_OBJECT, max_new_tokens=60)).values()
    assert any(out.finish_reason == STOP for out in outs), "no seed completed an object"
    for out in outs:
        if out.finish_reason == STOP:
            assert isinstance(json.loads(out.text), dict), out.text
            continue
        assert out.finish_reason == LENGTH, (out.finish_reason, out.text)
        assert isinstance(pydantic_core.from_json(out.text, allow_partial="trailing-strings"), dict), out.text
        with pytest.raises(json.JSONDecodeError):
            json.JSONDecoder().raw_decode(out.text)  # no whole object followed by more


def test_unconstrained_output_is_not_json():
    """The mask is what makes the output valid: the same seeds without it give no JSON."""
    e = LLMEngine(EngineConfig(model="tiny-llama"))
    plain = [GenerationRequest(f"p{seed}", PROMPT, SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed))
             for seed in SEEDS]
    assert not any(out.text.startswith("{") for out in e.generate(plain).values())


def test_prefill_and_decode_equal_one_engine(engine):
    alone = engine.generate(requests(JSON_SCHEMA))
    p, d = LLMEngine(EngineConfig(model="tiny-llama")), LLMEngine(EngineConfig(model="tiny-llama"))
    for request in requests(JSON_SCHEMA):
        prefill = p.prefill([request])[request.request_id]
        assert prefill.prefill is not None  # P's first token did not end it: D goes on
        decoded = d.decode([(request, prefill.prefill)])
        assert decoded[request.request_id].output_token_ids == alone[request.request_id].output_token_ids


def test_n_choices_each_follow_the_grammar(engine):
    request = GenerationRequest("n", PROMPT, constrained(JSON_SCHEMA, 7), n=4)
    choices = engine.generate_choices([request])["n"]
    assert len(choices) == 4 and len({c.text for c in choices}) > 1
    for choice in choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_unconstrained_batch_mates_are_unchanged(engine):
    mate = GenerationRequest("mate", PROMPT, SamplingParams(max_new_tokens=24, temperature=1.0, seed=99,
                                                            ignore_eos=True))
    alone = engine.generate([mate])["mate"].output_token_ids
    together = engine.generate([mate, *requests(JSON_SCHEMA)[:8]])
    assert together["mate"].output_token_ids == alone


def test_length_cut_is_incomplete_json(engine):
    out = engine.generate([GenerationRequest("cut", PROMPT, constrained(JSON_SCHEMA, 3, max_new_tokens=4))])["cut"]
    assert out.finish_reason == LENGTH and out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_logprobs_are_of_the_constrained_distribution(engine):
    """Each step's logprobs are the log-softmax of that step's raw logits over the tokens the
    grammar allows there (temperature 1, no processor): normalised over the allowed tokens only,
    the chosen token's and the top 5's, which are all allowed."""
    params = constrained(JSON_SCHEMA, 5, logprobs=5, return_generation_logits=True)
    engine.add_request(GenerationRequest("lp", PROMPT, params))
    outs = engine.run_to_completion()["lp"]
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = [lp for out in outs for lp in out.logprobs]
    logits = torch.from_numpy(np.concatenate([out.generation_logits for out in outs]))  # [steps, V], raw
    assert len(tokens) == len(logprobs) == len(logits) > 3
    first = logprobs[0]  # the first token must open the object
    assert engine.tokenizer.decode([first.token_id]).startswith("{")
    for t, (token, got) in enumerate(zip(tokens, logprobs)):
        matcher = engine.grammars.matcher(JSON_SCHEMA, tokens[:t])
        allowed = allowed_tokens(engine.grammars.bitmask(matcher)[None], engine.vocab_size)[0]  # [V] bool
        want = logits[t].masked_fill(~allowed, float("-inf")).log_softmax(-1)  # [V]
        assert got.logprob == pytest.approx(want[token].item(), abs=1e-4), t
        top = want.topk(min(5, int(allowed.sum())))
        assert [i for i, _ in got.top[:len(top.indices)]] == top.indices.tolist(), t
        assert [lp for _, lp in got.top[:len(top.indices)]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(lp < -1e30 for _, lp in got.top[len(top.indices):])  # forbidden: no mass (float32's lowest)


def test_bad_schemas_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^response_format.json_schema.schema: .*"):
        check_grammar(Grammar("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}),
                              "response_format.json_schema.schema"))
    with pytest.raises(ValueError, match=r"^min_new_tokens: "):
        SamplingParams(min_new_tokens=3, grammar=JSON_OBJECT)


def test_regex_and_choice_extensions_for_every_seed(engine):
    regex = Grammar("regex", r"[0-9]{3}-[a-z]{2,4}( ok)?")
    choice = Grammar("lark", 'start: "Köln" | "Zürich" | "東京" | "a\\"b"\n')
    for grammar, accept in ((regex, lambda t: re.fullmatch(regex.text, t)),
                            (choice, lambda t: t in ("Köln", "Zürich", "東京", 'a"b'))):
        outs = engine.generate(requests(grammar, max_new_tokens=30)).values()
        assert all(out.finish_reason in (STOP, EOS) and accept(out.text) for out in outs), [o.text for o in outs]
        assert len({out.text for out in outs}) > 1  # sampled, not forced to one answer


def test_a_grammar_nothing_matches_is_refused_before_it_runs(engine):
    with pytest.raises(ValueError, match=r"^structured_outputs.regex: .*no output matches it"):
        engine.grammars.check(Grammar("regex", r"[^\s\S]", "structured_outputs.regex"))
