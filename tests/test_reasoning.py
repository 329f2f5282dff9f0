"""Reasoning output with a tiny random Qwen3 that carries the real Qwen3 chat template
(tests/qwen3_chat_template.jinja, written into the tests, nothing downloaded): the parser is on
for that template only; enable_thinking false reaches the template; the split reasoning_content +
content gives back the raw text, whole and streamed at every split; template variables the
template does not read are refused by name (grammars after the thinking: test_reasoning_grammar.py)."""

import json
from pathlib import Path
import time

import pytest

from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.openai_stream import StreamWriter
from dialects.reasoning import THINK_END, THINK_START, ReasoningParser, ReasoningStream
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import LENGTH, STOP, RequestOutput
from tests.models import make_random_model

TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
MODEL = "tiny-qwen3"
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
THOUGHT = "<think>\nThe user adds. 2 + 3 = 5.\n</think>\n\nIt is 5."


def use_template(directory: Path, template: str) -> Path:
    """``directory`` (a model's, or its tokenizer's), its chat template replaced by ``template``."""
    (directory / "chat_template.jinja").write_text(template)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def engine_with_template(directory: Path, template: str) -> LLMEngine:
    """A float32 engine on the model in ``directory``, its chat template replaced by ``template``."""
    return LLMEngine(EngineConfig(model=str(use_template(directory, template)), dtype="float32"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return engine_with_template(make_random_model(tmp_path_factory.mktemp("qwen3") / MODEL, "qwen3"), TEMPLATE)


@pytest.fixture(scope="module")
def front(engine):
    return OpenAIFrontend(engine.tokenizer, MODEL, engine.vocab_size, 512, 32)


def chat(front, **fields):
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **fields})
    return front.chat_choices(body, f"r{time.monotonic_ns()}", time.time() + 600)


def test_the_parser_follows_the_template(engine, front):
    assert front.reasoning == ReasoningParser("qwen3")  # the model opens <think> itself
    tiny_llama = OpenAIFrontend(LLMEngine(EngineConfig(model="tiny-llama")).tokenizer, "tiny-llama", 891, 512, 32)
    assert tiny_llama.reasoning is None  # no <think> in its template: text stays content


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(engine, front):
    thinking, plain = chat(front)[0], chat(front, chat_template_kwargs={"enable_thinking": False})[0]
    assert engine.tokenizer.decode(plain.request.prompt_token_ids).endswith("<|im_start|>assistant\n" + THINK_START +
                                                                            "\n\n" + THINK_END + "\n\n")
    assert engine.tokenizer.decode(thinking.request.prompt_token_ids).endswith("<|im_start|>assistant\n")
    assert plain.reasoning is None and thinking.reasoning is not None
    outputs = engine.generate([plain.request])
    plain.outputs = [outputs[plain.request.request_id]]
    message, _ = front.chat_message(plain)
    assert message["content"] == plain.final.text and "reasoning_content" not in message


def with_text(choice, text: str, pieces: list[str]):
    """``choice`` as if the engine had written ``text`` in ``pieces``."""
    choice.outputs = [RequestOutput(choice.request.request_id, [], piece, j + 1, j == len(pieces) - 1,
                                    STOP if j == len(pieces) - 1 else None, 1) for j, piece in enumerate(pieces)]
    choice.outputs[-1].text = text
    return choice


def test_the_split_gives_back_the_raw_text_whole_and_streamed(front):
    choice = with_text(chat(front)[0], THOUGHT, [THOUGHT])
    message, _ = front.chat_message(choice)
    assert message["reasoning_content"] == message["reasoning"] == "\nThe user adds. 2 + 3 = 5.\n"
    assert THINK_START + message["reasoning_content"] + THINK_END + message["content"] == THOUGHT
    for cut in range(len(THOUGHT) + 1):  # every split of the text into two engine outputs
        streamed = with_text(chat(front)[0], THOUGHT, [THOUGHT[:cut], THOUGHT[cut:]])
        writer = StreamWriter(front, "id", 0, [streamed], chat=True)
        events = "".join(writer.write(0, output) for output in streamed.outputs)
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in events.split("\n\n") if line]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        assert "".join(d.get("content") or "" for d in deltas) == message["content"], cut


# Output that thinks, then answers: what the random model writes when a regex makes it.
THINKS_THEN_ANSWERS = r"<think>\n[a-z]{2,5} [a-z]{2,5}\n</think>\n\n[a-z]{2,5}\."


def test_generated_text_splits_back_into_itself(engine, front):
    """The random model never opens <think> by itself: here a regex makes it think, then answer
    (thinking switched off for that request, so the regex covers the whole output), seeded. Each
    output, given to a choice that thinks, splits into reasoning and content that join back into it."""
    for seed in range(1, 6):
        forced = chat(front, seed=seed, max_tokens=32, structured_outputs={"regex": THINKS_THEN_ANSWERS},
                      chat_template_kwargs={"enable_thinking": False})[0]
        choice = chat(front, seed=seed)[0]  # thinking on: the qwen3 parser splits its output
        choice.outputs = [engine.generate([forced.request])[forced.request.request_id]]
        assert choice.final.finish_reason != LENGTH, choice.final.text  # the regex completed
        message, _ = front.chat_message(choice)
        reasoning, content = message.get("reasoning_content"), message["content"]
        assert reasoning and content and THINK_START not in content and THINK_END not in reasoning
        assert THINK_START + reasoning + THINK_END + content == choice.final.text


def test_a_deepseek_r1_output_thinks_from_its_first_token():
    parser, text = ReasoningParser("deepseek_r1"), "plan</think>answer"
    assert parser.split(text) == ("plan", "answer") and parser.split("cut short") == ("cut short", "")
    stream = ReasoningStream(parser)
    assert stream.feed("pl", False) == ("pl", "") and stream.feed("an</th", False) == ("an", "")
    assert stream.feed("ink>answer", True) == ("", "answer")


@pytest.mark.parametrize("fields, param", [
    ({"chat_template_kwargs": {"thinking_budget": 5}}, "chat_template_kwargs.thinking_budget"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # Qwen3's template reads no effort
])
def test_what_cannot_be_honoured_is_refused_by_name(front, fields, param):
    with pytest.raises(APIError) as error:
        chat(front, **fields)
    assert error.value.status == 400 and error.value.param == param


def test_constrained_output_works_with_thinking_off(front):
    choice = chat(front, response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})[0]
    assert choice.request.params.grammar is not None and choice.reasoning is None
