"""OpenAI's Responses API on a reasoning model, with the openai SDK, unmodified, through the real
/v1/responses and /v1/chat/completions routes in process (tests/inprocess_app.py: the ingress's
route bodies, its error handlers, the engine client, an AsyncEngine behind them); no Ray app is
started. tests/test_api_responses.py has the served app's refusals.

The model writes one script whatever it is asked: a tiny Qwen3 with the Qwen3 thinking models'
template (the generation prompt opens ``<think>``) whose weights think THOUGHT, close ``</think>``,
then answer ANSWER over and over. A random model never ends its thinking, and a Responses request
has no thinking budget to end it: this one ends it by itself, as a reasoning model does. Its
layers add nothing to the residual stream, so its last hidden state is the current token's
embedding (orthonormal over the script's tokens), and lm_head gives the script's next token a
logit of 32 over the rest's 0: the script, whatever the sampling seed. A request's grammar (a JSON
format, a tool call) still decides what follows the thinking. Requests are seeded, so answers are
compared exactly."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deployments.config import AppArgs
from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.reasoning import THINK_END, THINK_START
from dialects.responses import ResponsesExchange, ResponseStore
from dialects.responses_schema import ResponsesRequest
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.execution.tiny_model import ensure_tiny_model
from tests.inprocess_app import InProcessApp
from tests.test_reasoning import use_template
from tests.test_reasoning_grammar import THINKING_TEMPLATE, long_qwen3

CAP = 64
THOUGHT, ANSWER = "Rayleigh", " BLUE."  # 8 and 6 tokens of tiny-llama's, none twice in the script
LIMIT = 24  # max_output_tokens: the thought, </think>'s 6 tokens, some answer
MODEL = "tiny-qwen3"
QUESTION = "Why is the sky blue?"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA, "strict": True}
# The answer after the thinking as JSON: it ends by itself (the response is completed), where the
# scripted free text runs to max_output_tokens (incomplete).
CITY = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}}


def script_ids(tokenizer) -> tuple[list[int], list[int], list[int], list[int]]:
    """The script's token ids: the prompt's last token (the newline after the generation prompt's
    <think>), THOUGHT's, </think>'s, ANSWER's; each token once."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    parts = ids(THINK_START + "\n")[-1:], ids(THOUGHT), ids(THINK_END), ids(ANSWER)
    chain = [token for part in parts for token in part]
    assert len(set(chain)) == len(chain), "a token twice in the script: its next token would be ambiguous"
    return parts


def scripted_qwen3(directory: Path) -> Path:
    """long_qwen3's model in ``directory``, its weights rewritten to write the script (the module's
    docstring says how); the thinking template its chat template."""
    long_qwen3(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    opening, thought, tag, answer = script_ids(AutoTokenizer.from_pretrained(directory))
    chain = opening + thought + tag + answer
    follows = [*itertools.pairwise(chain), (answer[-1], answer[0])]  # (token, its next): the answer repeats
    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(model.config.hidden_size, len(chain)))[0].T  # orthonormal rows
    with torch.no_grad():
        for layer in model.model.layers:  # nothing added to the residual: it stays the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[chain] = basis
        model.lm_head.weight.zero_()
        for token, following in follows:  # the final RMSNorm scales a unit vector to norm sqrt(64) = 8
            model.lm_head.weight[following] += 4 * basis[chain.index(token)]
    assert not model.config.tie_word_embeddings
    model.save_pretrained(directory)
    return use_template(directory, THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The routes over the scripted model, and an openai client that sends to them."""
    model = scripted_qwen3(tmp_path_factory.mktemp("qwen3") / MODEL)
    app = InProcessApp(AsyncEngine(EngineConfig(model=str(model), dtype="float32", max_iter_times=CAP,
                                                torch_threads=1)),
                       AppArgs(model=str(model), served_model_name=MODEL))
    client = openai.OpenAI(base_url="http://in-process/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(transport=app.transport()))
    yield app, client
    app.close()


def create(client, **fields):
    fields = {"input": QUESTION, "max_output_tokens": LIMIT, **fields}
    return client.responses.create(model=MODEL, extra_body={"seed": 7}, **fields)


def without_ids(output) -> list[dict]:
    return [{k: v for k, v in item.model_dump().items() if k != "id"} for item in output]


def test_the_thinking_is_a_reasoning_item_before_the_message(served):
    _, client = served
    response = create(client)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning, message = response.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    ((part,),) = [reasoning.content]
    assert part.type == "reasoning_text" and part.text and THINK_END not in part.text
    assert response.output_text == message.content[0].text and THINK_END not in response.output_text
    # What the model wrote, split: THOUGHT, then the answer up to max_output_tokens.
    _, thought, tag, answer = script_ids(served[0].frontend().tokenizer)
    assert part.text == THOUGHT
    said = served[0].frontend().tokenizer.decode((answer * LIMIT)[:LIMIT - len(thought) - len(tag)])
    assert response.output_text == said and response.status == "incomplete"


def test_the_reasoning_is_chats_reasoning_content(served):
    _, client = served
    response = create(client)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], seed=7,
                                          max_completion_tokens=LIMIT)
    message = chat.choices[0].message
    assert response.output[0].content[0].text == message.reasoning_content
    assert response.output_text == message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_reasoning_tokens_count_the_thinking_through_its_closing_tag(served):
    app, client = served
    decode = app.frontend().tokenizer.decode
    _, thought, tag, answer = script_ids(app.frontend().tokenizer)
    response = create(client)
    ids = thought + tag + answer * LIMIT  # what the model writes
    counted = response.usage.output_tokens_details.reasoning_tokens
    assert counted == len(thought) + len(tag) and response.usage.output_tokens == LIMIT  # the tag's, then the answer
    assert decode(ids[:counted]).endswith(THINK_END) and THINK_END not in decode(ids[:counted - 1])
    # Cut while it thinks: every token is the thinking's, and the reasoning item is all there is.
    cut = create(client, max_output_tokens=len(thought) // 2)
    assert [item.type for item in cut.output] == ["reasoning"] and cut.status == "incomplete"
    assert cut.output[0].status == "incomplete"
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == len(thought) // 2
    # effort "none" switches the template's thinking off (it reads enable_thinking): no thinking.
    plain = create(client, reasoning={"effort": "none"})
    assert [item.type for item in plain.output] == ["message"] and plain.reasoning.effort == "none"
    assert plain.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("fields", [{}, {"text": CITY, "max_output_tokens": CAP}], ids=["incomplete", "completed"])
def test_the_stream_writes_the_reasoning_item_first_and_agrees_with_the_whole_response(served, fields):
    _, client = served
    whole = create(client, **fields)
    assert whole.status == ("completed" if fields else "incomplete")
    events = list(create(client, stream=True, **fields))
    kinds = [e.type for e in events]
    thought, said = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    assert thought and said
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * thought, "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * said, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2], kinds.index("response.output_item.done")
    assert added.item.type == "reasoning" and added.output_index == 0 and events[done].item.id == added.item.id
    assert events[3].part.type == "reasoning_text"
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert {(e.item_id, e.output_index) for e in deltas} == {(added.item.id, 0)}
    text = whole.output[0].content[0].text
    assert "".join(e.delta for e in deltas) == events[kinds.index("response.reasoning_text.done")].text == text
    final = events[-1].response
    assert without_ids(final.output) == without_ids(whole.output) and final.usage == whole.usage
    if whole.status == "completed":  # the SDK's helper, which accumulates the events, ends only there
        with client.responses.stream(model=MODEL, input=QUESTION, extra_body={"seed": 7}, **fields) as stream:
            for _ in stream:
                pass
            accumulated = stream.get_final_response()  # its message parts carry a "parsed" of its own
            assert [item.type for item in accumulated.output] == ["reasoning", "message"]
            assert accumulated.output[0].content[0].text == text and accumulated.output_text == whole.output_text


def test_a_reasoning_item_sent_back_is_the_turns_thinking_as_previous_response_id_keeps_it(served):
    """A tool loop: the template keeps the thinking of the turns after the last user message, so
    the resent reasoning item reaches the prompt; continuing by previous_response_id gives the
    same prompt as resending the output with store false."""
    _, client = served
    first = create(client, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=CAP)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    reasoning, call = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    tools = {"tools": [WEATHER_TOOL], "tool_choice": "none", "max_output_tokens": 4}
    continued = create(client, previous_response_id=first.id, input=[result], **tools)
    question = {"role": "user", "content": QUESTION}
    resent = create(client, input=[question, reasoning.model_dump(exclude_none=True),
                                   call.model_dump(exclude_none=True), result], store=False, **tools)
    unthought = create(client, input=[question, call.model_dump(exclude_none=True), result], store=False, **tools)
    assert continued.usage.input_tokens == resent.usage.input_tokens > unthought.usage.input_tokens
    assert without_ids(continued.output) == without_ids(resent.output)
    body = ResponsesRequest.model_validate({"input": [question, reasoning.model_dump(exclude_none=True),
                                                      call.model_dump(exclude_none=True), result]})
    assistant = ResponsesExchange(body, served[0].frontend(), ResponseStore()).chat.messages[1]
    assert assistant.content == THINK_START + reasoning.content[0].text + THINK_END
    assert [c.function.name for c in assistant.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("fields, param", [
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the template switches thinking, grades none
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]}, "input.0.summary"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input.0.encrypted_content"),
])
def test_what_cannot_be_honoured_is_refused_by_name(served, fields, param):
    _, client = served
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, **fields)
    assert refused.value.body["param"] == param, refused.value.body


def test_reasoning_controls_follow_the_served_template(served):
    """effort reaches a template that reads reasoning_effort; a model that does not reason refuses
    effort and reasoning items by name."""
    served_front = served[0].frontend()
    graded = copy.deepcopy(served_front.tokenizer)
    graded.chat_template = "{{- 'Effort: ' + reasoning_effort + '\\n' if reasoning_effort is defined }}" + \
        THINKING_TEMPLATE
    front = OpenAIFrontend(graded, MODEL, served_front.vocab_size, 1024, CAP)
    body = ResponsesRequest.model_validate({"input": QUESTION, "reasoning": {"effort": "low"}})
    chat = ResponsesExchange(body, front, ResponseStore()).chat
    (choice,) = front.chat_choices(chat, "graded", time.time() + 600)
    assert chat.reasoning_effort == "low" and "Effort: low\n" in graded.decode(choice.request.prompt_token_ids)
    tiny_llama = AutoTokenizer.from_pretrained(ensure_tiny_model())
    plain = OpenAIFrontend(tiny_llama, "tiny-llama", len(tiny_llama), 1024, CAP)
    for fields, param in (({"input": QUESTION, "reasoning": {"effort": "low"}}, "reasoning.effort"),
                          ({"input": [{"role": "user", "content": QUESTION}, {"type": "reasoning", "summary": []}]},
                           "input.1")):
        with pytest.raises(APIError) as refused:
            ResponsesExchange(ResponsesRequest.model_validate(fields), plain, ResponseStore())
        assert refused.value.param == param and "does not reason" in refused.value.message
