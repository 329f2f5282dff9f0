"""The Ascend backend: ``torch_npu.npu_top_k_top_p_sample`` (aclnnTopKTopPSample).

``torch_npu`` is imported when this backend is built, never at package import, so the
package and its tests run without it. The operator is called by keyword with its
documented dtypes: fp16/bf16 logits, int32 top_k, top_p in the logits' dtype, fp32 q of
the logits' shape. Its skip rules are encoded in the arguments: top_k = 0 skips top-k,
top_p = 1 skips top-p.
"""

from __future__ import annotations

import importlib
import logging

import torch

from sampling.topk_topp import EPS

logger = logging.getLogger(__name__)

OPERATOR_MAX_TOP_K = 1024


class AscendTopKTopPSampler:
    def __init__(self, top_k_guess: int = 32) -> None:
        self._torch_npu = importlib.import_module("torch_npu")
        self.top_k_guess = top_k_guess
        self._warned: set[str] = set()

    def unsupported_reason(self, top_k: torch.Tensor, vocab_size: int) -> str | None:
        """Why this batch must use the native backend instead, or None if the operator can do it."""
        if bool(((top_k > OPERATOR_MAX_TOP_K) & (top_k < vocab_size)).any()):
            return f"a top_k in ({OPERATOR_MAX_TOP_K}, vocab) keeps k tokens; the operator would skip top-k"
        return None

    def warn_fallback_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("Ascend sampler falls back to the native backend: %s", reason)

    def sample(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               q: torch.Tensor) -> torch.Tensor:
        """logits [R, V] (any float dtype; cast to the operator's), top_k [R], top_p [R],
        q [R, V] float32 Exp(1) noise. Returns the chosen token ids [R] int64."""
        op_dtype = logits.dtype if logits.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
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
