"""MindIE's native token API, ``POST /infer_token`` (seeds/000).

The request schema with the document's ranges and defaults, its conversion into a
GenerationRequest, and the response shapes: one JSON object, or server-sent events with
``prefill_time`` on the first event, ``decode_time`` on the others (milliseconds) and
``generated_text`` + ``details`` on the last. Extensions from TensorRT-LLM's request
(seeds/004) live under ``parameters`` too.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
import json
import logging
from typing import Annotated, Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from dialects.json_types import Seed, StrictModel, TokenId, sse_event
from dialects.serving_fields import IgnoreEos, Priority, Timeout
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, RequestOutput
from engine.lora_adapter import LoraRef
from engine.request import DraftTokens, GenerationRequest, PromptTable
from sampling import SamplingParams
from sampling.params import MAX_LENGTH_PENALTY, MAX_TOP_LOGPROBS

MAX_TOKEN_ID = 1024 * 1024  # the document's bound; the vocabulary is checked as well
# seeds/000 warns near the seed's maximum without saying where "near" begins: here, from where a
# seed no longer fits a signed 64-bit integer (the half of the range other tools cannot take).
SEED_WARNING_FROM = 2**63
logger = logging.getLogger(__name__)
UINT32_MAX = 2_147_483_647
TokenSequences = list[Annotated[list[TokenId], Field(min_length=1)]]

# Engine finish reasons -> MindIE's. Cancellation, expiry and errors are all stop_sequence
# there, with err_msg set.
FINISH_REASONS = {EOS: "eos_token", STOP: "stop_sequence", LENGTH: "length", ABORT: "stop_sequence",
                  TIMEOUT: "stop_sequence"}


class EncodedArray(StrictModel):
    """An array in a JSON body: its shape, and its values as base64 of little-endian numbers."""

    shape: list[Annotated[StrictInt, Field(ge=0)]] = Field(min_length=1, max_length=4)
    dtype: Literal["float32", "float16"]
    data: str = Field(description="base64 of the values in row-major order, little-endian")


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
    priority: Priority
    timeout: Timeout
    # Extensions from TensorRT-LLM's InferenceRequest.
    min_length: StrictInt = Field(0, ge=0, description="EOS is masked until this many new tokens")
    no_repeat_ngram_size: StrictInt = Field(0, ge=0)
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    stop_words: TokenSequences = Field(default_factory=list, description="token-id sequences that end the output")
    bad_words: TokenSequences = Field(default_factory=list, description="token-id sequences never produced")
    embedding_bias: list[StrictFloat] | None = Field(None, description="one bias per vocabulary entry")
    end_id: StrictInt = Field(-1, ge=-1, description="the id that ends the output; -1 (TensorRT-LLM's default): "
                                                     "the model's EOS ids")
    is_need_logits: StrictBool = Field(False, description="the operator's filtered logits (logitsTopKPSelect): "
                                                          "not returned here, true is refused")
    return_log_probs: StrictBool = False
    top_log_probs: StrictInt = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token")
    ignore_eos: IgnoreEos
    return_context_logits: StrictBool = Field(
        False, description="details.context_logits: the prompt's raw logits [input tokens, vocab] (docs/serving.md)")
    return_generation_logits: StrictBool = Field(
        False, description="details.generation_logits: each output token's raw logits [beam_width, output tokens, "
                           "vocab]")
    beam_width: StrictInt = Field(1, ge=1, description="beam search when > 1 (at most the server's max_beam_width)")
    length_penalty: StrictFloat = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY,
                                        description="beam search: a beam scores cum_log_prob / length ** this")
    early_stopping: Literal[0, 1, "never"] = Field(
        1, description="beam search: 1 stops once beam_width beams ended, 0 when no running beam can win "
                       "(transformers' heuristic), \"never\" only when none can (docs/serving.md)")
    prompt_embedding_table: EncodedArray | None = Field(
        None, description="p-tuning: [prompt_vocab_size, hidden]; input ids vocab_size + i take row i "
                          "(docs/serving.md)")
    prompt_vocab_size: StrictInt | None = Field(None, ge=1, description="p-tuning: the table's rows")
    draft_input_ids: list[TokenId] | None = Field(
        None, description="speculative decoding: a guess of the output from its first token, verified in one "
                          "step (at most the server's max_draft_tokens); the output is the same as without it")
    draft_logits: EncodedArray | None = Field(
        None, description="the draft model's logits [len(draft_input_ids), vocab]: drafts are verified by the "
                          "speculative-sampling rule (docs/serving.md)")
    prompt_lookup: StrictBool | None = Field(
        None, description="speculative decoding by prompt lookup (docs/serving.md); absent: the server's setting")
    lora_name: StrictStr | None = Field(None, description="a LoRA adapter the server serves by name (lora_modules)")
    lora_task_id: Annotated[StrictInt, Field(ge=0, le=2**64 - 1)] | None = Field(
        None, description="TensorRT-LLM's LoRA task: with lora_weights and lora_config the first time, alone after")
    lora_weights: EncodedArray | None = Field(
        None, description="[rows, r x in + out x r]: each row A then B of one module and layer (docs/serving.md)")
    lora_config: Annotated[list[Annotated[list[StrictInt], Field(min_length=3, max_length=3)]],
                           Field(min_length=1)] | None = Field(
        None, description="[rows, 3]: module id, layer, rank of each lora_weights row")
    pad_id: StrictInt | None = Field(None, ge=0, description="beam search: pads details.output_ids of beams that "
                                     "ended early; default the model's pad id, else its end id")


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
    max_beam_width: int  # AppArgs.max_beam_width
    hidden_size: int  # a p-tuning table's row length
    max_draft_tokens: int  # AppArgs.max_draft_tokens


def warn_if_seed_near_max(seed: int | None) -> None:
    """seeds/000: a seed near the maximum draws a WARNING and works all the same."""
    if seed is not None and seed >= SEED_WARNING_FROM:
        logger.warning("parameters.seed: %d is near the maximum (2^64 - 1); it is used as it is, and a seed "
                       "below 2^63 avoids this warning", seed)


def to_generation_request(body: InferTokenRequest, request_id: str, deadline: float,
                          limits: ServedLimits, lora: LoraRef | None = None) -> GenerationRequest:
    """Raises ValueError naming the field for what only the served model can check. ``lora``:
    the adapter the request's LoRA fields resolved to (``lora_tensors``, then dialects/mindie_serving.py)."""
    p = body.parameters
    warn_if_seed_near_max(p.seed)
    vocab_size = limits.vocab_size
    check_logits_size(p, len(body.input_id), limits)
    check_beam_search(body, limits)
    table = prompt_table(p, limits.hidden_size)
    end = vocab_size + (table.size if table else 0)
    bad = [i for i in body.input_id if i >= end]
    if bad:
        where = f"the model's vocabulary and the prompt table [0, {end})" if table else \
            f"the model's vocabulary [0, {vocab_size})"
        raise ValueError(f"input_id: token id {bad[0]} is outside {where}")
    logit_bias = {}
    if p.embedding_bias is not None:
        if len(p.embedding_bias) != vocab_size:
            raise ValueError(f"parameters.embedding_bias: needs {vocab_size} values (one per vocabulary entry), "
                             f"got {len(p.embedding_bias)}")
        logit_bias = {i: b for i, b in enumerate(p.embedding_bias) if b != 0.0}
    for name, sequences in (("stop_words", p.stop_words), ("bad_words", p.bad_words)):
        if any(not 0 <= t < vocab_size for seq in sequences for t in seq):
            raise ValueError(f"parameters.{name}: token ids must be inside the vocabulary [0, {vocab_size})")
    if p.is_need_logits:
        raise ValueError("parameters.is_need_logits: the sampling operator's filtered logits (logitsTopKPSelect) "
                         "are not returned by this server; return_generation_logits gives each token's raw logits")
    if p.end_id >= vocab_size:
        raise ValueError(f"parameters.end_id: must be inside the vocabulary [0, {vocab_size})")
    beams = p.beam_width > 1
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens,  # the engines apply max_iter_times (D counts its own tokens)
        min_new_tokens=p.min_length, temperature=p.temperature, do_sample=None if beams else p.do_sample,
        top_k=p.top_k or 0, top_p=p.top_p if p.top_p is not None else 1.0,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, no_repeat_ngram_size=p.no_repeat_ngram_size,
        bad_words_ids=p.bad_words, stop_token_ids=p.stop_words, logit_bias=logit_bias, seed=p.seed,
        logprobs=p.top_log_probs if p.return_log_probs and not beams else None, ignore_eos=p.ignore_eos,
        eos_token_id=None if p.end_id == -1 else p.end_id, return_context_logits=p.return_context_logits,
        return_generation_logits=p.return_generation_logits, beam_width=p.beam_width, length_penalty=p.length_penalty,
        early_stopping={1: True, 0: False}.get(p.early_stopping, p.early_stopping))
    return GenerationRequest(request_id, body.input_id, params, priority=p.priority, deadline=deadline,
                             prompt_table=table, draft=draft_tokens(p, limits), prompt_lookup=p.prompt_lookup,
                             lora=lora)


def lora_tensors(p: InferParameters) -> tuple[np.ndarray, np.ndarray] | None:
    """TensorRT-LLM's (lora_weights, lora_config) when the request sends them, checked for what
    goes together; the ingress resolves them, or lora_task_id alone, or lora_name, to an adapter."""
    if p.lora_name is not None and (p.lora_task_id is not None or p.lora_weights is not None):
        raise ValueError("parameters.lora_name: names a served adapter; it does not combine with lora_task_id")
    if (p.lora_weights is None) != (p.lora_config is None):
        missing = "lora_config" if p.lora_config is None else "lora_weights"
        raise ValueError(f"parameters.{missing}: lora_weights and lora_config go together")
    if p.lora_weights is None:
        return None
    if p.lora_task_id is None:
        raise ValueError("parameters.lora_task_id: lora_weights and lora_config need the task id they belong to")
    return decode_floats(p.lora_weights, "parameters.lora_weights"), np.array(p.lora_config, dtype=np.int64)


def draft_tokens(p: InferParameters, limits: ServedLimits) -> DraftTokens | None:
    """The request's drafts, checked against the vocabulary and max_draft_tokens."""
    if p.draft_logits is not None and not p.draft_input_ids:
        raise ValueError("parameters.draft_logits: goes with draft_input_ids")
    if not p.draft_input_ids:
        return None
    ids = p.draft_input_ids
    if len(ids) > limits.max_draft_tokens:
        raise ValueError(f"parameters.draft_input_ids: {len(ids)} tokens, at most {limits.max_draft_tokens} here "
                         "(max_draft_tokens)")
    if any(t >= limits.vocab_size for t in ids):
        raise ValueError("parameters.draft_input_ids: token ids must be inside the vocabulary "
                         f"[0, {limits.vocab_size})")
    logits = None
    if p.draft_logits is not None:
        logits = decode_floats(p.draft_logits, "parameters.draft_logits")
        if logits.shape != (len(ids), limits.vocab_size):
            raise ValueError(f"parameters.draft_logits: shape {list(logits.shape)}, expected "
                             f"[len(draft_input_ids), vocab] = [{len(ids)}, {limits.vocab_size}]")
    return DraftTokens(list(ids), logits)


def prompt_table(p: InferParameters, hidden_size: int) -> PromptTable | None:
    """The request's p-tuning table, checked against its size and this model's hidden size."""
    if (p.prompt_embedding_table is None) != (p.prompt_vocab_size is None):
        missing = "prompt_vocab_size" if p.prompt_vocab_size is None else "prompt_embedding_table"
        raise ValueError(f"parameters.{missing}: prompt_embedding_table and prompt_vocab_size go together")
    if p.prompt_embedding_table is None:
        return None
    embeddings = decode_floats(p.prompt_embedding_table, "parameters.prompt_embedding_table")
    if embeddings.shape != (p.prompt_vocab_size, hidden_size):
        raise ValueError(f"parameters.prompt_embedding_table: shape {list(embeddings.shape)}, expected "
                         f"[prompt_vocab_size, hidden] = [{p.prompt_vocab_size}, {hidden_size}]")
    return PromptTable.of(embeddings)


def decode_floats(encoded: EncodedArray, field: str) -> np.ndarray:
    """``encode_floats``' inverse (float32 or float16 in), as float32."""
    try:
        raw = base64.b64decode(encoded.data, validate=True)
    except ValueError:
        raise ValueError(f"{field}.data: not base64") from None
    dtype = np.dtype("<f4" if encoded.dtype == "float32" else "<f2")
    expected = int(np.prod(encoded.shape)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{field}.data: {len(raw)} bytes, shape {encoded.shape} of {encoded.dtype} needs {expected}")
    values = np.frombuffer(raw, dtype=dtype).reshape(encoded.shape).astype(np.float32)
    if not np.isfinite(values).all():
        raise ValueError(f"{field}.data: values must be finite")
    return values


# What beam search cannot honour, set away from its default: these sample or reshape the
# distribution the beams are scored on (sampling/params.py BEAM_EXCLUSIVE).
BEAM_CONFLICTS = {"do_sample": lambda p: p.do_sample is True, "temperature": lambda p: p.temperature != 1.0,
                  "top_k": lambda p: p.top_k is not None, "top_p": lambda p: p.top_p is not None,
                  "seed": lambda p: p.seed is not None, "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
                  "presence_penalty": lambda p: p.presence_penalty != 0.0,
                  "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
                  "no_repeat_ngram_size": lambda p: p.no_repeat_ngram_size != 0, "min_length": lambda p: p.min_length,
                  "stop_words": lambda p: p.stop_words, "bad_words": lambda p: p.bad_words,
                  "embedding_bias": lambda p: p.embedding_bias is not None,
                  "top_log_probs": lambda p: p.top_log_probs != 0, "draft_input_ids": lambda p: p.draft_input_ids,
                  "prompt_lookup": lambda p: p.prompt_lookup is True}


def check_beam_search(body: InferTokenRequest, limits: ServedLimits) -> None:
    p = body.parameters
    if p.beam_width > limits.max_beam_width:
        raise ValueError(f"parameters.beam_width: at most {limits.max_beam_width} here (max_beam_width)")
    if p.beam_width == 1:
        if p.pad_id is not None:
            raise ValueError("parameters.pad_id: pads the beams of beam search; set beam_width > 1")
        return
    if body.stream:
        raise ValueError("stream: beam search answers once, with every beam; send it without stream")
    for name, conflicts in BEAM_CONFLICTS.items():
        if conflicts(p):
            raise ValueError(f"parameters.{name}: does not combine with beam search (beam_width > 1)")
    if p.pad_id is not None and p.pad_id >= limits.vocab_size:
        raise ValueError(f"parameters.pad_id: must be inside the vocabulary [0, {limits.vocab_size})")


def check_logits_size(p: InferParameters, num_input_tokens: int, limits: ServedLimits) -> None:
    """Refuse, before any work, logits that would make an answer larger than the app allows."""
    asked = {"return_context_logits": num_input_tokens if p.return_context_logits else 0,
             "return_generation_logits": p.beam_width * min(p.max_new_tokens, limits.max_output_tokens)
             if p.return_generation_logits else 0}
    for name, rows in asked.items():
        floats = rows * limits.vocab_size
        if floats > limits.max_logits_floats:
            raise ValueError(f"parameters.{name}: {rows} rows of {limits.vocab_size} logits are {floats} floats, "
                             f"more than this server returns ({limits.max_logits_floats}, max_logits_floats); "
                             "ask for fewer tokens")


def details(outputs: list[RequestOutput], p: InferParameters, pad_id: int | None = None) -> dict:
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
    if p.return_generation_logits and final.beams is not None:
        out["generation_logits"] = encode_floats(final.generation_logits)  # [beam_width, longest, V]
    elif p.return_generation_logits:
        rows = [o.generation_logits for o in outputs if o.generation_logits is not None]
        out["generation_logits"] = encode_floats(np.concatenate(rows)[None] if rows else np.zeros((1, 0, 0)))
    if final.beams is not None:
        out.update(beam_details(final.beams, p, pad_id))
    elif asks_beam_outputs(p):  # TensorRT-LLM's outputs for its one beam
        out.update({"output_ids": [final.output_token_ids], "sequence_length": [len(final.output_token_ids)]})
    return out


def asks_beam_outputs(p: InferParameters) -> bool:
    """A request that names ``beam_width`` (1 included) speaks TensorRT-LLM's InferenceRequest and
    gets its outputs: output_ids [beam_width][tokens] and sequence_length [beam_width]."""
    return "beam_width" in p.model_fields_set


def beam_details(beams: list, p: InferParameters, pad_id: int) -> dict:
    """TensorRT-LLM's beam outputs, best beam first: output_ids [beam_width][longest] padded with
    pad_id, sequence_length, cum_log_probs, and output_log_probs (padded with 0.0) when asked for."""
    longest = max(len(b.token_ids) for b in beams)
    out = {"output_ids": [b.token_ids + [pad_id] * (longest - len(b.token_ids)) for b in beams],
           "sequence_length": [len(b.token_ids) for b in beams], "cum_log_probs": [b.cum_logprob for b in beams]}
    if p.return_log_probs:
        out["output_log_probs"] = [b.logprobs + [0.0] * (longest - len(b.logprobs)) for b in beams]
    return out


def encode_floats(array: np.ndarray) -> dict:
    """An array on the wire: its shape, and its values as base64 of little-endian float32 (docs/serving.md)."""
    return {"shape": list(array.shape), "dtype": "float32",
            "data": base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode()}


def with_details(p: InferParameters) -> bool:
    """``details`` is in the answer when asked for, and whenever logits or beams are (they live in it)."""
    return p.details or p.return_context_logits or p.return_generation_logits or asks_beam_outputs(p)


def text_response(outputs: list[RequestOutput], body: InferTokenRequest, pad_id: int) -> dict:
    final = outputs[-1]
    response = {"generated_text": final.text}
    if with_details(body.parameters):
        response["details"] = details(outputs, body.parameters, pad_id)
        if body.parameters.return_log_probs:
            response["details"]["tokens"] = [_token(lp.token_id, None, lp) for o in outputs for lp in o.logprobs]
    return response


def stream_event(sent: list[RequestOutput], body: InferTokenRequest, first: bool, elapsed_ms: float) -> str:
    """One SSE event per token (``sent[-1]``'s); the last also carries generated_text and details,
    and its token's text is null as in seeds/000's example (generated_text holds the whole text)."""
    output = sent[-1]
    logprob = output.logprobs[0] if output.logprobs else None
    text = None if output.finished else output.new_text
    event = {"prefill_time": round(elapsed_ms, 2) if first else None,
             "decode_time": None if first else round(elapsed_ms, 2),
             "token": _token(output.new_token_ids[0], text, logprob) if output.new_token_ids else None}
    if output.finished:
        event["generated_text"] = output.text
        event["details"] = details(sent, body.parameters)  # a stream has no beams (refused): nothing to pad
    return sse_event(event)


def error_event(sent: list[RequestOutput], err_msg: str) -> str:
    """The last event of a stream that failed after it began: what was generated so far, and
    ``finish_reason`` stop_sequence with ``err_msg`` (MindIE's form for an error)."""
    event = {"prefill_time": None, "decode_time": None, "token": None,
             "generated_text": "".join(o.new_text for o in sent),
             "details": {"finish_reason": "stop_sequence", "generated_tokens": sum(len(o.new_token_ids) for o in sent),
                         "seed": sent[-1].seed, "err_msg": err_msg}}
    return sse_event(event)


def is_route(path: str) -> bool:
    return path.endswith("/infer_token")


def with_err_msg(response: JSONResponse) -> JSONResponse:
    """An error response (OpenAI's error object, as every route's) with MindIE's form of an error
    beside it: an empty output, finish_reason stop_sequence and ``err_msg`` (seeds/000: "请求执行中出错,
    响应输出为空,err_msg非空"; the same for a request that fails its checks)."""
    body = json.loads(response.body)
    body.update({"generated_text": "", "details": {"finish_reason": "stop_sequence", "generated_tokens": 0,
                                                   "err_msg": body["error"]["message"]}})
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


def _token(token_id: int, text: str | None, logprob) -> dict:
    token = {"id": token_id, "text": text}
    if logprob is not None:
        token["logprob"] = logprob.logprob
        token["top_logprobs"] = [{"id": i, "logprob": v} for i, v in logprob.top]
    return token
