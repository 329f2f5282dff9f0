"""Request schemas of the OpenAI-compatible API, as MindIE (seeds/001) and Databricks
(seeds/002) document it; SPEC §2–3 has the digest. Unknown fields are refused (400 naming
the field), never ignored. Where the two documents differ the wider range is taken and
written down in docs/api.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from sampling.params import MAX_SEED, MAX_TOP_LOGPROBS

MODEL_NAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,254}[A-Za-z0-9])?$"
MAX_MESSAGES_BYTES = 512 * 1024  # total content of a chat request
MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request
MAX_BATCH_PROMPTS = 64  # prompts in one completions request, inputs in one embeddings request
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class SamplingFields(_Strict):
    """Fields that chat and completions share."""

    model: StrictStr = Field(pattern=MODEL_NAME_PATTERN, description="letters, digits, '.', '-', '_'; <= 256")
    max_tokens: StrictInt | None = Field(None, gt=0, description="(0, max_iter_times]; absent: max_iter_times")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="[0, 2]; 0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, gt=0, description="absent: no top-k")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: StrictInt | None = Field(None, gt=0, le=MAX_SEED, description="absent: the server draws one")
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    n: StrictInt = Field(1, gt=0, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # Extensions, as on /infer_token.
    priority: StrictInt = Field(5, ge=1, le=5, description="1 is served first")
    timeout: StrictInt = Field(600, gt=0, le=3600, description="seconds, queueing and generation together")
    ignore_eos: StrictBool = False

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: NonEmptyStr
    tool_call_id: StrictStr | None = None


class FunctionDefinition(BaseModel):
    name: StrictStr


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=32)] | None = None
    tool_choice: StrictStr | dict | None = None
    response_format: ResponseFormat | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        roles = [m.role for m in messages]
        if "system" in roles[1:]:
            raise ValueError("a system message may appear only once, as the first message")
        if sum(len(m.content.encode()) for m in messages) > MAX_MESSAGES_BYTES:
            raise ValueError(f"the messages' content exceeds {MAX_MESSAGES_BYTES // 1024} KB")
        return messages

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        return self


class CompletionRequest(SamplingFields):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    echo: StrictBool = False
    suffix: StrictStr = ""
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    use_raw_prompt: StrictBool = False
    error_behavior: Literal["error", "truncate"] = "error"

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class EmbeddingRequest(_Strict):
    input: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    model: StrictStr | None = Field(None, pattern=MODEL_NAME_PATTERN)
    instruction: StrictStr | None = Field(None, description="prepended to every input")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes, as OpenAI's clients ask by default")

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else list(self.input)
        return [f"{self.instruction}{t}" for t in texts] if self.instruction else texts
