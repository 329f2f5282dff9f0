"""MindIE's native token API, ``POST /infer_token`` (SPEC §1, seeds/000).

The request schema with the document's ranges and defaults, its conversion into a
GenerationRequest, and the response shapes: one JSON object, or server-sent events with
``prefill_time`` on the first event, ``decode_time`` on the others (milliseconds) and
``generated_text`` + ``details`` on the last. Extensions from TensorRT-LLM's request
(seeds/004) live under ``parameters`` too.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field, StrictBool, StrictFloat, StrictInt

from deployments.json_types import Seed, StrictModel, TokenId, sse_event
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, RequestOutput
from engine.request import GenerationRequest
from sampling import SamplingParams
from sampling.params import MAX_TOP_LOGPROBS

MAX_TOKEN_ID = 1024 * 1024  # the document's bound; the vocabulary is checked as well
UINT32_MAX = 2_147_483_647
TokenSequences = list[Annotated[list[TokenId], Field(min_length=1)]]

# Engine finish reasons -> MindIE's. Cancellation, expiry and errors are all stop_sequence
# there, with err_msg set.
FINISH_REASONS = {EOS: "eos_token", STOP: "stop_sequence", LENGTH: "length", ABORT: "stop_sequence",
                  TIMEOUT: "stop_sequence"}


class InferParameters(StrictModel):
    temperature: StrictFloat = Field(1.0, gt=0.0, description="> 0; below 0.001 degrades text")
    top_k: StrictInt | None = Field(None, gt=0, le=UINT32_MAX, description="a value >= vocab size means off")
    top_p: StrictFloat | None = Field(None, gt=0.0, lt=1.0, description="(0, 1), open at both ends; absent means 1.0")
    max_new_tokens: StrictInt = Field(20, gt=0, le=UINT32_MAX, description="capped by the server's max_iter_times")
    do_sample: StrictBool | None = Field(None, description="absent: greedy iff top_k == 1 (docs/sampling.md)")
    seed: Seed | None = Field(None, description="absent: the server draws one")
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0)
    details: StrictBool = False
    typical_p: StrictFloat = Field(1.0, gt=0.0, le=1.0, description="accepted; no effect (as the document says)")
    watermark: StrictBool = Field(False, description="accepted; no effect (as the document says)")
    priority: StrictInt = Field(5, ge=1, le=5, description="1 is served first")
    timeout: StrictInt = Field(600, gt=0, le=3600, description="seconds, queueing and generation together")
    # Extensions from TensorRT-LLM's InferenceRequest.
    min_length: StrictInt = Field(0, ge=0, description="EOS is masked until this many new tokens")
    no_repeat_ngram_size: StrictInt = Field(0, ge=0)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    stop_words: TokenSequences = Field(default_factory=list, description="token-id sequences that end the output")
    bad_words: TokenSequences = Field(default_factory=list, description="token-id sequences never produced")
    embedding_bias: list[StrictFloat] | None = Field(None, description="one bias per vocabulary entry")
    end_id: StrictInt | None = Field(None, ge=0, description="replaces the model's EOS id")
    return_log_probs: StrictBool = False
    top_log_probs: StrictInt = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token")
    ignore_eos: StrictBool = False
    return_context_logits: StrictBool = Field(
        False, description="details.context_logits: the prompt's raw logits [input tokens, vocab] (docs/api.md)")
    return_generation_logits: StrictBool = Field(
        False, description="details.generation_logits: each output token's raw logits [1, output tokens, vocab]")


class InferTokenRequest(StrictModel):
    input_id: list[Annotated[TokenId, Field(le=MAX_TOKEN_ID)]] = Field(
        min_length=1, description="token ids, each inside the vocabulary")
    stream: StrictBool = False
    parameters: InferParameters = Field(default_factory=InferParameters)


@dataclass
class ServedLimits:
    """What only the served model and the app's arguments can check in a request."""

    vocab_size: int
    max_output_tokens: int  # the most tokens a request can get: max_iter_times (+ P's first in PD)
    max_logits_floats: int  # AppArgs.max_logits_floats


def to_generation_request(body: InferTokenRequest, request_id: str, deadline: float,
                          limits: ServedLimits) -> GenerationRequest:
    """Raises ValueError naming the field for what only the served model can check."""
    p = body.parameters
    vocab_size = limits.vocab_size
    check_logits_size(p, len(body.input_id), limits)
    bad = [i for i in body.input_id if i >= vocab_size]
    if bad:
        raise ValueError(f"input_id: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
    logit_bias = {}
    if p.embedding_bias is not None:
        if len(p.embedding_bias) != vocab_size:
            raise ValueError(f"parameters.embedding_bias: needs {vocab_size} values (one per vocabulary entry), "
                             f"got {len(p.embedding_bias)}")
        logit_bias = {i: b for i, b in enumerate(p.embedding_bias) if b != 0.0}
    for name, sequences in (("stop_words", p.stop_words), ("bad_words", p.bad_words)):
        if any(not 0 <= t < vocab_size for seq in sequences for t in seq):
            raise ValueError(f"parameters.{name}: token ids must be inside the vocabulary [0, {vocab_size})")
    if p.end_id is not None and p.end_id >= vocab_size:
        raise ValueError(f"parameters.end_id: must be inside the vocabulary [0, {vocab_size})")
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens,  # the engines apply max_iter_times (D counts its own tokens)
        min_new_tokens=p.min_length, temperature=p.temperature, do_sample=p.do_sample,
        top_k=p.top_k or 0, top_p=p.top_p if p.top_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, no_repeat_ngram_size=p.no_repeat_ngram_size,
        bad_words_ids=p.bad_words, stop_token_ids=p.stop_words, logit_bias=logit_bias, seed=p.seed,
        logprobs=p.top_log_probs if p.return_log_probs else None, ignore_eos=p.ignore_eos, eos_token_id=p.end_id,
        return_context_logits=p.return_context_logits, return_generation_logits=p.return_generation_logits)
    return GenerationRequest(request_id, body.input_id, params, priority=p.priority, deadline=deadline)


def check_logits_size(p: InferParameters, num_input_tokens: int, limits: ServedLimits) -> None:
    """Refuse, before any work, logits that would make an answer larger than the app allows."""
    asked = {"return_context_logits": num_input_tokens if p.return_context_logits else 0,
             "return_generation_logits": min(p.max_new_tokens, limits.max_output_tokens)
             if p.return_generation_logits else 0}
    for name, rows in asked.items():
        floats = rows * limits.vocab_size
        if floats > limits.max_logits_floats:
            raise ValueError(f"parameters.{name}: {rows} rows of {limits.vocab_size} logits are {floats} floats, "
                             f"more than this server returns ({limits.max_logits_floats}, max_logits_floats); "
                             "ask for fewer tokens")


def details(outputs: list[RequestOutput], p: InferParameters) -> dict:
    """The last event's or the answer's ``details``: the final output's counts, and what was asked
    for over all ``outputs``."""
    final = outputs[-1]
    out = {"finish_reason": FINISH_REASONS[final.finish_reason], "generated_tokens": final.num_output_tokens,
           "seed": final.seed}
    if final.finish_reason in (ABORT, TIMEOUT):
        out["err_msg"] = "request timed out" if final.finish_reason == TIMEOUT else "request cancelled"
    if p.return_log_probs:
        out["cumulative_logprob"] = final.cumulative_logprob
    if p.return_context_logits and outputs[0].context_logits is not None:
        out["context_logits"] = encode_floats(outputs[0].context_logits)
    if p.return_generation_logits:
        rows = [o.generation_logits for o in outputs if o.generation_logits is not None]
        out["generation_logits"] = encode_floats(np.concatenate(rows)[None] if rows else np.zeros((1, 0, 0)))
    return out


def encode_floats(array: np.ndarray) -> dict:
    """An array on the wire: its shape, and its values as base64 of little-endian float32 (docs/api.md)."""
    return {"shape": list(array.shape), "dtype": "float32",
            "data": base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode()}


def with_details(p: InferParameters) -> bool:
    """``details`` is in the answer when asked for, and whenever logits are (they live in it)."""
    return p.details or p.return_context_logits or p.return_generation_logits


def text_response(outputs: list[RequestOutput], body: InferTokenRequest) -> dict:
    final = outputs[-1]
    response = {"generated_text": final.text}
    if with_details(body.parameters):
        response["details"] = details(outputs, body.parameters)
        if body.parameters.return_log_probs:
            response["details"]["tokens"] = [_token(lp.token_id, None, lp) for o in outputs for lp in o.logprobs]
    return response


def stream_event(sent: list[RequestOutput], body: InferTokenRequest, first: bool, elapsed_ms: float) -> str:
    """One SSE event per token (``sent[-1]``'s); the last also carries generated_text and details."""
    output = sent[-1]
    logprob = output.logprobs[0] if output.logprobs else None
    event = {"prefill_time": round(elapsed_ms, 2) if first else None,
             "decode_time": None if first else round(elapsed_ms, 2),
             "token": _token(output.new_token_ids[0], output.new_text, logprob) if output.new_token_ids else None}
    if output.finished:
        event["generated_text"] = output.text
        event["details"] = details(sent, body.parameters)
    return sse_event(event)


def error_event(sent: list[RequestOutput], err_msg: str) -> str:
    """The last event of a stream that failed after it began: what was generated so far, and
    ``finish_reason`` stop_sequence with ``err_msg`` (MindIE's form for an error)."""
    event = {"prefill_time": None, "decode_time": None, "token": None,
             "generated_text": "".join(o.new_text for o in sent),
             "details": {"finish_reason": "stop_sequence", "generated_tokens": sum(len(o.new_token_ids) for o in sent),
                         "seed": sent[-1].seed, "err_msg": err_msg}}
    return sse_event(event)


def _token(token_id: int, text: str | None, logprob) -> dict:
    token = {"id": token_id, "text": text}
    if logprob is not None:
        token["logprob"] = logprob.logprob
        token["top_logprobs"] = [{"id": i, "logprob": v} for i, v in logprob.top]
    return token
