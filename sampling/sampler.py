"""The batched sampler the engine calls once per step.

Pipeline for logits [R, V] of the rows that sample this step:
grammar mask (tokens a row's grammar forbids get -inf; sampling/grammar.py) -> processors
(sampling/processors.py) -> temperature -> logprobs (from this distribution,
after penalties and temperature and before truncation, as OpenAI reports them) -> greedy
rows take the argmax -> min-p (before top-k/top-p, as vLLM does) -> top-k -> top-p ->
exponential race with noise keyed by (seed, step, candidate position) (sampling/noise.py). A row that
verifies a draft with the draft's probabilities takes the speculative-sampling rule instead
of the race (sampling/speculative.py).

The backend is chosen once, in ``__init__``: Ascend's fused operator when the logits
live on an NPU and the operator answers there, else the native torch reference (CPU, CUDA).
Both read the race's noise in the same order (q[b, j] for row b's j-th candidate of the sorted,
truncated row), so a seeded request gets the same tokens from either.
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import math

import numpy as np
import torch

from sampling.batch import SamplingBatch
from sampling.grammar import allowed_tokens
from sampling.noise import exponential_noise
from sampling.processors import apply_all
from sampling.speculative import target_probs, verify_drafts
from sampling.topk_topp import take_rows, top_k_top_p_sample


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [R]
    logprobs: list[float | None]  # chosen token's logprob, None where not asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # top-N (id, logprob), None where not asked for


logger = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "ascend")


# Rows of a 16-bit [R, V] that ``greedy`` widens to float32 at a time: up to 2**21 values (8 MiB; a
# block over 32 MiB, glibc's largest mmap threshold, is mapped afresh each time: see greedy).
GREEDY_CHUNK_VALUES = 1 << 21


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's argmax of ``logits`` [R, V], the first index of the maximum (a NaN
    counts as the maximum), as it is in float32. On the CPU through numpy, whose argmax is vectorised
    (torch's took 1.4-1.7 ms for [32, 49152] here, numpy's 0.24: benchmarks/RESULTS.md); the same index.
    A 16-bit ``logits`` is widened (exactly) a few rows at a time: a float32 copy of all of it, 50 MB
    at [256, 49152], came in fresh pages at every step (glibc maps a block that large anew each time),
    and with the argmax took 26-33 ms on the 2-core EPYC against 2-3 ms in chunks (benchmarks/RESULTS.md,
    issue 51 session 9)."""
    if logits.device.type != "cpu":  # torch's argmax of a 16-bit tensor is its float32 one's: no copy
        return logits.argmax(-1)
    if logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))
    ids = np.empty(logits.shape[0], dtype=np.int64)
    rows = max(1, GREEDY_CHUNK_VALUES // max(1, logits.shape[1]))
    for start in range(0, logits.shape[0], rows):
        ids[start:start + rows] = np.argmax(logits[start:start + rows].float().numpy(), axis=-1)
    return torch.from_numpy(ids)


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int, top_k_guess: int = 32, backend: str = "auto") -> None:
        """``backend``: "auto" picks Ascend's operator when ``device`` is an NPU and the operator
        answers there (else native, with the reason logged and kept in ``fallback_reason``);
        "ascend" insists on it (RuntimeError at start-up when it is not there)."""
        if backend not in BACKENDS:
            raise ValueError(f"sampler_backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.vocab_size = vocab_size
        self.top_k_guess = top_k_guess
        self.ascend = None
        self.fallback_reason: str | None = None
        if backend == "ascend" or (backend == "auto" and device.type == "npu"):
            from sampling.npu import AscendTopKTopPSampler

            self.ascend, self.fallback_reason = AscendTopKTopPSampler.open(device, vocab_size, top_k_guess)
            if self.ascend is None and backend == "ascend":
                raise RuntimeError(f"sampler_backend: ascend is not available: {self.fallback_reason}")
            if self.ascend is None:
                logger.warning("Sampler: Ascend's operator is not used, native sampler instead: %s",
                               self.fallback_reason)

    @property
    def backend_name(self) -> str:
        """The backend in use: "ascend" or "native" (shown in /v1/models)."""
        return "ascend" if self.ascend is not None else "native"

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` [R, V].

        Changes ``logits`` in place when it is float32 (processors, temperature, min-p), as
        vLLM's sampler does: the caller hands over a tensor it does not use again.
        """
        logits = logits[:, : self.vocab_size]
        if batch.argmax_only:  # nothing reads the logits but the argmax: no float32 copy of them all
            return self._output(greedy(logits), None, batch)
        logits = logits.float()  # the same tensor when already float32
        if batch.token_bitmask is not None:
            rows = batch.grammar_rows
            allowed = allowed_tokens(batch.token_bitmask, self.vocab_size)  # [Rc, V]
            logits[rows] = logits[rows].masked_fill(~allowed, -float("inf"))
        if batch.processors is not None:
            apply_all(logits, batch.processors)
        if batch.scales_temperature:
            logits.div_(batch.temperature[:, None])
        logprob_table = logits.log_softmax(-1) if batch.max_logprobs is not None else None

        greedy_rows, sampled_rows, draft_rows = batch.greedy_rows, batch.sampled_rows, batch.draft_rows
        if not sampled_rows.numel() and not draft_rows.numel():  # all greedy: no scatter
            return self._output(greedy(logits), logprob_table, batch)
        token_ids = torch.empty(batch.num_rows, dtype=torch.int64, device=logits.device)
        if greedy_rows.numel():
            token_ids[greedy_rows] = greedy(logits[greedy_rows])
        self._apply_min_p(logits, batch)
        if sampled_rows.numel():
            token_ids[sampled_rows] = self._sample(logits, batch, sampled_rows)
        if draft_rows.numel():
            rows = draft_rows
            p = target_probs(logits[rows], batch.top_k[rows], batch.top_p[rows])
            token_ids[rows] = verify_drafts(p, batch.draft_tokens, batch.draft_probs, batch.seed_lo[rows],
                                            batch.seed_hi[rows], batch.step[rows])
        return self._output(token_ids, logprob_table, batch)

    @staticmethod
    def _apply_min_p(logits: torch.Tensor, batch: SamplingBatch) -> None:
        """Keep p >= min_p * p_max, i.e. logit >= max_logit + log(min_p) (in place, min-p rows only)."""
        rows = batch.min_p_rows
        if rows.numel():
            sub = logits[rows]
            threshold = sub.max(-1, keepdim=True).values + torch.log(batch.min_p[rows])[:, None]
            logits[rows] = sub.masked_fill(sub < threshold, -float("inf"))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        """Sample ``rows`` of ``logits`` [R, V]; returns [len(rows)] token ids."""
        if self.ascend is not None:
            top_k, top_p = batch.top_k[rows], batch.top_p[rows]
            row_logits = take_rows(logits, rows)
            op_dtype = self.ascend.operator_dtype(row_logits)
            reason = self.ascend.unsupported_reason(top_k, top_p, self.vocab_size, op_dtype)
            if reason is None:
                # q[b, j]: the noise of row b's j-th candidate, as the native race reads it.
                positions = torch.arange(logits.shape[1], device=logits.device)
                q = exponential_noise(batch.seed_lo[rows], batch.seed_hi[rows], batch.step[rows], positions)  # [r, V]
                return self.ascend.sample(row_logits, top_k, top_p, q, op_dtype)
            self.ascend.warn_fallback_once(reason)

        def noise(noise_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return exponential_noise(batch.seed_lo[noise_rows], batch.seed_hi[noise_rows], batch.step[noise_rows],
                                     positions)

        return top_k_top_p_sample(logits, batch.top_k, batch.top_p, noise, top_k_limit=self.vocab_size,
                                  top_k_guess=self.top_k_guess, sample_rows=rows)

    @staticmethod
    def _output(token_ids: torch.Tensor, logprob_table: torch.Tensor | None, batch: SamplingBatch) -> SamplerOutput:
        ids = token_ids.tolist()
        n_rows = len(ids)
        chosen: list[float | None] = [None] * n_rows
        tops: list[list[tuple[int, float]] | None] = [None] * n_rows
        if logprob_table is not None:
            chosen_all = logprob_table.gather(-1, token_ids[:, None]).squeeze(-1).tolist()
            top_values, top_ids = logprob_table.topk(max(batch.max_logprobs, 1), dim=-1)
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
            for i, n in enumerate(batch.top_n):
                if n is None:
                    continue
                chosen[i] = _finite(chosen_all[i])
                tops[i] = [(t, _finite(v)) for t, v in zip(top_ids[i][:n], top_values[i][:n])]
        return SamplerOutput(ids, chosen, tops)


def _finite(value: float) -> float:
    """A logprob for JSON: -inf (a banned token chosen by no one) becomes the float minimum."""
    return value if math.isfinite(value) else -3.4e38
