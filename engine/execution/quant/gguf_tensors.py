"""A GGUF file's linear weights as the model's quantized modules, read as stored.

Maps llama.cpp's tensor names to DecoderModel's modules (q/k/v and gate/up fused, as the loader
fuses transformers' names): ``token_embd`` -> embed_tokens (and the tied LM head), ``output`` ->
lm_head, ``blk.N.attn_{q,k,v}`` -> layers.N.qkv_proj, ``attn_output`` -> o_proj,
``ffn_{gate,up}`` -> gate_up_proj, ``ffn_down`` -> down_proj. A module is kept quantized when
every part's type has a kernel (kernels.KERNEL_TYPES); the others (F32, F16, BF16 and types
without a kernel) come dequantized from the converted directory, as before, and the log names
them. Norms and biases always come from there.

llama.cpp's converter permutes the rows of q and k for the "llama" architecture (its RoPE
layout); transformers undoes it when it dequantizes, and so do we here, by rows: a row's blocks
are untouched, so the permutation is exact on raw bytes.
"""

from __future__ import annotations

from collections import Counter
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.execution.gguf_index import read_tensor_index
from engine.execution.model import ModelSpec
from engine.execution.quant.kernels import KERNEL_TYPES
from engine.execution.quant.linear import QuantizedEmbedding, QuantizedLinear

log = logging.getLogger(__name__)

# DecoderModel's linear module -> its parts' GGUF names within a block, in output order.
LAYER_MAPS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
              "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}
BIASED = {"qkv_proj": "qkv_bias", "o_proj": "o_bias", "gate_up_proj": "mlp_bias", "down_proj": "mlp_bias"}


def quantized_modules(path: Path, spec: ModelSpec, dtype: torch.dtype) -> dict[str, nn.Module]:
    """Module path (as in DecoderModel's state dict, without ".weight") -> its quantized module,
    for every linear weight of GGUF ``path`` stored in a type with a kernel."""
    index = read_tensor_index(path)
    tensors = index.tensors
    permuted = index.architecture == "llama"
    modules: dict[str, nn.Module] = {}
    dequantized: Counter[str] = Counter()

    def raw(name: str) -> torch.Tensor:  # [rows, row bytes] uint8, a copy in memory (the file's map is read-only)
        data = np.array(tensors[name].data, copy=True)
        data = data.reshape(data.shape[0], -1)
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = spec.num_heads if ".attn_q." in name else spec.num_kv_heads
            data = data[_unpermuted_rows(data.shape[0], heads)]
        return torch.from_numpy(data)

    def kernel_type(names: list[str]):
        types = [tensors[name].tensor_type for name in names]
        if all(t in KERNEL_TYPES for t in types):
            return types
        dequantized.update(t.name for t in types if t not in KERNEL_TYPES)
        return None

    embedding = "token_embd.weight"
    types = kernel_type([embedding])
    if types:
        modules["embed_tokens"] = QuantizedEmbedding(types[0], raw(embedding), spec.hidden_size, dtype)
    if not spec.tie_word_embeddings and (types := kernel_type(["output.weight"])):
        modules["lm_head"] = QuantizedLinear([(types[0], raw("output.weight"))], spec.hidden_size)
    for i in range(spec.num_layers):
        for module, parts in LAYER_MAPS.items():
            names = [f"blk.{i}.{part}.weight" for part in parts]
            if types := kernel_type(names):
                in_features = spec.intermediate_size if module == "down_proj" else (
                    spec.num_heads * spec.head_dim if module == "o_proj" else spec.hidden_size)
                modules[f"layers.{i}.{module}"] = QuantizedLinear(
                    list(zip(types, (raw(name) for name in names))), in_features, bias=getattr(spec, BIASED[module]))
    if dequantized:
        log.warning("GGUF %s: tensor types %s have no quantized kernel; those weights are dequantized to %s",
                    path.name, ", ".join(f"{name} ({count})" for name, count in sorted(dequantized.items())),
                    str(dtype).removeprefix("torch."))
    return modules


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights):
    rows [heads, 2, half] stored as [heads, half, 2]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
