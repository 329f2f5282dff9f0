"""The batched sampler the engine calls once per step.

Pipeline for logits [R, V] of the rows that sample this step:
processors (sampling/processors.py) -> temperature -> logprobs (from this distribution,
after penalties and temperature and before truncation, as OpenAI reports them) -> greedy
rows take the argmax -> min-p (before top-k/top-p, as vLLM does) -> top-k -> top-p ->
exponential race with noise keyed by (seed, step, token) (sampling/noise.py).

The backend is chosen once, in ``__init__``: Ascend's fused operator when the logits
live on an NPU, else the native torch reference (CPU, CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
import math

import torch

from sampling.batch import SamplingBatch
from sampling.noise import exponential_noise
from sampling.processors import apply_all
from sampling.topk_topp import top_k_top_p_sample


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [R]
    logprobs: list[float | None]  # chosen token's logprob, None where not asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # top-N (id, logprob), None where not asked for


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int, top_k_guess: int = 32) -> None:
        self.vocab_size = vocab_size
        self.top_k_guess = top_k_guess
        self.ascend = None
        if device.type == "npu":
            from sampling.npu import AscendTopKTopPSampler

            self.ascend = AscendTopKTopPSampler(top_k_guess)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row. ``logits`` [R, V] is not modified (a float32 copy is)."""
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        apply_all(logits, batch)
        logits.div_(batch.temperature[:, None])
        logprob_table = logits.log_softmax(-1) if batch.max_logprobs is not None else None

        token_ids = logits.argmax(-1)  # greedy rows keep this
        sampled = torch.nonzero(~batch.greedy).flatten()
        if sampled.numel():
            token_ids[sampled] = self._sample(logits[sampled], batch, sampled)
        return self._output(token_ids, logprob_table, batch)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        min_p = batch.min_p[rows]
        if bool((min_p > 0).any()):
            # Keep p >= min_p * p_max, i.e. logit >= max_logit + log(min_p).
            threshold = logits.max(-1, keepdim=True).values + torch.log(min_p.clamp(min=1e-30))[:, None]
            logits.masked_fill_((min_p[:, None] > 0) & (logits < threshold), -float("inf"))
        seed_lo, seed_hi, step = batch.seed_lo[rows], batch.seed_hi[rows], batch.step[rows]
        top_k, top_p = batch.top_k[rows], batch.top_p[rows]
        if self.ascend is not None:
            reason = self.ascend.unsupported_reason(top_k, self.vocab_size)
            if reason is None:
                vocab_ids = torch.arange(logits.shape[1], device=logits.device)
                q = exponential_noise(seed_lo, seed_hi, step, vocab_ids)  # [r, V]
                return self.ascend.sample(logits, top_k, top_p, q)
            self.ascend.warn_fallback_once(reason)

        def noise(local_rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
            return exponential_noise(seed_lo[local_rows], seed_hi[local_rows], step[local_rows], token_ids)

        return top_k_top_p_sample(logits, top_k, top_p, noise, top_k_limit=self.vocab_size,
                                  top_k_guess=self.top_k_guess)

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
            for i, row in enumerate(batch.rows):
                n = row.params.logprobs
                if n is None:
                    continue
                chosen[i] = _finite(chosen_all[i])
                tops[i] = [(t, _finite(v)) for t, v in zip(top_ids[i][:n], top_values[i][:n])]
        return SamplerOutput(ids, chosen, tops)


def _finite(value: float) -> float:
    """A logprob for JSON: -inf (a banned token chosen by no one) becomes the float minimum."""
    return value if math.isfinite(value) else -3.4e38
