"""The seam between the dialects and the engines: what a dialect may ask of the serving system
(vLLM's EngineClient is the model). deployments/ingress/engine_client.py implements it on Ray Serve
(colocated or P then D, with admission, tracing and migration behind it); a dialect calls it and
imports nothing else of deployments/. Every error out of it is an ``APIError`` (dialects/errors.py)
with nothing of Ray's in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from engine.lora_adapter import LoraAdapter, LoraRef, ModelShape
from engine.model_info import ModelInfo
from engine.outputs import RequestOutput
from engine.request import GenerationRequest


@dataclass(frozen=True)
class ServedSettings:
    """The application's settings a dialect answers with (deployments/config.py AppArgs)."""

    served_model_name: str  # served_model_name, else the last part of the model's path
    finish_reasons: str  # "openai" or "mindie": the names OpenAI's finish_reason takes
    max_logits_floats: int
    max_beam_width: int
    max_draft_tokens: int
    max_lora_rank: int
    lora_directories: dict[str, str]  # served adapter name -> its directory
    serves_lora: bool  # enable_lora: adapters by name, and MindIE's per-task ones
    prefill_made_tokens: int  # tokens P makes before D's max_iter_times counts: 1 in PD (the first), 0 colocated
    model_aliases: tuple[str, ...] = ()  # other names of the base model a request may give


@dataclass(frozen=True)
class Origin:
    """Where a request came from, for its trace, its deadline, its key's token budget and its class."""

    dialect: str  # "openai", "mindie", ...: the trace's label
    client_request_id: str | None  # the client's x-request-id header, if any
    arrival: float  # time.time() when the HTTP request arrived; timeouts count from it
    key_name: str = "default"  # the API key's name in the app's rate_limits, whose tokens it uses
    # A Batch API line (the ingress's batch runner, never a client): its engine requests run in the
    # steps no interactive request is in (GenerationRequest.background).
    background: bool = False


class Generation(Protocol):
    """Engine requests started together (a completions request's prompts): each has answered with
    its first output, so a failure or a deadline passed before it came was raised by ``generate``,
    before the dialect wrote any byte."""

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index of the request in ``generate``'s list, output) as they arrive, each request's first
        output first; an error in one ends them all (an ``APIError``)."""

    async def abort(self) -> None:
        """Stop what is unfinished and free its KV on P and D (a client that went away); idempotent."""

    @property
    def ttft_s(self) -> float:
        """The first request's arrival to its first token (MindIE's prefill_time)."""

    @property
    def last_gap_s(self) -> float:
        """The time between the first request's last two outputs (MindIE's decode_time)."""


class EngineClient(Protocol):
    """What the engines serve and how a dialect sends them requests. One per ingress replica."""

    settings: ServedSettings

    async def model_info(self) -> ModelInfo:
        """What the engines serve; a 503 while one of them does not answer."""

    async def tokenizer(self):
        """The served model's tokenizer (transformers'): dialects count and template tokens with it."""

    async def generate(self, requests: list[GenerationRequest], origin: Origin) -> Generation:
        """Submit ``requests`` and wait for each one's first output.
        Refused at once (503) when the engines are full; if one fails, the others are aborted."""

    async def lora_names(self) -> dict[str, LoraRef]:
        """The adapters served by name (AppArgs.lora_modules), fixed at start."""

    async def lora_task(self, task_id: int) -> LoraRef | None:
        """The adapter held for a LoRA task id (MindIE's lora_task_id), None if not held; only
        when ``settings.serves_lora``, as the two below."""

    async def lora_shape(self) -> ModelShape:
        """The base model's shapes, which an adapter sent with a request must fit."""

    async def put_lora_task(self, task_id: int, adapter: LoraAdapter) -> LoraRef:
        """Hold ``adapter`` for ``task_id`` (checked against the model by the caller)."""

    async def embedding_model(self) -> str | None:
        """The embeddings model's name, None when this application serves no embeddings."""

    async def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        """The inputs' vectors and the prompt tokens they took."""
