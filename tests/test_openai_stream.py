"""The OpenAI stream's shape, from engine outputs made by hand: the cases a random model
cannot be made to produce on purpose (a character split over tokens, a choice with no text)."""

import json

import pytest
from transformers import AutoTokenizer

from dialects.json_types import sse_event
from dialects.openai_api import Choice, OpenAIFrontend
from dialects.openai_stream import StreamWriter
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import GenerationRequest
from engine.execution.tiny_model import ensure_tiny_model


@pytest.fixture(scope="module")
def front():
    return OpenAIFrontend(AutoTokenizer.from_pretrained(ensure_tiny_model()), "m", 891, 4096, 64)


def output(text: str, token: int, finished: bool = False, index: int = 0, reason: str | None = None):
    return RequestOutput("r", [token], text, 1, finished, reason, 1, logprobs=[TokenLogprob(token, -1.5, [])],
                         index=index)


def events(sse: str) -> list[dict]:
    return [json.loads(block.removeprefix("data: ")) for block in sse.split("\n\n") if block and "[DONE]" not in block]


def chat_writer(front, n: int = 1, include_usage: bool = False) -> StreamWriter:
    request = GenerationRequest("r", [1, 2, 3], n=n)
    choices = [Choice(j, 0, 3, request) for j in range(n)]
    return StreamWriter(front, "id", 0, choices, chat=True, include_usage=include_usage)


def test_a_character_split_over_tokens_waits_and_its_logprobs_come_with_it(front):
    writer = chat_writer(front)
    assert writer.write(0, output("", 230)) == ""  # first bytes of "ü": no text yet, nothing sent
    first = events(writer.write(0, output("ü", 188)))
    assert [e["choices"][0]["delta"] for e in first] == [{"role": "assistant", "content": "ü"}]
    assert [lp["logprob"] for lp in first[0]["choices"][0]["logprobs"]["content"]] == [-1.5, -1.5]
    later = events(writer.write(0, output("x", 29, finished=True, reason="length")))
    assert [e["choices"][0]["delta"] for e in later] == [{"content": "x"}, {}]
    assert later[-1]["choices"][0]["finish_reason"] == "length"


def test_role_once_per_choice_and_a_choice_without_text_still_ends(front):
    writer = chat_writer(front, n=2, include_usage=True)
    sent = events(writer.write(0, output("a", 5)) + writer.write(1, output("", 2, True, 1, "eos_token"))
                  + writer.write(0, output("b", 6, True, 0, "length")))
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in sent] == [
        (0, {"role": "assistant", "content": "a"}, None), (1, {"role": "assistant", "content": ""}, "stop"),
        (0, {"content": "b"}, None), (0, {}, "length")]
    assert all(e["usage"] is None for e in sent)
    writer.choices[0].outputs, writer.choices[1].outputs = [output("ab", 6, True)], [output("", 2, True)]
    closing = writer.close()
    assert closing.endswith("data: [DONE]\n\n")
    assert events(closing)[-1]["usage"]["completion_tokens"] == 2 and events(closing)[-1]["choices"] == []


def test_completion_stream_echoes_the_prompt_with_its_scores_first(front):
    request = GenerationRequest("r", [1, 450, 4], n=1)
    choice = Choice(0, 0, 3, request, prefix="The", echo_logprobs=True, scores_only=True)
    writer = StreamWriter(front, "id", 0, [choice], chat=False, suffix="!", with_logprobs=True)
    first = output("zz", 9, finished=True, reason="length")
    first.prompt_logprobs = [None, TokenLogprob(450, -2.0, [(450, -2.0)]), TokenLogprob(4, -3.0, [(7, -1.0)])]
    (event,) = events(writer.write(0, first))
    body = event["choices"][0]
    assert body["text"] == "The!" and body["finish_reason"] == "length"  # max_tokens 0: nothing generated
    assert body["logprobs"]["token_logprobs"] == [None, -2.0, -3.0]
    assert body["logprobs"]["top_logprobs"][0] is None and len(body["logprobs"]["tokens"]) == 3


def test_an_event_of_generated_text_never_splits_into_two_lines():
    """Python's splitlines (httpx's iter_lines) also ends lines at U+2028, U+0085 and others,
    which a model may generate: they are escaped, and the JSON still reads back the same."""
    text = "a\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029b 模型"
    event = sse_event({"text": text})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):]) == {"text": text} and "模型" in event
