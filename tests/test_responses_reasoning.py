"""OpenAI's Responses API on a reasoning model, with the openai SDK, unmodified: a tiny random
Qwen3 with the Qwen3 thinking models' template (the generation prompt opens ``<think>``). The SDK
talks to the dialects in-process (an httpx transport that runs what the ingress runs for
/v1/responses and /v1/chat/completions: the exchange, the chat request, the engine), so no Ray
app is started; tests/test_api_responses.py has the served app's refusals.

A random model never ends its thinking by itself: the transport gives each request a thinking
budget (the one Anthropic's budget_tokens sets on the same chat request), which writes
``</think>`` after BUDGET tokens, so that an answer follows. The engine is float32 and every
request is seeded, so answers are compared exactly."""

import asyncio
import copy
import json
import time

from fastapi.exceptions import RequestValidationError
import httpx
import openai
from pydantic import ValidationError
import pytest
from transformers import AutoTokenizer

from dialects.errors import APIError, on_validation_error
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from dialects.reasoning import THINK_END, THINK_START
from dialects.responses import ResponsesExchange, ResponseStore
from dialects.responses_schema import ResponsesRequest
from engine.execution.tiny_model import ensure_tiny_model
from tests.test_reasoning import engine_with_template
from tests.test_reasoning_grammar import THINKING_TEMPLATE, long_qwen3

CAP = 64
BUDGET = 8
LIMIT = 24  # max_output_tokens: the budget, </think>'s 6 tokens, some answer
MODEL = "tiny-qwen3"
QUESTION = "Why is the sky blue?"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
               "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA, "strict": True}
# The answer after the thinking as JSON: it ends by itself (the response is completed), where the
# random model's free text runs to max_output_tokens (incomplete).
CITY = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}}


class InProcess:
    """What the ingress does for /v1/responses and /v1/chat/completions, with ``engine`` stepped
    here; ``choices``: the last request's, for the token ids behind its usage."""

    def __init__(self, engine, front) -> None:
        self.engine, self.front, self.store = engine, front, ResponseStore()
        self.choices = []

    def handle(self, http: httpx.Request) -> httpx.Response:
        raw = json.loads(http.content)
        try:
            if http.url.path.endswith("/responses"):
                body = ResponsesRequest.model_validate(raw)
                exchange = ResponsesExchange(body, self.front, self.store)
                request, request_id = exchange.chat, exchange.id
            else:
                body = request = ChatCompletionRequest.model_validate(raw)
                request_id = "chatcmpl-test"
            request._thinking_budget = BUDGET
            self.choices = self.front.chat_choices(request, request_id, time.time() + 600)
        except ValidationError as error:  # as the ingress's handler answers it
            refusal = asyncio.run(on_validation_error(None, RequestValidationError(error.errors())))
            return httpx.Response(refusal.status_code, content=refusal.body)
        except APIError as error:
            return httpx.Response(error.status, json=error.body())
        (choice,) = self.choices
        self.engine.add_request(choice.request)
        writer = exchange.writer(self.choices) if body.stream else None
        events = ""
        for _ in range(4 * CAP):  # bounded: one token a step, at most CAP of them
            for output in self.engine.step():
                choice.outputs.append(output)
                events += writer.write(0, output) if writer else ""
            if choice.outputs and choice.final.finished:
                break
        if writer is not None:
            return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})
        if isinstance(body, ResponsesRequest):
            return httpx.Response(200, json=exchange.response(self.choices))
        return httpx.Response(200, json=self.front.chat_response(request_id, self.choices, 0))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = engine_with_template(long_qwen3(tmp_path_factory.mktemp("qwen3") / MODEL), THINKING_TEMPLATE)
    in_process = InProcess(engine, OpenAIFrontend(engine.tokenizer, MODEL, engine.vocab_size, 1024, CAP))
    client = openai.OpenAI(base_url="http://in-process/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(in_process.handle)))
    return in_process, client


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
    in_process, client = served
    response = create(client)
    ids, decode = in_process.choices[0].final.output_token_ids, in_process.engine.tokenizer.decode
    counted = response.usage.output_tokens_details.reasoning_tokens
    assert BUDGET < counted < response.usage.output_tokens  # the budget's tokens, the tag's, then the answer
    assert decode(ids[:counted]).endswith(THINK_END) and THINK_END not in decode(ids[:counted - 1])
    # Cut while it thinks: every token is the thinking's, and the reasoning item is all there is.
    cut = create(client, max_output_tokens=BUDGET // 2)
    assert [item.type for item in cut.output] == ["reasoning"] and cut.status == "incomplete"
    assert cut.output[0].status == "incomplete"
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == BUDGET // 2
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
    assistant = ResponsesExchange(body, served[0].front, ResponseStore()).chat.messages[1]
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
    in_process, _ = served
    graded = copy.deepcopy(in_process.engine.tokenizer)
    graded.chat_template = "{{- 'Effort: ' + reasoning_effort + '\\n' if reasoning_effort is defined }}" + \
        THINKING_TEMPLATE
    front = OpenAIFrontend(graded, MODEL, in_process.engine.vocab_size, 1024, CAP)
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
