"""Structured output and tool grammars start after the thinking (sampling/reasoning_grammar.py):
a tiny random Qwen3 with the real Qwen3 chat template, and the same template as Qwen3's thinking
models write it (the generation prompt opens ``<think>``, so the output starts inside the
thinking). A random model never writes ``</think>`` by itself: a thinking budget ends its
thinking (Anthropic's budget_tokens uses the same), so the grammar has an answer to constrain.
The engine is float32: the free thinking is compared token for token with a run whose only
constraint is that its text is UTF-8 (llguidance reads text as UTF-8; the random model's
byte-level tokens often break it within a few tokens, which a real model's thinking does not)."""


from dataclasses import replace
import json
from pathlib import Path
import time

import jsonschema
import pytest
from transformers import Qwen3Config

from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.reasoning import ReasoningParser
from engine.outputs import STOP
from sampling.grammar import Grammar, allowed_tokens
from sampling.reasoning_grammar import THINK_END, THINK_START, THINKS_IF_OPENED, THINKS_INSIDE
from tests.models import COMMON, make_random_model
from tests.test_reasoning import TEMPLATE, engine_with_template

# Qwen3's thinking models' template: the generation prompt opens <think> (deepseek_r1's parser).
THINKING_TEMPLATE = TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "unit": {"enum": ["m", "s"]}},
          "required": ["answer", "unit"], "additionalProperties": False}
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "result", "schema": SCHEMA}}
BUDGET = 10
SEEDS = range(1, 4)


def long_qwen3(directory: Path) -> Path:
    """A tiny random Qwen3 of 1024 positions (the tools' system prompt takes ~480 of tiny-llama's
    tokens, a call ~50) in ``directory``."""
    longer = {**COMMON, "max_position_embeddings": 1024}
    return make_random_model(directory, "qwen3",
                             make_config=lambda vocab: Qwen3Config(vocab_size=vocab, head_dim=32, **longer))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return long_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")


@pytest.fixture(scope="module")
def opening(model_dir):
    assert THINKING_TEMPLATE != TEMPLATE
    engine = engine_with_template(model_dir, THINKING_TEMPLATE)
    return engine, OpenAIFrontend(engine.tokenizer, "tiny-qwen3", engine.vocab_size, 1024, 96)


def chat(front, **fields):
    body = ChatCompletionRequest.model_validate({"model": "tiny-qwen3", "max_tokens": 96, "temperature": 1.0,
                                                 "messages": [{"role": "user", "content": "How far?"}], **fields})
    return front.chat_choices(body, f"r{time.monotonic_ns()}", time.time() + 600)[0]


def run(engine, choice):
    choice.outputs = [engine.generate([choice.request])[choice.request.request_id]]
    return choice


def test_the_answer_after_the_thinking_follows_the_schema_and_the_thinking_is_free(opening):
    engine, front = opening
    assert front.reasoning == ReasoningParser("deepseek_r1")
    for seed in SEEDS:
        constrained = chat(front, seed=seed, response_format=FORMAT)
        grammar = constrained.request.params.grammar
        assert grammar.thinking == THINKS_INSIDE
        # The budget ends the random model's thinking (no field of chat's sets it; Anthropic's does).
        constrained.request.params.grammar = replace(grammar, thinking_budget=BUDGET)
        run(engine, constrained)
        free = chat(front, seed=seed, max_tokens=BUDGET)
        free.request.params.grammar = Grammar("text")  # any UTF-8 text, from the first token
        run(engine, free)
        # The thinking is the model's own: the same tokens as with no constraint but UTF-8.
        assert constrained.final.output_token_ids[:BUDGET] == free.final.output_token_ids[:BUDGET], seed
        message, _ = front.chat_message(constrained)
        assert constrained.final.text == message["reasoning_content"] + THINK_END + message["content"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert constrained.final.finish_reason == STOP  # the grammar completed, nothing after the JSON


def test_a_named_tool_is_called_after_the_thinking(opening):
    engine, front = opening
    tools = [{"type": "function", "function": {"name": "measure", "parameters": DIGIT}}]
    for seed in SEEDS[:2]:
        choice = chat(front, seed=seed, tools=tools, tool_choice={"type": "function", "function": {"name": "measure"}})
        choice.request.params.grammar = replace(choice.request.params.grammar, thinking_budget=BUDGET)
        message, called = front.chat_message(run(engine, choice))
        assert called and message["reasoning_content"] and len(message["tool_calls"]) == 1, seed
        jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]), DIGIT)


def test_a_qwen3_output_thinks_only_when_it_opens_the_tag(model_dir):
    """Qwen3's template: the model opens <think> itself; what does not open it is the answer,
    constrained from its first token (as the parser reads it: all content)."""
    engine = engine_with_template(model_dir, TEMPLATE)
    front = OpenAIFrontend(engine.tokenizer, "tiny-qwen3", engine.vocab_size, 1024, 96)
    grammar = chat(front, response_format=FORMAT).request.params.grammar
    assert grammar.thinking == THINKS_IF_OPENED
    plain = chat(front, response_format=FORMAT, chat_template_kwargs={"enable_thinking": False})
    assert plain.reasoning is None and plain.request.params.grammar.thinking is None  # from the first token
    compiler, tokenizer = engine.grammars, engine.grammars.tokenizer()

    def allowed(ids: list[int]) -> set[str]:
        mask = allowed_tokens(compiler.bitmask(compiler.matcher(grammar, ids))[None], engine.vocab_size)[0]
        return {engine.tokenizer.decode([t]) for t in mask.nonzero().flatten().tolist()}

    first = allowed([])
    assert "<" in first and '{"' in first and "a" not in first  # the tag's start or the JSON's
    thinking = allowed(tokenizer.tokenize_str(THINK_START + "any text, {not JSON"))
    assert {"a", "}", "<"} <= thinking  # free text
    after = allowed(tokenizer.tokenize_str(THINK_START + "hm" + THINK_END))
    assert after == {'{"'}
    budget = replace(grammar, thinking_budget=3)
    spent = compiler.matcher(budget, tokenizer.tokenize_str(THINK_START))  # 5 tokens here: over the budget
    mask = allowed_tokens(compiler.bitmask(spent)[None], engine.vocab_size)[0]
    assert [engine.tokenizer.decode([t]) for t in mask.nonzero().flatten().tolist()] == ["<"]  # </think> begins



def test_a_one_token_end_tag_alone_ends_a_budgeted_thinking():
    """Where </think> is one special token (Qwen3's, DeepSeek-R1's) the grammar ends the thinking only
    at that token: the same characters spelled by ordinary tokens are thinking text, the budget
    counts on through them and then forces the token itself, after which the answer's grammar rules."""
    from transformers import AutoTokenizer

    from engine.execution.tiny_model import ensure_tiny_model
    from sampling.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    tokenizer.add_special_tokens({"additional_special_tokens": [THINK_START, THINK_END]})
    end = tokenizer.convert_tokens_to_ids(THINK_END)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = Grammar("json_object", field="response_format", thinking=THINKS_INSIDE, thinking_budget=12)
    spelled = tokenizer.encode(THINK_END, add_special_tokens=False, split_special_tokens=True)
    assert end not in spelled and len(spelled) > 1 and tokenizer.decode(spelled) == THINK_END

    def allowed(ids: list[int]) -> set[int]:
        mask = allowed_tokens(compiler.bitmask(compiler.matcher(grammar, ids))[None], len(tokenizer))[0]
        return set(mask.nonzero().flatten().tolist())

    still_thinking = allowed(spelled)  # within the budget, after the spelled tag: free text still
    assert end in still_thinking and len(still_thinking) > 100
    thought = (spelled * 3)[:12]  # the budget spent
    assert allowed(thought) == {end}
    answer = allowed(thought + [end])
    assert answer and all(tokenizer.decode([t]).startswith("{") for t in answer)
