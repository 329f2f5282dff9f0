"""vLLM's sampling extensions on chat and completions, without a server: each one reaches the
engine's own control and changes the output as it says, or is refused with a 400 naming it; and
the bodies `vllm bench serve` sends by default are accepted (tests/test_api_openai.py sends them
over HTTP)."""

import json
import time

import pydantic
import pytest

from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest, CompletionRequest
from dialects.openai_stream import StreamWriter
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EOS, LENGTH, STOP

MODEL = "tiny-llama"
EOS_ID = 2  # tiny-llama's </s>
PROMPT = "The weather in Köln is"


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=MODEL, dtype="float32"))


@pytest.fixture(scope="module")
def front(engine):
    return OpenAIFrontend(engine.tokenizer, MODEL, engine.vocab_size, 4096, 64)


def vllm_bench_completion(prompt: str, output_len: int) -> dict:
    """The body of vLLM's `vllm bench serve --backend openai` (vllm/benchmarks/lib/
    endpoint_request_func.py, async_request_openai_completions), logprobs left at its default."""
    return {"model": MODEL, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}}


def vllm_bench_chat(prompt: str, output_len: int) -> dict:
    """The body of `vllm bench serve --backend openai-chat` (async_request_openai_chat_completions)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True}}


def complete(engine, front, **fields):
    """One completion of PROMPT through the frontend and the engine: (choice, output)."""
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                                             **fields})
    choice = front.completion_choices(body, f"c{time.monotonic_ns()}", time.time() + 600)[0]
    return choice, engine.generate([choice.request])[choice.request.request_id]


def test_vllm_bench_serve_bodies_are_served(engine, front):
    completion = CompletionRequest.model_validate(vllm_bench_completion(PROMPT, 5) | {"ignore_eos": True})
    chat = ChatCompletionRequest.model_validate(vllm_bench_chat(PROMPT, 5) | {"ignore_eos": True})
    requests = [front.completion_choices(completion, "bench-c", time.time() + 600)[0].request,
                front.chat_choices(chat, "bench-chat", time.time() + 600)[0].request]
    outputs = engine.generate(requests)
    assert all(outputs[r.request_id].num_output_tokens == 5 for r in requests)


def test_each_extension_reaches_the_engines_control(front):
    body = CompletionRequest.model_validate({
        "model": MODEL, "prompt": PROMPT, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 2,
        "skip_special_tokens": False, "ignore_eos": True, "priority": 2,
        "include_stop_str_in_output": False, "spaces_between_special_tokens": True})
    choice = front.completion_choices(body, "map", time.time() + 600)[0]
    params = choice.request.params
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_new_tokens) == (7, 0.05, 1.3, 2)
    assert params.skip_special_tokens is False and params.ignore_eos and choice.request.priority == 2
    stops = CompletionRequest.model_validate({"model": MODEL, "prompt": PROMPT, "stop_token_ids": [5, 9]})
    assert front.completion_choices(stops, "s", time.time() + 600)[0].request.params.stop_token_ids == [[5], [9]]
    off = front.completion_choices(CompletionRequest.model_validate(
        {"model": MODEL, "prompt": PROMPT, "top_k": -1, "priority": 0}), "off", time.time() + 600)[0]
    assert off.request.params.top_k == 0 and off.request.priority == 5  # vLLM's "off" and default


def test_stop_token_ids_end_the_output_at_the_token(engine, front):
    seeded = {"temperature": 1.0, "seed": 7, "max_tokens": 16, "ignore_eos": True}
    _, free = complete(engine, front, **seeded)
    ids = free.output_token_ids
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token first written at position i
    _, stopped = complete(engine, front, stop_token_ids=[ids[at]], **seeded)
    assert stopped.output_token_ids == ids[:at + 1] and stopped.finish_reason == STOP


def test_min_tokens_holds_eos_back(engine, front):
    eos_first = {"logit_bias": {str(EOS_ID): 100.0}}  # EOS is the greedy choice at every step
    _, plain = complete(engine, front, **eos_first)
    _, held = complete(engine, front, min_tokens=4, **eos_first)
    assert plain.num_output_tokens == 1 and plain.finish_reason == EOS
    assert held.num_output_tokens == 5 and held.output_token_ids[-1] == EOS_ID and held.finish_reason == EOS


def test_skip_special_tokens_false_writes_them(engine, front):
    forced = {"logit_bias": {str(EOS_ID): 100.0}, "ignore_eos": True, "max_tokens": 3}
    _, skipped = complete(engine, front, **forced)
    _, written = complete(engine, front, skip_special_tokens=False, **forced)
    assert skipped.output_token_ids == written.output_token_ids == [EOS_ID] * 3
    assert skipped.text == "" and written.text == "</s>" * 3 and written.finish_reason == LENGTH


def test_repetition_penalty_changes_the_greedy_output(engine, front):
    _, plain = complete(engine, front, max_tokens=24)
    _, penalised = complete(engine, front, max_tokens=24, repetition_penalty=2.0)
    assert penalised.output_token_ids != plain.output_token_ids
    assert len(set(penalised.output_token_ids)) >= len(set(plain.output_token_ids))


def test_truncate_prompt_tokens_keeps_the_last_ones(engine, front):
    whole, _ = complete(engine, front)
    cut, _ = complete(engine, front, truncate_prompt_tokens=3)
    assert cut.request.prompt_token_ids == whole.request.prompt_token_ids[-3:]
    chat = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                                 "truncate_prompt_tokens": 4})
    assert len(front.chat_choices(chat, "t", time.time() + 600)[0].request.prompt_token_ids) == 4
    with pytest.raises(APIError) as error:
        complete(engine, front, truncate_prompt_tokens=5000)
    assert error.value.status == 400 and error.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize("fields, param", [
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"min_tokens": 2, "stop": ["x"]}, "min_tokens"),
    ({"min_tokens": 2, "stop_token_ids": [4]}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 1, "structured_outputs": {"regex": "[ab]+"}}, "min_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),  # vLLM extensions not offered are unknown fields
])
def test_what_cannot_be_honoured_is_refused_by_name(fields, param):
    with pytest.raises(pydantic.ValidationError) as error:
        CompletionRequest.model_validate({"model": MODEL, "prompt": PROMPT, **fields})
    assert param in str(error.value)


def test_stop_token_ids_outside_the_vocabulary_are_refused(engine, front):
    with pytest.raises(APIError) as error:
        complete(engine, front, stop_token_ids=[3, engine.vocab_size])
    assert error.value.status == 400 and error.value.param == "stop_token_ids.1"


def streamed_text(engine, front, choice, chat: bool) -> str:
    """The text a stream of ``choice`` sends: the engine stepped, each output through the writer."""
    writer, events = StreamWriter(front, "s", 0, [choice], chat=chat), ""
    engine.add_request(choice.request)
    for _ in range(200):  # bounded: one token a step
        for output in engine.step():
            choice.outputs.append(output)
            events += writer.write(0, output)
        if choice.outputs and choice.final.finished:
            break
    chunks = [json.loads(line[6:])["choices"][0] for line in events.split("\n\n") if line.startswith("data: {")]
    return "".join((c["delta"].get("content") or "") if chat else c["text"] for c in chunks)


@pytest.mark.parametrize("chat", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string_whole_and_streamed(engine, front, chat):
    def choice(**fields):
        body = {"model": MODEL, "max_tokens": 24, "temperature": 0.0, **fields}
        if chat:
            request = ChatCompletionRequest.model_validate({**body, "messages": [{"role": "user", "content": PROMPT}]})
            return front.chat_choices(request, f"c{time.monotonic_ns()}", time.time() + 600)[0]
        return front.completion_choices(CompletionRequest.model_validate({**body, "prompt": PROMPT}),
                                        f"c{time.monotonic_ns()}", time.time() + 600)[0]

    def run(c):
        c.outputs = [engine.generate([c.request])[c.request.request_id]]
        return c

    free = run(choice()).text
    stop = free[len(free) // 2:len(free) // 2 + 2]  # two characters from the middle of the greedy text
    assert stop.strip(), free
    cut = free[:free.index(stop)]
    assert run(choice(stop=[stop])).text == cut  # the engine cuts it
    kept = run(choice(stop=[stop], include_stop_str_in_output=True))
    assert kept.text == cut + stop and kept.final.finish_reason == STOP
    assert streamed_text(engine, front, choice(stop=[stop], include_stop_str_in_output=True), chat) == cut + stop
    assert streamed_text(engine, front, choice(stop=[stop]), chat) == cut

