"""What model execution reads of a step, declared on its own floor (docs/architecture.md, "Floors").

The model runner sits below the request, the block ledger and the scheduler: it imports none of
them. It reads a step through these protocols, which engine/request.py's ``Sequence``,
engine/block_manager.py's ``BlockManager`` and engine/scheduler.py's ``ScheduledBatch`` satisfy
by shape. Only the fields named here cross the floor.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.kv_tier import KVTier, TierMove
from engine.kv_transfer import KVPayload
from engine.lora_adapter import LoraAdapter
from sampling import SamplingParams


class StepDrafts(Protocol):
    token_ids: list[int]  # draft tokens run after the sequence's last token this step


class PromptEmbeddings(Protocol):
    embeddings: np.ndarray  # [prompt_vocab_size, hidden] float32: row i replaces prompt id vocab_size + i


class StepSequence(Protocol):
    """One sequence as the runner reads it; ``pending_kv`` is the one field it writes (None once imported)."""

    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens [0, this) have their KV in the pool
    block_table: list[int]  # block index per block_size tokens
    params: SamplingParams
    prompt_logprobs: list | None  # not None: score the prompt rows this step computes
    wants_context_logits: bool
    prompt_table: PromptEmbeddings | None
    step_drafts: StepDrafts | None
    lora: LoraAdapter | None
    pending_kv: KVPayload | None  # imported KV waiting to be written into the pool

    @property
    def num_tokens(self) -> int: ...


class StepBatch(Protocol):
    """One step: each entry a sequence and how many of its tokens run now."""

    entries: list[tuple[StepSequence, int]]
    drafted: list[int]  # per entry: draft tokens run after its last token
    kv_imports: list[tuple[StepSequence, int]]  # (sequence, first token to import) before the forward
    block_copies: list[tuple[int, int]]  # copy-on-write (source block, destination block) before the forward
    slots: np.ndarray  # [E] int64: each entry's row in the persistent batch (engine/execution/persistent_batch.py)
    decode_only: bool  # every entry one decode token that samples one row: the step is read from the columns


class KVBlocks(Protocol):
    """The pool's geometry and a sequence's slots in it: slot of token i = table[i // B] * B + i % B."""

    num_blocks: int
    block_size: int
    tier: KVTier | None  # the second tier behind the pool (engine/kv_tier.py)

    def slots(self, seq: StepSequence, start: int, end: int) -> list[int]: ...

    def take_tier_moves(self) -> list[TierMove]: ...  # copies to make before the next forward
