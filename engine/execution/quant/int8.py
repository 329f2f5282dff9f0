"""``quantization: int8``: a Hugging Face checkpoint's linear weights and token table quantized at
load to int8 with a float16 scale per 32 weights of a row (GGUF's Q8_0 blocks, 8.5 bits a weight),
then multiplied by the same kernels as a GGUF's (engine/execution/quant/linear.py).

Per-block scales rather than one per output channel (decision): the kernels already decode Q8_0 in
registers at memory speed, and a scale per 32 weights bounds each weight's error by its block's
largest value instead of its row's, for 6% more bytes. A weight whose K is not whole blocks of 32
stays in the serving dtype, and the log names it.
"""

from __future__ import annotations

import logging

from gguf import GGMLQuantizationType
from gguf.quants import quantize
import torch
from torch import nn

from engine.execution.quant.linear import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)

INT8 = GGMLQuantizationType.Q8_0
BLOCK = 32


def int8_blocks(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> raw Q8_0 blocks [N, K / 32 * 34] uint8 (the gguf package's quantizer)."""
    return torch.from_numpy(quantize(weight.detach().float().numpy(), INT8))


def quantize_to_int8(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace ``model``'s nn.Linear layers and nn.Embedding table, in place, by int8 ones (biases kept)."""
    kept = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        k = module.weight.shape[1]
        if k % BLOCK:
            kept.append(name)
            continue
        if isinstance(module, nn.Embedding):
            replacement = QuantizedEmbedding(INT8, int8_blocks(module.weight), k, dtype)
        else:
            replacement = QuantizedLinear([(INT8, int8_blocks(module.weight))], k, bias=module.bias is not None)
            if module.bias is not None:
                replacement.bias.data.copy_(module.bias.detach())
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, replacement)
    if kept:
        log.warning("quantization int8: %s keep %s (K not whole blocks of %d)", ", ".join(kept),
                    str(dtype).removeprefix("torch."), BLOCK)
