"""What a caller submits, and the engine's record of it while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import time

from sampling import SamplingParams

PRIORITY_MIN, PRIORITY_MAX = 1, 5  # 1 is served first


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = PRIORITY_MAX
    deadline: float | None = None  # absolute, time.time() seconds; None: now + default timeout

    def __post_init__(self) -> None:
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority: must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: must be non-empty")


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Mode(Enum):
    GENERATE = "generate"  # prefill and decode here
    PREFILL = "prefill"  # stop after the first token and export the prompt's KV
    DECODE = "decode"  # start from imported KV and the first token


class Sequence:
    """A request inside the engine: its tokens, its KV blocks and its progress.

    ``token_ids`` is prompt + output. ``num_computed_tokens`` of them have KV in the
    blocks of ``block_table``; the rest are computed by the next steps. Preemption frees
    the blocks and sets ``num_computed_tokens`` to 0: the tokens are recomputed.
    """

    def __init__(self, request: GenerationRequest, seed: int, arrival_index: int, mode: Mode,
                 deadline: float) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.priority = request.priority
        self.deadline = deadline
        self.seed = seed
        self.mode = mode
        self.arrival_index = arrival_index  # FIFO order within a priority level
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.token_ids = list(request.prompt_token_ids)
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.cumulative_logprob = 0.0
        self.pending_kv = None  # a KVPayload to import when admitted (Mode.DECODE)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def order_key(self) -> tuple[int, int]:
        """Smaller is served first: priority, then arrival."""
        return self.priority, self.arrival_index
