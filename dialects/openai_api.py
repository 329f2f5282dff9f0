"""The OpenAI-compatible dialect: requests into GenerationRequests, engine outputs into
whole responses (streams: dialects/openai_stream.py). docs/api.md has every decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import json
import re
import time

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from dialects import mindie
from dialects.errors import APIError
from dialects.openai_schema import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, Tool
from dialects.reasoning import ReasoningParser, reasoning_parser, template_mentions
from dialects.tool_calls import message_tool_calls, parse_tool_calls, template_has_tool_syntax, tools_grammar
from engine.lora_adapter import LoraRef
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, RequestOutput, TokenLogprob
from engine.request import GenerationRequest
from sampling import SamplingParams
from sampling.grammar import Grammar, check_grammar
from sampling.reasoning_grammar import THINKS_IF_OPENED, THINKS_INSIDE

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
    echo_logprobs: bool = False  # the prompt's tokens lead the logprobs (echo with logprobs)
    # max_tokens 0 with echo: the engine makes one token (the prompt's last logits are computed
    # anyway) and it is dropped: the choice returns the prompt, scored, and nothing generated.
    scores_only: bool = False
    may_call_tools: bool = False  # the output is parsed for tool calls (message.tool_calls)
    reasoning: ReasoningParser | None = None  # the output thinks first: reasoning_content, then content
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]

    @property
    def completion_tokens(self) -> int:
        return 0 if self.scores_only else self.final.num_output_tokens

    @property
    def text(self) -> str:
        return "" if self.scores_only else self.final.text

    def mean_logprob(self) -> float:
        """best_of's ranking: the generated tokens' mean logprob."""
        return self.final.cumulative_logprob / max(1, self.final.num_output_tokens)


class OpenAIFrontend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, served_model_name: str, vocab_size: int,
                 max_model_len: int, max_iter_times: int, finish_reasons: str = "openai",
                 adapters: dict[str, LoraRef] | None = None, aliases: list[str] = ()) -> None:
        """``adapters``: the LoRA adapters served by name; ``model`` picks one. ``aliases``: other
        names of the base model (AppArgs.model_aliases)."""
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.aliases = set(aliases)
        self.adapters = adapters or {}
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_iter_times = max_iter_times
        # seeds/001 (maxIterTimes): the prompt may use what the model's length leaves after max_iter_times. A cap
        # at or above the model's length would leave nothing: then any prompt up to length - 1
        # is taken, and generation stops at the model's length (finish_reason "length").
        gap = max_model_len - max_iter_times
        self.max_prompt_tokens = gap if gap > 0 else max_model_len - 1
        self.finish_reasons = mindie.FINISH_REASONS if finish_reasons == "mindie" else OPENAI_FINISH
        self.reasoning = reasoning_parser(tokenizer.chat_template, self._probe_generation_prompt())

    def _probe_generation_prompt(self) -> str:
        """The template's rendering of one user message, for ``reasoning_parser``."""
        try:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                      tokenize=False)
        except Exception:  # no template, or one that needs more than a user message: no reasoning
            return ""

    # ---- requests in -------------------------------------------------------------------

    def check_model(self, name: str | None) -> LoraRef | None:
        """The adapter ``model`` names, None for the base model; a 404 for a name not served."""
        if name is None or name == self.served_model_name or name in self.aliases:
            return None
        if name in self.adapters:
            return self.adapters[name]
        served = ", ".join(repr(n) for n in (self.served_model_name, *self.adapters))
        raise APIError(404, f"model: {name!r} is not served here; this server serves {served}", "model",
                       "model_not_found")

    def model_name(self, choices: list[Choice]) -> str:
        """The ``model`` of a response: the adapter's name, or the base model's."""
        lora = choices[0].request.lora
        return lora.name if lora is not None else self.served_model_name

    def chat_choices(self, body: ChatCompletionRequest, request_id: str, deadline: float) -> list[Choice]:
        lora = self.check_model(body.model)
        # Tools are shown to the model only when it may call them (tool_choice "none" hides them).
        tools = body.tools if body.tool_mode() else None
        template_kwargs = self.template_kwargs(body)
        reasoning = self.reasoning if template_kwargs.get("enable_thinking", True) is not False else None
        grammar = self._chat_grammar(body)
        budget = body._thinking_budget if reasoning is not None else None
        if budget is not None and grammar is None:  # a budget is enforced by a grammar: any text after the thinking
            grammar = Grammar("text", field="thinking")
        if reasoning is not None and grammar is not None:  # the thinking is free; the grammar starts after it
            grammar = replace(grammar, thinking=THINKS_INSIDE if reasoning.family == "deepseek_r1" else
                              THINKS_IF_OPENED, thinking_budget=budget)
            self._check(grammar)
        prompt_ids = self._truncated(self.chat_prompt_ids(body.messages, tools, template_kwargs=template_kwargs),
                                     body)
        if len(prompt_ids) > self.max_prompt_tokens:
            raise APIError(400, f"messages: the templated prompt has {len(prompt_ids)} tokens; at most "
                                f"{self.max_prompt_tokens} fit (model length minus max_iter_times)", "messages",
                           "context_length_exceeded")
        params = self._params(body, (body.top_logprobs or 0) if body.logprobs else None, grammar=grammar)
        request = GenerationRequest(f"{request_id}-0", prompt_ids, params, body.priority, deadline, body.n,
                                    prompt_lookup=body.prompt_lookup, lora=lora)
        return [Choice(j, 0, len(prompt_ids), request, may_call_tools=tools is not None, reasoning=reasoning)
                for j in range(body.n)]

    def template_kwargs(self, body: ChatCompletionRequest) -> dict:
        """chat_template_kwargs and reasoning_effort for the template: each must be one it reads."""
        kwargs = dict(body.chat_template_kwargs or {})
        for name in kwargs:
            if not template_mentions(self.tokenizer.chat_template, name):
                raise APIError(400, f"chat_template_kwargs.{name}: the served model's chat template does not read "
                                    f"{name!r}", f"chat_template_kwargs.{name}", "unsupported")
        if body.reasoning_effort is not None:
            if not template_mentions(self.tokenizer.chat_template, "reasoning_effort"):
                raise APIError(400, "reasoning_effort: the served model's chat template has no reasoning effort "
                                    "control (a Qwen3 template's thinking is switched by chat_template_kwargs "
                                    "enable_thinking)", "reasoning_effort", "unsupported")
            kwargs["reasoning_effort"] = body.reasoning_effort
        return kwargs

    def chat_prompt_ids(self, messages: list[ChatMessage], tools: list[Tool] | None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, add_special_tokens: bool = False,
                        template_kwargs: dict | None = None) -> list[int]:
        """The messages through the tokenizer's chat template, as token ids (chat, /tokenize)."""
        try:
            text = self.tokenizer.apply_chat_template(
                [m.for_template() for m in messages],
                tools=[t.model_dump(exclude_none=True) for t in tools or []] or None,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=False, **(template_kwargs or {}))
        except TemplateError as error:  # the template's own raise_exception: it refuses these messages
            raise APIError(400, f"messages: the model's chat template refuses them: {error}", "messages",
                           "invalid_value") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _chat_grammar(self, body: ChatCompletionRequest) -> Grammar | None:
        """What the output must match: the tool-call grammar, structured_outputs' or response_format's,
        or nothing. Each schema is checked on its own, so a 400 names the one the grammar engine
        cannot use."""
        mode = body.tool_mode()
        if mode is None:
            grammar = body.structured_outputs.grammar() if body.structured_outputs is not None else \
                body.response_format.grammar() if body.response_format is not None else None
            self._check(grammar)
            return grammar
        if mode == "auto" and not template_has_tool_syntax(self.tokenizer.chat_template):
            raise APIError(400, "tool_choice: 'auto' lets the model choose to call a tool in its own syntax, and "
                                "this model's chat template has no tool-call syntax this server reads (Hermes' "
                                "<tool_call>); send 'required' or a named function", "tool_choice", "unsupported")
        functions = body.function_parameters()
        for j, parameters in enumerate(functions.values()):
            self._check(Grammar("json_schema", json.dumps(parameters, sort_keys=True),
                                f"tools.{j}.function.parameters"))
        # A named function is called exactly once, as OpenAI and vLLM do: the grammar completes
        # after one call (then only EOS may follow), whatever parallel_tool_calls says.
        parallel = body.parallel_tool_calls is not False and mode in ("auto", "required")
        grammar = tools_grammar(functions, mode, parallel=parallel)
        self._check(grammar)
        return grammar

    @staticmethod
    def _check(grammar: Grammar | None) -> None:
        if grammar is not None:
            try:
                check_grammar(grammar)
            except ValueError as error:
                raise APIError(400, str(error), grammar.field, "invalid_value") from None

    def completion_choices(self, body: CompletionRequest, request_id: str, deadline: float) -> list[Choice]:
        """best_of (or n) choices per prompt, indexed prompt × best_of + j until ``best``
        picks the n returned."""
        lora = self.check_model(body.model)
        made = body.best_of or body.n
        # best_of ranks by logprob: the engine reports them even when the caller asked for none.
        logprobs = body.logprobs if body.logprobs is not None else (0 if made > body.n else None)
        scores_only = body.max_tokens == 0
        echo_logprobs = body.echo and body.logprobs is not None
        grammar = body.structured_outputs.grammar() if body.structured_outputs is not None else None
        self._check(grammar)
        params = self._params(body, logprobs, body.logprobs if echo_logprobs else None, 1 if scores_only else None,
                              grammar)
        choices = []
        for i, prompt in enumerate(body.prompts()):
            prompt_ids = self._prompt_ids(body, i, prompt)
            prefix = "" if not body.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
            request = GenerationRequest(f"{request_id}-{i}", prompt_ids, params, body.priority, deadline, made,
                                        prompt_lookup=body.prompt_lookup, lora=lora)
            choices += [Choice(i * made + j, i, len(prompt_ids), request, prefix, echo_logprobs, scores_only)
                        for j in range(made)]
        return choices

    def _prompt_ids(self, body: CompletionRequest, i: int, prompt: str | list[int]) -> list[int]:
        param = "prompt" if len(body.prompts()) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            # use_raw_prompt: the text goes to the model as it is, without the tokenizer's BOS.
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=not body.use_raw_prompt)
        else:  # token ids are taken as they are: no BOS is added
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param, "invalid_value")
            prompt_ids = list(prompt)
        prompt_ids = self._truncated(prompt_ids, body)
        if len(prompt_ids) > self.max_prompt_tokens:
            if body.error_behavior == "error":
                raise APIError(400, f"{param}: {len(prompt_ids)} tokens; at most {self.max_prompt_tokens} fit "
                                    "(model length minus max_iter_times); error_behavior 'truncate' keeps "
                                    "the last ones", param, "context_length_exceeded")
            prompt_ids = prompt_ids[-self.max_prompt_tokens:]
        return prompt_ids

    def _truncated(self, prompt_ids: list[int], body: SamplingFields) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as fit)."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep > self.max_prompt_tokens:
            raise APIError(400, f"truncate_prompt_tokens: at most {self.max_prompt_tokens} (model length minus "
                                "max_iter_times), or -1", "truncate_prompt_tokens", "invalid_value")
        return prompt_ids[-(self.max_prompt_tokens if keep == -1 else keep):]

    def _params(self, body: SamplingFields, logprobs: int | None, prompt_logprobs: int | None = None,
                max_new_tokens: int | None = None, grammar: Grammar | None = None) -> SamplingParams:
        for param in ("max_tokens", "max_completion_tokens"):  # each is checked, though one wins
            if (getattr(body, param, None) or 0) > self.max_iter_times:
                raise APIError(400, f"{param}: must be in (0, {self.max_iter_times}] (max_iter_times)", param,
                               "invalid_value")
        limit = body.output_limit()
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            if not re.fullmatch(r"0|[1-9][0-9]*", key) or int(key) >= self.vocab_size:
                raise APIError(400, f"logit_bias: key {key!r} is not a token id in [0, {self.vocab_size})",
                               "logit_bias", "invalid_value")
            bias[int(key)] = value
        stop_ids = body.stop_token_ids or []
        for j, token_id in enumerate(stop_ids):
            if token_id >= self.vocab_size:
                raise APIError(400, f"stop_token_ids.{j}: token id {token_id} is outside the vocabulary "
                                    f"[0, {self.vocab_size})", f"stop_token_ids.{j}", "invalid_value")
        greedy_by_top_p = body.top_p == 0.0  # Databricks: top_p 0 keeps the most likely token only
        return SamplingParams(
            max_new_tokens=max_new_tokens or limit or self.max_iter_times,
            temperature=0.0 if greedy_by_top_p else body.temperature,
            top_p=1.0 if greedy_by_top_p else body.top_p, top_k=max(body.top_k or 0, 0), min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop_list(), logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs, logit_bias=bias, ignore_eos=body.ignore_eos, grammar=grammar,
            min_new_tokens=body.min_tokens, stop_token_ids=[[t] for t in stop_ids],
            skip_special_tokens=body.skip_special_tokens)

    # ---- responses out -----------------------------------------------------------------

    def finish_reason(self, output: RequestOutput, scores_only: bool = False, called: bool = False) -> str:
        """The dialect's reason; a choice that only scores its prompt ends by its length (0); one
        that called tools and was not cut off ends with "tool_calls"."""
        if called and output.finish_reason not in (LENGTH, TIMEOUT):
            return "tool_calls"
        return self.finish_reasons[LENGTH if scores_only else output.finish_reason]

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        """Each prompt counted once (the template's tokens included), every choice's output
        (best_of's unreturned ones too: they were generated)."""
        prompt_tokens = sum({c.prompt_index: c.prompt_tokens for c in choices}.values())
        completion_tokens = sum(c.completion_tokens for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @staticmethod
    def best(choices: list[Choice], n: int) -> list[Choice]:
        """Of each prompt's choices, the n of highest mean logprob, reindexed prompt × n + j."""
        made = choices[0].request.n
        if made == n:
            return choices
        kept = []
        for start in range(0, len(choices), made):
            ranked = sorted(choices[start:start + made], key=lambda c: -c.mean_logprob())[:n]
            for j, c in enumerate(ranked):
                c.index = c.prompt_index * n + j
            kept += ranked
        return kept

    def chat_response(self, response_id: str, choices: list[Choice], created: int) -> dict:
        def choice(c: Choice) -> dict:
            message, called = self.chat_message(c)
            return {"index": c.index, "message": message,
                    "logprobs": self.chat_logprobs(generated_logprobs(c, c.outputs)),
                    "finish_reason": self.finish_reason(c.final, c.scores_only, called)}

        return {"id": response_id, "object": "chat.completion", "created": created, "model": self.model_name(choices),
                "choices": [choice(c) for c in choices], "usage": self.usage(choices)}

    @staticmethod
    def chat_message(c: Choice) -> tuple[dict, bool]:
        """The assistant message, and whether it called tools: then ``content`` is the text before
        the calls, null when there is none. A reasoning model's thinking goes to
        ``reasoning_content`` (and ``reasoning``, vLLM's newer name); the calls are read after it."""
        reasoning, text = c.reasoning.split(c.text) if c.reasoning is not None else (None, c.text)
        thought = {} if reasoning is None else {"reasoning_content": reasoning, "reasoning": reasoning}
        if not c.may_call_tools:
            return {"role": "assistant", "content": text, **thought}, False
        content, parsed = parse_tool_calls(text)
        calls = message_tool_calls(parsed)
        if not calls:  # text only (or a call cut off before its name, as a stream would show it)
            return {"role": "assistant", "content": content, **thought}, False
        return {"role": "assistant", "content": content or None, "tool_calls": calls, **thought}, True

    def completion_response(self, response_id: str, made: list[Choice], returned: list[Choice], created: int,
                            suffix: str, with_logprobs: bool) -> dict:
        def logprobs(c: Choice) -> dict | None:
            if not with_logprobs:
                return None
            return self.completion_logprobs(prompt_logprobs(c, c.outputs[0]) + generated_logprobs(c, c.outputs))

        return {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name(made),
                "choices": [{"index": c.index, "text": c.prefix + c.text + suffix, "logprobs": logprobs(c),
                             "finish_reason": self.finish_reason(c.final, c.scores_only)} for c in returned],
                "usage": self.usage(made)}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        return {"content": [self._chat_entry(lp) for lp in entries]} if entries else None

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        text = self._token_text(lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._token_text(i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top]}

    def completion_logprobs(self, entries: list[TokenLogprob | int], offset: int = 0) -> dict:
        """OpenAI's legacy shape; an int entry is a token with no logprob (the prompt's first)."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            token_id = entry if isinstance(entry, int) else entry.token_id
            tokens.append(self._token_text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
            logprobs.append(None if isinstance(entry, int) else entry.logprob)
            tops.append(None if isinstance(entry, int) else {self._token_text(i): v for i, v in entry.top})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(choice: Choice, first_output: RequestOutput) -> list[TokenLogprob | int]:
    """With echo and logprobs: the prompt's first token id (nothing precedes it, so no
    logprob), then each later prompt token's logprob."""
    if not choice.echo_logprobs or first_output.prompt_logprobs is None:
        return []
    return [choice.request.prompt_token_ids[0], *first_output.prompt_logprobs[1:]]


def generated_logprobs(choice: Choice, outputs: list[RequestOutput]) -> list[TokenLogprob]:
    return [] if choice.scores_only else [lp for o in outputs for lp in o.logprobs]


def now_seconds() -> int:
    return int(time.time())
