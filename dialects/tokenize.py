"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt (as completions take it) or chat
messages (through the served model's chat template, as chat takes them) into token ids, with
their count and the model's length; token ids back into text. docs/api.md has the decisions."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, StrictStr, field_validator, model_validator

from dialects.errors import APIError
from dialects.json_types import StrictModel, TokenId
from dialects.openai_api import OpenAIFrontend
from dialects.openai_schema import MAX_TOOLS, MODEL_NAME_PATTERN, ChatMessage, Tool, check_messages

MAX_DETOKENIZE_TOKENS = 1 << 20  # the body cap (max_body_bytes) bounds it first


class TokenizeRequest(StrictModel):
    """vLLM's two request shapes in one: exactly one of ``prompt`` and ``messages``."""

    model: StrictStr | None = Field(None, pattern=MODEL_NAME_PATTERN, description="absent: the served model")
    prompt: StrictStr | None = Field(None, description="text, tokenized as completions tokenize it")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="chat messages, templated as chat templates them")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="with messages: given to the chat template")
    add_generation_prompt: StrictBool = Field(True, description="with messages: end with the assistant's header")
    continue_final_message: StrictBool = Field(
        False, description="with messages: leave the last (assistant) message open, to be continued")
    add_special_tokens: StrictBool | None = Field(
        None, description="add the tokenizer's BOS/EOS; absent: true for prompt, false for messages (the template "
                          "writes them)")
    return_token_strs: StrictBool = Field(False, description="also return each token as the tokenizer writes it")

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        return None if messages is None else check_messages(messages)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if self.messages is None:
            for name in ("tools", "continue_final_message"):
                if getattr(self, name):
                    raise ValueError(f"{name}: only with messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt false (the last message is "
                             "continued, no new one begins)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return self


class DetokenizeRequest(StrictModel):
    model: StrictStr | None = Field(None, pattern=MODEL_NAME_PATTERN, description="absent: the served model")
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)] = Field(
        description="token ids inside the vocabulary")


def tokenize(front: OpenAIFrontend, body: TokenizeRequest) -> dict:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` as vLLM answers."""
    front.check_model(body.model)
    if body.messages is not None:
        tokens = front.chat_prompt_ids(body.messages, body.tools, body.add_generation_prompt,
                                       body.continue_final_message, bool(body.add_special_tokens))
    else:
        tokens = front.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strs = front.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": front.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(front: OpenAIFrontend, body: DetokenizeRequest) -> dict:
    """``{"prompt": text}``: the ids decoded as they are (special tokens written), as vLLM does."""
    front.check_model(body.model)
    for j, token in enumerate(body.tokens):
        if token >= front.vocab_size:
            raise APIError(400, f"tokens.{j}: token id {token} is outside the vocabulary [0, {front.vocab_size})",
                           f"tokens.{j}", "invalid_value")
    return {"prompt": front.tokenizer.decode(body.tokens)}


class TokenizeResponse(StrictModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(StrictModel):
    prompt: str
