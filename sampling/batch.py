"""The per-step view of a batch that the sampler reads: per-row parameters as tensors.

Built once per engine step from the requests that sample in that step, or gathered from the
persistent batch's columns when every row samples from them alone (``from_columns``). Dense per-row
controls (temperature, top-k, top-p, min-p, seeds) become [R] tensors so the sampler handles
them without a Python loop over rows; penalties, logit biases and bans are the processors' inputs
(sampling/processors.py ``ProcessorInputs``), over the rows that ask for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sampling.noise import split_seed
from sampling.params import SamplingParams
from sampling.processors import ProcessorInputs


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    seed: int  # resolved: the request's or the one the engine drew
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: list[int]  # the model's EOS ids, or [params.eos_token_id]
    token_bitmask: torch.Tensor | None = None  # [W] int32: the tokens its grammar allows (sampling/grammar.py)
    # A draft token this row verifies, with its draft probabilities [V] (sampling/speculative.py).
    # A draft without them needs nothing here: the engine compares it with the row's token.
    draft_token: int | None = None
    draft_probs: torch.Tensor | None = None


@dataclass
class SamplingColumns:
    """A step's rows' dense sampling controls, each [R] (numpy): what ``SamplingBatch.from_columns`` reads."""

    greedy: np.ndarray  # bool
    temperature: np.ndarray  # float32, 1.0 on greedy rows
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    seed_lo: np.ndarray  # int64
    seed_hi: np.ndarray  # int64
    step: np.ndarray  # int64: index of the token being generated
    logprobs: np.ndarray  # int64: top-N asked for, -1 = none
    processors: ProcessorInputs | None  # the rows' penalties, biases and bans (on the CPU); None: no row has one


@dataclass
class SamplingBatch:
    rows: list[SamplingRow]
    # Row partitions known on the host when the batch is built, so that the sampler does not
    # read them back from the device (one host sync per step: the sampled ids).
    greedy_rows: torch.Tensor  # [Rg] int64: rows that take the argmax
    sampled_rows: torch.Tensor  # [Rs] int64: the others, but for the draft rows
    draft_rows: torch.Tensor  # [Rq] int64: sampled rows that verify a draft with its probabilities
    draft_tokens: torch.Tensor  # [Rq] int64: their draft tokens
    draft_probs: torch.Tensor | None  # [Rq, V] float32: their draft probabilities; None when Rq = 0
    min_p_rows: torch.Tensor  # [Rm] int64: sampled rows with min-p on
    scales_temperature: bool  # some row's temperature is not 1
    temperature: torch.Tensor  # [R] float32, 1.0 on greedy rows
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float32, 1.0 = off
    min_p: torch.Tensor  # [R] float32, 0.0 = off
    seed_lo: torch.Tensor  # [R] int64
    seed_hi: torch.Tensor  # [R] int64
    step: torch.Tensor  # [R] int64: index of the token being generated
    max_logprobs: int | None  # largest top-N asked for in the batch, None if none asked
    top_n: list[int | None]  # per row: the top-N logprobs it asked for, None if none
    processors: ProcessorInputs | None  # the rows' penalties, biases and bans; None when no row asks for one
    grammar_rows: torch.Tensor  # [Rc] int64: rows constrained by a grammar
    token_bitmask: torch.Tensor | None  # [Rc, W] int32: their allowed tokens, packed; None when Rc = 0

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingBatch":
        params = [r.params for r in rows]
        seeds = [split_seed(r.seed) for r in rows]
        asked = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        drafts = [i for i, (g, r) in enumerate(zip(greedy, rows)) if not g and r.draft_probs is not None]
        constrained = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        # The dense per-row columns go to the device in two copies, not one each (a copy to a GPU
        # costs more than building its column): float32 [3, R] and int64 [4, R].
        floats = tensor([temperature, [p.top_p for p in params], [p.min_p for p in params]], torch.float32)
        ints = tensor([[p.top_k if p.top_k < vocab_size else 0 for p in params], [lo for lo, _ in seeds],
                       [hi for _, hi in seeds], [len(r.output_ids) for r in rows]], torch.int64)
        return cls(
            rows=rows,
            greedy_rows=tensor([i for i, g in enumerate(greedy) if g], torch.int64),
            sampled_rows=tensor([i for i, g in enumerate(greedy) if not g and i not in drafts], torch.int64),
            draft_rows=tensor(drafts, torch.int64),
            draft_tokens=tensor([rows[i].draft_token for i in drafts], torch.int64),
            draft_probs=torch.stack([rows[i].draft_probs for i in drafts]).to(device) if drafts else None,
            min_p_rows=tensor([i for i, (g, p) in enumerate(zip(greedy, params)) if not g and p.min_p > 0],
                              torch.int64),
            scales_temperature=any(t != 1.0 for t in temperature),
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seed_lo=ints[1],
            seed_hi=ints[2],
            step=ints[3],
            max_logprobs=max(asked) if asked else None,
            top_n=[p.logprobs for p in params],
            processors=None if (inputs := ProcessorInputs.from_rows(rows)) is None else inputs.to(device),
            grammar_rows=tensor(constrained, torch.int64),
            token_bitmask=torch.stack([rows[i].token_bitmask for i in constrained]).to(device) if constrained else None,
        )

    @classmethod
    def from_columns(cls, columns: "SamplingColumns", device: torch.device) -> "SamplingBatch":
        """The batch of rows that sample from their columns alone (engine/execution/persistent_batch.py:
        no grammar, draft or beam), gathered for the step, without a Python loop over rows."""
        greedy, min_p = columns.greedy, columns.min_p
        logprobs = columns.logprobs

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(device)

        empty = torch.zeros(0, dtype=torch.int64, device=device)
        max_logprobs = int(logprobs.max()) if len(logprobs) and logprobs.max() >= 0 else None
        return cls(
            rows=[],
            greedy_rows=tensor(np.flatnonzero(greedy)),
            sampled_rows=tensor(np.flatnonzero(~greedy)),
            draft_rows=empty, draft_tokens=empty, draft_probs=None,
            min_p_rows=tensor(np.flatnonzero(~greedy & (min_p > 0))),
            scales_temperature=bool((columns.temperature != 1.0).any()),
            temperature=tensor(columns.temperature),
            top_k=tensor(columns.top_k),
            top_p=tensor(columns.top_p),
            min_p=tensor(min_p),
            seed_lo=tensor(columns.seed_lo),
            seed_hi=tensor(columns.seed_hi),
            step=tensor(columns.step),
            max_logprobs=max_logprobs,
            top_n=[None] * len(logprobs) if max_logprobs is None else [n if n >= 0 else None for n in logprobs.tolist()],
            processors=None if columns.processors is None else columns.processors.to(device),
            grammar_rows=empty,
            token_bitmask=None,
        )

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    @property
    def argmax_only(self) -> bool:
        """Whether the sampler reads nothing of the logits but each row's argmax: every row greedy,
        none scaled, masked, processed or asking for logprobs."""
        return (not self.sampled_rows.numel() and not self.draft_rows.numel() and not self.scales_temperature
                and self.token_bitmask is None and self.processors is None and self.max_logprobs is None)
