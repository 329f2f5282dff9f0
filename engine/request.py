"""What a caller submits, and the engine's record of it while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import hashlib
import time

import numpy as np
import torch

from engine.lora_adapter import LoraAdapter, LoraRef
from sampling import SamplingParams

PRIORITY_MIN, PRIORITY_MAX = 1, 5  # 1 is served first
MAX_CHOICES = 128  # n: choices of one request, sharing its prompt's prefill


@dataclass(frozen=True)
class PromptTable:
    """TensorRT-LLM's p-tuning prompt table: a prompt id ``vocab_size + i`` takes row i as its
    embedding instead of the model's. ``digest`` names the table in the KV's content key."""

    embeddings: np.ndarray  # [prompt_vocab_size, hidden] float32
    digest: bytes

    @classmethod
    def of(cls, embeddings: np.ndarray) -> "PromptTable":
        table = np.ascontiguousarray(embeddings, dtype=np.float32)
        digest = hashlib.blake2b(repr(table.shape).encode() + table.tobytes(), digest_size=16).digest()
        return cls(table, digest)

    @property
    def size(self) -> int:
        return self.embeddings.shape[0]


@dataclass(frozen=True)
class DraftTokens:
    """A request's draft of its output (engine/decoding/speculative.py): ``token_ids[i]`` guesses output
    token i; ``logits`` [len(token_ids), V] float32, the draft model's, when it sent them."""

    token_ids: list[int]
    logits: np.ndarray | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = PRIORITY_MAX
    deadline: float | None = None  # absolute, time.time() seconds; None: now + default timeout
    n: int = 1  # choices; they share one prefill and fork from it (seeds: sampling.params.choice_seed)
    # A migrated request (deployments/ingress/migration.py): the tokens its one choice generated before,
    # on a replica that failed, and their cumulative logprob. They follow the prompt and count as
    # output (penalties, the seeded noise's step, stop conditions, max_new_tokens, the counts
    # reported), but are not streamed again.
    resumed_output_ids: list[int] = field(default_factory=list)
    resumed_logprob: float = 0.0
    prompt_table: PromptTable | None = None  # p-tuning: prompt ids past the vocabulary index it
    draft: DraftTokens | None = None  # speculative decoding with the caller's drafts
    prompt_lookup: bool | None = None  # speculative decoding by prompt lookup; None: the engine's default
    lora: LoraRef | None = None  # the LoRA adapter it runs with (engine/lora_adapter.py); the engine is given its weights
    # A Batch API line (set by the ingress for its batch runner's requests, never by a client): it
    # runs only in steps no other request is in, whatever its priority (engine/scheduler.py).
    background: bool = False

    @property
    def context_token_ids(self) -> list[int]:
        """The tokens before the first new one: the prompt, then a resumed request's earlier
        output. What P computes and D imports."""
        return list(self.prompt_token_ids) + list(self.resumed_output_ids)

    @property
    def num_context_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.resumed_output_ids)

    def __post_init__(self) -> None:
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority: must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids: must be non-empty")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n: must be in [1, {MAX_CHOICES}]")
        if self.resumed_output_ids and self.n != 1:
            raise ValueError("resumed_output_ids: a resumed request has one choice (n=1)")
        if self.draft is not None and self.draft.logits is not None and (
                self.draft.logits.ndim != 2 or len(self.draft.logits) != len(self.draft.token_ids)):
            raise ValueError(f"draft_logits: shape {list(self.draft.logits.shape)}, expected one row per draft token "
                             f"[{len(self.draft.token_ids)}, vocab]")


class SequenceStatus(Enum):
    WAITING = "waiting"
    RECEIVING = "receiving"  # DECODE: admitted, its blocks held, waiting for P's KV bytes to arrive
    RUNNING = "running"
    FINISHED = "finished"


class Mode(Enum):
    GENERATE = "generate"  # prefill and decode here
    PREFILL = "prefill"  # stop after the first token and export the prompt's KV
    DECODE = "decode"  # start from imported KV and the first token


@dataclass
class PendingChoice:
    """A choice that will fork from its request's first sequence once the prompt is computed.
    ``first_token_id`` is known in DECODE mode (P sampled it); else it is sampled at the fork."""

    index: int
    seed: int
    first_token_id: int | None = None
    first_logprob: float | None = None


class Sequence:
    """One choice of a request inside the engine: its tokens, its KV blocks and its progress.

    ``token_ids`` is prompt + output. ``num_computed_tokens`` of them have KV in the blocks of
    ``block_table``; the rest are computed by the next steps. The scheduler is the only writer
    of ``num_computed_tokens`` (admission, step commit, preemption). Blocks are shared by ref
    count (engine/block_manager.py): with other requests through the prefix cache, and with
    the other choices of the same request after a fork.
    """

    def __init__(self, request: GenerationRequest, seed: int, arrival_index: int, mode: Mode,
                 deadline: float, kv_namespace: bytes = b"", index: int = 0, lora: LoraAdapter | None = None) -> None:
        self.request_id = request.request_id
        self.index = index  # choice index within the request
        self.params = request.params
        self.priority = request.priority
        self.background = request.background
        self.deadline = deadline
        self.seed = seed
        self.mode = mode
        self.arrival_index = arrival_index  # FIFO order within a priority level
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None  # first admitted to the running batch
        self.first_token_time: float | None = None
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.token_ids = request.context_token_ids
        self._prompt_ids: list[int] | None = None  # prompt_ids, once asked for
        self.block_table: list[int] = []
        # Its slot in the persistent batch while it runs; -1 (persistent_batch.NO_ROW) when not running.
        # A literal: the dialects reach this module, and it imports nothing of execution/.
        self.row = -1
        # Its stop columns, set by the engine when it is added: the end ids that end it (the
        # request's, else the model's), and whether the server cap leaves its first token out.
        self.eos_token_ids: list[int] = []
        self.decode_side = False
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.cumulative_logprob = request.resumed_logprob
        # Mode.DECODE: the KVPayload to import. Its data is None until the bytes arrive: the
        # scheduler then admits the sequence into RECEIVING (blocks held) and asks for them.
        self.pending_kv = None
        self.kv_import_from = 0  # the first token to import: those before it were prefix-cache hits
        self.pending_choices: list[PendingChoice] = []  # forked once the prompt is computed
        self.kv_export_start = 0  # PREFILL mode: export the prompt's KV from this token on
        # The KV's content key: everything besides the tokens that changes a block's KV (the
        # model and dtype, a p-tuning table's digest, a LoRA adapter's digest).
        self.prompt_table = request.prompt_table
        self.lora = lora
        self.kv_namespace = (kv_namespace + (request.prompt_table.digest if request.prompt_table else b"")
                             + (lora.ref.digest if lora is not None else b""))
        self.draft = request.draft
        self.prompt_lookup = request.prompt_lookup
        self.step_drafts = None  # StepDrafts the next step verifies (engine/decoding/speculative.py), set before each step
        self.block_hashes: list[bytes] = []  # chained keys of the full blocks, memoised (tokens never change)
        self.num_keyed_blocks = 0  # leading blocks of block_table known keyed (BlockManager.cache_full_blocks)
        # (full blocks, keys dropped in the pool) at its last look (BlockManager.cache_full_blocks), None before
        self.keys_looked_at: tuple[int, int] | None = None
        # Prompt scores, by position (position 0 has none), filled as the prompt's chunks run;
        # None unless asked for. DECODE mode never scores: P did, and sent them to the client.
        self.prompt_logprobs: list | None = None
        if self.params.prompt_logprobs is not None and mode is not Mode.DECODE:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        # The prompt's raw logits [prompt tokens, V] float32, by position (a preempted prompt is
        # computed again into the same rows), when asked for; DECODE never has them (P had).
        self.wants_context_logits = self.params.return_context_logits and mode is not Mode.DECODE
        self.context_logits: torch.Tensor | None = None  # made by the first chunk's rows

    @property
    def scores_prompt(self) -> bool:
        """Whether the forward must compute every prompt row's logits (no prefix-cache hits)."""
        return self.prompt_logprobs is not None or self.wants_context_logits

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt (and a resumed request's earlier output): never changes, so sliced once
        (the sampler's batch asks for it at every step); read-only."""
        if self._prompt_ids is None:
            self._prompt_ids = self.token_ids[: self.num_prompt_tokens]
        return self._prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def rank(self) -> tuple[bool, int]:
        """Smaller is served first and may preempt larger: every foreground request before any
        background one, then priority."""
        return self.background, self.priority

    @property
    def order_key(self) -> tuple[bool, int, int, int]:
        """Smaller is served first: rank, then arrival, then choice."""
        return self.background, self.priority, self.arrival_index, self.index

    def clone(self, index: int) -> "Sequence":
        """A beam's copy: the same tokens and progress (its blocks shared by the caller), its own
        index; the next token it appends is its own."""
        child = object.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.index = index
        child.row = -1  # not running until the scheduler joins it
        child.token_ids = list(self.token_ids)
        child.block_table = []
        child.num_keyed_blocks = 0
        child.keys_looked_at = None
        child.block_hashes = list(self.block_hashes)  # keys of shared full blocks; each extends its own
        return child

    def fork(self, choice: PendingChoice) -> "Sequence":
        """A sibling choice: the same prompt and progress through it, its own seed and output.
        The caller shares the blocks (BlockManager.fork) and appends the child's first token."""
        child = self.clone(choice.index)
        child.seed = choice.seed
        child.token_ids = self.token_ids[: self.num_prompt_tokens]
        child.num_computed_tokens = min(self.num_computed_tokens, self.num_prompt_tokens)
        child.cumulative_logprob = 0.0
        child.pending_kv = None
        child.pending_choices = []
        child.finish_reason = None
        child.block_hashes = []  # the parent's may cover its own output tokens; recomputed on demand
        return child
