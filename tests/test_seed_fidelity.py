"""The seeds' smaller requirements, in process through the dialects' own functions (the served
routes are tested in tests/test_api_validation.py and tests/test_serve_pd.py): Databricks' top_p 0,
TensorRT-LLM's end_id, output_ids and the operator's logits refused by name, MindIE's seed WARNING
and the last event's null text, and served-model aliases."""

import json
import logging

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from dialects import mindie
from dialects.errors import APIError
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import ChatCompletionRequest
from engine.execution.tiny_model import ensure_tiny_model
from engine.outputs import LENGTH, RequestOutput

VOCAB = 891  # tiny-llama's
LIMITS = mindie.ServedLimits(VOCAB, 1024, 10**6, 4, 64, 8)
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def front():
    return OpenAIFrontend(AutoTokenizer.from_pretrained(ensure_tiny_model()), "tiny-llama", VOCAB, 4096, 1024,
                          aliases=["gpt-3.5-turbo"])


def chat_params(front, **fields):
    (choice,) = front.chat_choices(ChatCompletionRequest(model="tiny-llama", messages=MESSAGES, **fields), "c", 0.0)
    return choice.request.params


def test_databricks_top_p_zero_is_greedy_and_below_zero_is_refused(front):
    params = chat_params(front, top_p=0.0, temperature=0.7)
    assert params.greedy and params.top_p == 1.0
    assert not chat_params(front, top_p=0.5, temperature=0.7).greedy
    with pytest.raises(ValidationError, match="top_p"):
        ChatCompletionRequest(model="tiny-llama", messages=MESSAGES, top_p=-0.1)


def test_a_model_alias_names_the_base_model_and_others_are_404(front):
    assert front.check_model("gpt-3.5-turbo") is None and front.check_model("tiny-llama") is None
    with pytest.raises(APIError) as refused:
        front.check_model("gpt-4")
    assert refused.value.status == 404 and refused.value.param == "model"


def infer_request(**parameters):
    body = mindie.InferTokenRequest(input_id=[5, 6, 7], parameters=parameters)
    return body, mindie.to_generation_request(body, "r", 0.0, LIMITS)


def test_end_id_defaults_to_minus_one_meaning_the_models_eos():
    body, request = infer_request()
    assert body.parameters.end_id == -1 and request.params.eos_token_id is None
    assert infer_request(end_id=7)[1].params.eos_token_id == 7
    with pytest.raises(ValidationError, match="end_id"):
        infer_request(end_id=-2)


def test_the_operators_filtered_logits_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^parameters.is_need_logits: .*logitsTopKPSelect"):
        infer_request(is_need_logits=True)
    infer_request(is_need_logits=False)


def finished_output(ids):
    return RequestOutput("r", ids[-1:], "x", len(ids), True, LENGTH, 9, output_token_ids=ids, text="abc")


def test_beam_width_one_named_gets_output_ids_and_sequence_length():
    body, _ = infer_request(beam_width=1)
    answer = mindie.text_response([finished_output([4, 5, 6])], body, 0)
    assert answer["details"]["output_ids"] == [[4, 5, 6]] and answer["details"]["sequence_length"] == [3]
    body, _ = infer_request(details=True)  # not asked: MindIE's details as they are
    assert "output_ids" not in mindie.text_response([finished_output([4, 5, 6])], body, 0)["details"]


def test_a_seed_near_its_maximum_draws_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dialects.mindie"):
        infer_request(seed=2**63 - 1)
        assert not caplog.records
        _, request = infer_request(seed=2**64 - 1)
    assert request.params.seed == 2**64 - 1  # used as it is
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "parameters.seed" in record.getMessage()


def test_the_last_stream_events_token_text_is_null():
    body, _ = infer_request()
    middle = RequestOutput("r", [5], "ab", 1, False, None, 9)
    last = finished_output([5, 6])
    assert json.loads(mindie.stream_event([middle], body, True, 1.0)[len("data: "):])["token"]["text"] == "ab"
    event = json.loads(mindie.stream_event([middle, last], body, False, 1.0)[len("data: "):])
    assert event["token"] == {"id": 6, "text": None} and event["generated_text"] == "abc"
