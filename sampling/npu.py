"""The Ascend backend: ``torch_npu.npu_top_k_top_p_sample`` (aclnnTopKTopPSample).

``torch_npu`` is imported when this backend is built, never at package import, so the
package and its tests run without it. ``AscendTopKTopPSampler.open`` checks once, at start-up,
that the operator exists and runs on the device (a probe call on a [1, 4] row whose answer is
known); the caller falls back to the native sampler when it does not (sampling/sampler.py).

The operator is called by keyword with its documented dtypes: fp16/bf16 logits, int32 top_k,
top_p in the logits' dtype, fp32 q of the logits' shape. Float32 logits go as fp16 when their
finite values fit fp16's range (10 bits of mantissa: top_p 0.999 arrives as 0.99902, 0.9 as
0.89990), else as bf16 (7 bits: 0.999 would arrive as 1.0). A batch with a top_p below 1 that
the dtype would round to 1 (which skips top-p) is left to the native backend, as is one with a
top_k the operator would skip. Its skip rules are encoded in the arguments: top_k = 0 skips
top-k, top_p = 1 skips top-p.
"""

from __future__ import annotations

import importlib
import logging

import torch

from sampling.topk_topp import EPS

logger = logging.getLogger(__name__)

OPERATOR_MAX_TOP_K = 1024
OPERATOR_MAX_VOCAB = 2**20  # seeds/003: 0 < vocSize <= 2^20
FP16_MAX = 65504.0


class AscendTopKTopPSampler:
    def __init__(self, torch_npu, top_k_guess: int = 32) -> None:
        self._torch_npu = torch_npu
        self.top_k_guess = top_k_guess
        self._warned: set[str] = set()

    @classmethod
    def open(cls, device: torch.device, vocab_size: int,
             top_k_guess: int = 32) -> tuple[AscendTopKTopPSampler | None, str | None]:
        """(the backend, None) when the operator is there and answers a probe on ``device``,
        else (None, why not)."""
        if not 0 < vocab_size <= OPERATOR_MAX_VOCAB:
            return None, f"the vocabulary ({vocab_size}) is over the operator's 2^20"
        try:
            torch_npu = importlib.import_module("torch_npu")
        except ImportError as error:
            return None, f"torch_npu does not import ({error})"
        if not hasattr(torch_npu, "npu_top_k_top_p_sample"):
            return None, "this torch_npu has no npu_top_k_top_p_sample (aclnnTopKTopPSample)"
        backend = cls(torch_npu, top_k_guess)
        # Top-2 of [0, 1, 2, 3] with q favouring the second candidate: token 2 by the operator's
        # formula (q in candidate order); an operator that runs but reads q otherwise answers 3.
        logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=device)
        q = torch.tensor([[1.0, 1e-6, 1.0, 1.0]], device=device)
        try:
            answer = backend.sample(logits, torch.tensor([2], device=device), torch.tensor([1.0], device=device), q)
            token = int(answer[0])
        except Exception as error:  # the device has no kernel for it: any error means "not here"
            return None, f"the operator fails on {device} ({type(error).__name__}: {error})"
        if token != 2:
            return None, f"the operator's probe answered token {token}, not 2 (q read in another order)"
        return backend, None

    def unsupported_reason(self, top_k: torch.Tensor, top_p: torch.Tensor, vocab_size: int,
                           op_dtype: torch.dtype) -> str | None:
        """Why this batch must use the native backend instead, or None if the operator can do it."""
        if bool(((top_k > OPERATOR_MAX_TOP_K) & (top_k < vocab_size)).any()):
            return f"a top_k in ({OPERATOR_MAX_TOP_K}, vocab) keeps k tokens; the operator would skip top-k"
        if bool(((top_p < 1.0) & (top_p.to(op_dtype) >= 1.0)).any()):
            return f"a top_p below 1 rounds to 1 in {op_dtype}; the operator would skip top-p"
        return None

    @staticmethod
    def operator_dtype(logits: torch.Tensor) -> torch.dtype:
        """The dtype the operator gets ``logits`` [R, V] in: theirs when fp16/bf16, else fp16 when
        the finite values fit, else bf16."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            return logits.dtype
        finite = logits.masked_fill(~torch.isfinite(logits), 0.0)
        return torch.float16 if bool(finite.abs().max() <= FP16_MAX) else torch.bfloat16

    def warn_fallback_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("Ascend sampler falls back to the native backend for a batch: %s", reason)

    def sample(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, q: torch.Tensor,
               op_dtype: torch.dtype | None = None) -> torch.Tensor:
        """logits [R, V] (any float dtype; cast to ``op_dtype``, by default ``operator_dtype``),
        top_k [R], top_p [R], q [R, V] float32 Exp(1) noise, q[b, j] for row b's j-th candidate.
        Returns the chosen token ids [R] int64."""
        op_dtype = op_dtype or self.operator_dtype(logits)
        result = self._torch_npu.npu_top_k_top_p_sample(
            logits.to(op_dtype),
            top_k.to(torch.int32),
            top_p.to(op_dtype),
            q=q.to(torch.float32),
            eps=EPS,
            is_need_logits=False,
            top_k_guess=self.top_k_guess,
        )
        chosen = result[0] if isinstance(result, (tuple, list)) else result
        return chosen.to(torch.int64).reshape(-1)
