"""MindIE's answer and stream events as the seeds write them (seeds/000), built from engine outputs
without a server: dialects/mindie.py's ``text_response``, ``stream_event``, ``error_event`` and
the ``details`` in them. The served routes send the same (tests/test_seed_examples.py,
tests/test_api_validation.py); these reach each field in milliseconds (and in ``make mutants``)."""

import base64
import json

import numpy as np
import pytest

from dialects.mindie import InferTokenRequest, error_event, stream_event, text_response
from engine.decoding.beam_search import Hypothesis
from engine.outputs import ABORT, EOS, LENGTH, TIMEOUT, RequestOutput, TokenLogprob

PAD = 0


def output(tokens: list[int], new_text: str, done: bool, reason: str | None = None, total: int = 1,
           logprobs: list[TokenLogprob] = (), **fields) -> RequestOutput:
    return RequestOutput("r", tokens, new_text, total, done, reason, seed=7, logprobs=list(logprobs), **fields)


def request(**parameters) -> InferTokenRequest:
    return InferTokenRequest(input_id=[1, 2, 3], parameters=parameters)


def answer() -> list[RequestOutput]:
    """Two tokens, "He" then "llo", ending at EOS, with log-probabilities."""
    first = TokenLogprob(11, -0.5, [(11, -0.5), (12, -1.5)])
    last = TokenLogprob(12, -0.25, [(12, -0.25)])
    return [output([11], "He", False, logprobs=[first]),
            output([12], "llo", True, EOS, total=2, logprobs=[last], cumulative_logprob=-0.75,
                   output_token_ids=[11, 12], text="Hello")]


def floats(encoded: dict) -> np.ndarray:
    assert encoded["dtype"] == "float32"
    return np.frombuffer(base64.b64decode(encoded["data"]), "<f4").reshape(encoded["shape"])


def test_the_text_answer_has_details_only_when_asked():
    assert text_response(answer(), request(), PAD) == {"generated_text": "Hello"}
    details = text_response(answer(), request(details=True), PAD)["details"]
    assert details == {"finish_reason": "eos_token", "generated_tokens": 2, "seed": 7}


def test_log_probs_asked_for_give_each_token_and_the_sum():
    details = text_response(answer(), request(details=True, return_log_probs=True), PAD)["details"]
    assert details["cumulative_logprob"] == -0.75
    assert details["tokens"] == [
        {"id": 11, "text": None, "logprob": -0.5, "top_logprobs": [{"id": 11, "logprob": -0.5}, {"id": 12, "logprob": -1.5}]},
        {"id": 12, "text": None, "logprob": -0.25, "top_logprobs": [{"id": 12, "logprob": -0.25}]}]


@pytest.mark.parametrize("reason, err_msg", [(TIMEOUT, "request timed out"), (ABORT, "request cancelled")])
def test_an_answer_ended_early_says_why_in_err_msg(reason, err_msg):
    outputs = [output([11], "He", True, reason, output_token_ids=[11], text="He")]
    details = text_response(outputs, request(details=True), PAD)["details"]
    assert details == {"finish_reason": "stop_sequence", "generated_tokens": 1, "seed": 7, "err_msg": err_msg}


def test_naming_beam_width_gives_trtllms_outputs_of_its_one_beam():
    details = text_response(answer(), request(beam_width=1), PAD)["details"]
    assert details["output_ids"] == [[11, 12]] and details["sequence_length"] == [2]


def test_beams_come_best_first_padded_with_the_pad_id():
    beams = [Hypothesis([5, 6, 7], -0.1, -0.3, [-0.1, -0.1, -0.1]), Hypothesis([8], -0.9, -0.9, [-0.9])]
    beam_logits = np.arange(12, dtype=np.float32).reshape(2, 3, 2)  # [beams, longest, V]
    final = output([5, 6, 7], "abc", True, LENGTH, total=3, output_token_ids=[5, 6, 7], text="abc", beams=beams,
                   generation_logits=beam_logits)
    details = text_response([final], request(beam_width=2, return_log_probs=True, return_generation_logits=True),
                            PAD)["details"]
    assert np.array_equal(floats(details["generation_logits"]), beam_logits)
    assert details["output_ids"] == [[5, 6, 7], [8, PAD, PAD]] and details["sequence_length"] == [3, 1]
    assert details["cum_log_probs"] == [-0.3, -0.9]
    assert details["output_log_probs"] == [[-0.1, -0.1, -0.1], [-0.9, 0.0, 0.0]]


def test_logits_asked_for_travel_as_float32_arrays():
    prompt_logits = np.arange(6, dtype=np.float32).reshape(3, 2)
    outputs = answer()
    outputs[0].context_logits = prompt_logits
    outputs[0].generation_logits = np.array([[1.0, 2.0]], np.float32)
    outputs[1].generation_logits = np.array([[3.0, 4.0]], np.float32)
    details = text_response(outputs, request(return_context_logits=True, return_generation_logits=True), PAD)["details"]
    assert np.array_equal(floats(details["context_logits"]), prompt_logits)
    assert np.array_equal(floats(details["generation_logits"]), [[[1.0, 2.0], [3.0, 4.0]]])  # [1 beam, tokens, V]


def event(text: str) -> dict:
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[len("data: "):])


def test_stream_events_carry_each_token_and_the_last_the_whole_text():
    outputs = answer()
    first = event(stream_event(outputs[:1], request(details=True), True, 12.345))
    assert first == {"prefill_time": 12.35, "decode_time": None, "token": {"id": 11, "text": "He", "logprob": -0.5,
                     "top_logprobs": [{"id": 11, "logprob": -0.5}, {"id": 12, "logprob": -1.5}]}}
    last = event(stream_event(outputs, request(details=True), False, 3.214))
    assert last["prefill_time"] is None and last["decode_time"] == 3.21
    assert last["token"]["id"] == 12 and last["token"]["text"] is None  # seeds/000: the last token's text is null
    assert last["generated_text"] == "Hello"
    assert last["details"] == {"finish_reason": "eos_token", "generated_tokens": 2, "seed": 7}


@pytest.mark.parametrize("sent", [1, 2])
def test_a_stream_that_fails_ends_with_what_it_sent_and_err_msg(sent):
    outputs = answer()[:sent]
    last = event(error_event(outputs, "the engine failed"))
    assert last == {"prefill_time": None, "decode_time": None, "token": None,
                    "generated_text": "Hello"[:2 if sent == 1 else 5],
                    "details": {"finish_reason": "stop_sequence", "generated_tokens": sent, "seed": 7,
                                "err_msg": "the engine failed"}}
