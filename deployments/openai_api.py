"""The OpenAI-compatible dialect: requests into GenerationRequests, engine outputs into
responses and stream chunks (docs/api.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import json
import time

from transformers import PreTrainedTokenizerBase

from deployments import mindie
from deployments.errors import APIError
from deployments.openai_schema import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, RequestOutput, TokenLogprob
from engine.request import GenerationRequest
from sampling import SamplingParams

OPENAI_FINISH = {EOS: "stop", STOP: "stop", LENGTH: "length", TIMEOUT: "length", ABORT: "stop"}


@dataclass
class Choice:
    """One choice being produced: which prompt (its request, shared by the prompt's choices),
    and what has come back so far."""

    index: int
    prompt_index: int
    prompt_tokens: int
    request: GenerationRequest
    prefix: str = ""  # the prompt's text, with echo
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


class OpenAIFrontend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, served_model_name: str, vocab_size: int,
                 max_model_len: int, max_iter_times: int, finish_reasons: str = "openai") -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.vocab_size = vocab_size
        self.max_iter_times = max_iter_times
        # SPEC §2: the prompt may use what the model's length leaves after max_iter_times. A cap
        # at or above the model's length would leave nothing: then any prompt up to length - 1
        # is taken, and generation stops at the model's length (finish_reason "length").
        gap = max_model_len - max_iter_times
        self.max_prompt_tokens = gap if gap > 0 else max_model_len - 1
        self.finish_reasons = mindie.FINISH_REASONS if finish_reasons == "mindie" else OPENAI_FINISH

    # ---- requests in -------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"model: {name!r} is not served here; this server serves "
                                f"{self.served_model_name!r}", "model", "model_not_found")

    def chat_choices(self, body: ChatCompletionRequest, request_id: str, deadline: float) -> list[Choice]:
        self.check_model(body.model)
        if body.tools:
            raise APIError(400, "tools: tool calling is not supported by this server", "tools", "unsupported")
        if body.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: only 'none' is supported (no tool calling)", "tool_choice",
                           "unsupported")
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, f"response_format: {body.response_format.type!r} needs constrained decoding, "
                                "which this server does not do; only 'text' is accepted", "response_format",
                           "unsupported")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise APIError(400, f"messages: the templated prompt has {len(prompt_ids)} tokens; at most "
                                f"{self.max_prompt_tokens} fit (model length minus max_iter_times)", "messages",
                           "context_length_exceeded")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request = self._request(f"{request_id}-0", prompt_ids, self._params(body, logprobs), body, deadline)
        return [Choice(j, 0, len(prompt_ids), request) for j in range(body.n)]

    def completion_choices(self, body: CompletionRequest, request_id: str, deadline: float) -> list[Choice]:
        self.check_model(body.model)
        params = self._params(body, body.logprobs)
        choices = []
        for i, prompt in enumerate(body.prompts()):
            # use_raw_prompt: the text goes to the model as it is, without the tokenizer's BOS.
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=not body.use_raw_prompt)
            if len(prompt_ids) > self.max_prompt_tokens:
                if body.error_behavior == "error":
                    param = "prompt" if isinstance(body.prompt, str) else f"prompt.{i}"
                    raise APIError(400, f"{param}: {len(prompt_ids)} tokens; at most {self.max_prompt_tokens} fit "
                                        "(model length minus max_iter_times); error_behavior 'truncate' keeps "
                                        "the last ones", param, "context_length_exceeded")
                prompt_ids = prompt_ids[-self.max_prompt_tokens:]
            prefix = prompt if body.echo else ""
            request = self._request(f"{request_id}-{i}", prompt_ids, params, body, deadline)
            choices += [Choice(i * body.n + j, i, len(prompt_ids), request, prefix) for j in range(body.n)]
        return choices

    def _params(self, body: SamplingFields, logprobs: int | None) -> SamplingParams:
        if body.max_tokens is not None and body.max_tokens > self.max_iter_times:
            raise APIError(400, f"max_tokens: must be in (0, {self.max_iter_times}] (max_iter_times)", "max_tokens",
                           "invalid_value")
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= self.vocab_size:
                raise APIError(400, f"logit_bias: key {key!r} is not a token id in [0, {self.vocab_size})",
                               "logit_bias", "invalid_value")
            bias[int(key)] = value
        return SamplingParams(
            max_new_tokens=body.max_tokens or self.max_iter_times, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k or 0, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop_list(), logprobs=logprobs,
            logit_bias=bias, ignore_eos=body.ignore_eos)

    @staticmethod
    def _request(request_id: str, prompt_ids: list[int], params: SamplingParams, body: SamplingFields,
                 deadline: float) -> GenerationRequest:
        """One request per prompt; its n choices share its prefill (seeds: sampling.params.choice_seed)."""
        return GenerationRequest(request_id, prompt_ids, params, priority=body.priority, deadline=deadline, n=body.n)

    # ---- responses out -----------------------------------------------------------------

    def finish_reason(self, output: RequestOutput) -> str:
        return self.finish_reasons[output.finish_reason]

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        """Each prompt counted once (the template's tokens included), every choice's output."""
        prompt_tokens = sum({c.prompt_index: c.prompt_tokens for c in choices}.values())
        completion_tokens = sum(c.final.num_output_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def chat_response(self, response_id: str, choices: list[Choice], created: int) -> dict:
        return {"id": response_id, "object": "chat.completion", "created": created, "model": self.served_model_name,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.final.text},
                             "logprobs": self._chat_logprobs(c.outputs), "finish_reason": self.finish_reason(c.final)}
                            for c in choices],
                "usage": self.usage(choices)}

    def completion_response(self, response_id: str, choices: list[Choice], created: int, suffix: str) -> dict:
        return {"id": response_id, "object": "text_completion", "created": created, "model": self.served_model_name,
                "choices": [{"index": c.index, "text": c.prefix + c.final.text + suffix,
                             "logprobs": self._completion_logprobs(c.outputs, len(c.prefix)),
                             "finish_reason": self.finish_reason(c.final)} for c in choices],
                "usage": self.usage(choices)}

    def chat_chunk(self, response_id: str, created: int, index: int, output: RequestOutput) -> str:
        choice = {"index": index, "delta": {"role": "assistant", "content": output.new_text}, "finish_reason": None}
        if output.logprobs:
            choice["logprobs"] = self._chat_logprobs([output])
        chunks = [self._chunk(response_id, "chat.completion.chunk", created, [choice])]
        if output.finished:
            chunks.append(self._chunk(response_id, "chat.completion.chunk", created,
                                      [{"index": index, "delta": {}, "finish_reason": self.finish_reason(output)}]))
        return "".join(chunks)

    def completion_chunk(self, response_id: str, created: int, index: int, output: RequestOutput, prefix: str,
                         suffix: str) -> str:
        text = prefix + output.new_text + (suffix if output.finished else "")
        choice = {"index": index, "text": text, "logprobs": self._completion_logprobs([output], 0) if output.logprobs
                  else None, "finish_reason": self.finish_reason(output) if output.finished else None}
        return self._chunk(response_id, "text_completion", created, [choice])

    def chunker(self, response_id: str, created: int, choices: list[Choice], suffix: str | None):
        """chunk(choice position, output) -> SSE text: chat chunks when ``suffix`` is None, else
        completion chunks (the echoed prompt goes in each choice's first chunk only)."""
        if suffix is None:
            return lambda i, output: self.chat_chunk(response_id, created, choices[i].index, output)
        started: set[int] = set()

        def completion(i: int, output: RequestOutput) -> str:
            prefix = "" if i in started else choices[i].prefix
            started.add(i)
            return self.completion_chunk(response_id, created, choices[i].index, output, prefix, suffix)

        return completion

    def usage_chunk(self, response_id: str, created: int, choices: list[Choice], object_name: str) -> str:
        return self._chunk(response_id, object_name, created, [], usage=self.usage(choices))

    def _chunk(self, response_id: str, object_name: str, created: int, choices: list[dict], **extra) -> str:
        body = {"id": response_id, "object": object_name, "created": created, "model": self.served_model_name,
                "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, outputs: list[RequestOutput]) -> dict | None:
        entries = [lp for o in outputs for lp in o.logprobs]
        if not entries:
            return None
        return {"content": [self._chat_entry(lp) for lp in entries]}

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        text = self._token_text(lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._token_text(i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top]}

    def _completion_logprobs(self, outputs: list[RequestOutput], offset: int) -> dict | None:
        entries = [lp for o in outputs for lp in o.logprobs]
        if not entries:
            return None
        tokens = [self._token_text(lp.token_id) for lp in entries]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in entries],
                "top_logprobs": [{self._token_text(i): v for i, v in lp.top} for lp in entries],
                "text_offset": offsets}


def now_seconds() -> int:
    return int(time.time())
