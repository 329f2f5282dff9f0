"""A Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) that runs on the paged KV cache.

Parameter layout follows transformers' modules with two fusions made at load time:
q/k/v projections into one matrix and gate/up into one, so a layer is four matmuls. The
numerics follow transformers' own modules (RMSNorm in float32, RoPE tables computed in
float32) so that greedy tokens match ``generate()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from engine.execution.attention import StepAttention
from engine.execution import fused_ops
from engine.execution.fused_ops import add_rms_norm, rms_norm_reference, rope, silu_mul
from engine.execution.quant.linear import QuantizedEmbedding, QuantizedLinear


@dataclass
class ModelSpec:
    """The shape of a decoder, read from its Hugging Face config (engine/execution/loader.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool
    layer_windows: list[int | None]  # sliding window per layer, None = full attention
    inv_freq: torch.Tensor  # [head_dim / 2] float32
    rope_scaling: float  # transformers' attention_scaling, applied to cos and sin
    max_position: int


# From TINY to SMALL rows, CPU BLAS runs W @ x^T 1.3-1.6x faster than x @ W^T (decode-sized
# batches; measured in benchmarks/RESULTS.md). Wide outputs (the LM head) also go in row
# blocks, which keeps each block of W in cache. Below TINY rows (one sequence verifying its
# drafts, a few decoding) x @ W^T takes MKL's few-column path: 1.1-3.5x faster there.
TINY_BATCH_ROWS = 8
SMALL_BATCH_ROWS = 128
WIDE_OUTPUT_BLOCK = 4096
# Rows per matmul call of tiled_linear: the cheapest fixed tile measured for decode-sized and
# prefill-sized steps (benchmarks/RESULTS.md, "Attention backends and batch invariance").
INVARIANT_ROW_TILE = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           invariant: bool = False) -> torch.Tensor:
    """x [N, in] @ weight[out, in]^T (+ bias) -> [N, out], the faster way round for the shape;
    ``invariant``: each row's result independent of N (batch-invariant mode), on the C++ kernel
    (fused_ops.invariant_linear) or, where it does not run, ``tiled_linear``."""
    if invariant:
        out = fused_ops.invariant_linear(x, weight)
        if out is None:
            return tiled_linear(x, weight, bias)
        return out + bias if bias is not None else out
    if x.device.type != "cpu" or not TINY_BATCH_ROWS <= x.shape[0] <= SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    out = x.new_empty(weight.shape[0], x.shape[0])  # [out, N]: each block's product lands in place
    if weight.shape[0] > 2 * WIDE_OUTPUT_BLOCK:
        for w, o in zip(weight.split(WIDE_OUTPUT_BLOCK), out.split(WIDE_OUTPUT_BLOCK)):
            torch.mm(w, x.t(), out=o)
    else:
        torch.mm(weight, x.t(), out=out)
    out = out.t()  # [N, out], transposed view
    return out + bias if bias is not None else out


def project(module: nn.Linear | QuantizedLinear, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """``module``'s map of x [N, in] -> [N, out]: an nn.Linear's weight by ``linear``, a GGUF weight
    kept quantized by its kernels (engine/execution/quant/linear.py; batch-invariant on its kernel)."""
    if isinstance(module, QuantizedLinear):
        return module.forward(x, invariant)  # not through nn.Module's call (no hooks on these maps): ~1.5 us each
    return linear(x, module.weight, module.bias, invariant)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 row_tile: int = INVARIANT_ROW_TILE) -> torch.Tensor:
    """x @ weight^T (+ bias) as calls of exactly ``row_tile`` rows each, the last padded with zeros:
    batch-invariant torch, the reference of fused_ops.invariant_linear (and its stand-in where the
    kernel does not run). A GEMM library picks its blocking, and so the order of its sums over
    ``in``, from the call's shape; with one shape for every call a row's result no longer depends on
    how many rows share its step (tests/test_batch_invariance.py)."""
    n = x.shape[0]
    padded = -(-n // row_tile) * row_tile
    if padded != n:
        x = torch.cat([x, x.new_zeros(padded - n, x.shape[1])])
    out = x.new_empty(padded, weight.shape[0])  # [padded, out]
    for start in range(0, padded, row_tile):
        torch.mm(x[start:start + row_tile], weight.t(), out=out[start:start + row_tile])
    out = out[:n]
    return out + bias if bias is not None else out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' formula, operation for operation (fused_ops.rms_norm_reference)."""
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm) in one pass on the CPU (fused_ops.add_rms_norm); x [N, H] is the
        residual stream, which the CPU kernel updates in place."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, window: int | None) -> None:
        super().__init__()
        self.spec, self.window = spec, window
        self.invariant = False  # batch-invariant matmuls, set by DecoderModel.set_batch_invariant
        self.fused = None  # engine/execution/triton_ops on CUDA (DecoderModel.use_fused_ops), else the reference
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.post_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.split = (q_size, kv_size, kv_size)
        self.head_split = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: StepAttention, k_cache: torch.Tensor, v_cache: torch.Tensor,
                lora=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, H] the residual stream, ``pending`` [N, H] the previous layer's output not yet
        added to it (None for the first layer, and always on the Triton path, which adds it at
        the layer's end): off Triton the add is fused with this layer's first norm
        (engine/execution/fused_ops.py). Returns (the stream, the next layer's ``pending``).
        ``lora``: the step's LoRA deltas for this layer (engine/execution/lora.py LayerLora), added to each map's output."""
        spec = self.spec
        n = x.shape[0]
        fused = self.fused
        if fused:
            h = fused.rms_norm(x, self.input_norm.weight, self.input_norm.eps)[0]
        else:
            x, h = self.input_norm.add_and_norm(x, pending)
        qkv = project(self.qkv_proj, h, self.invariant)
        if lora is not None:
            lora.add(("q", "k", "v"), h, qkv, self.split)
        # [N, Hq, D], [N, Hkv, D] x 2: views of qkv by heads (one reshape and one split, not three of each)
        q, k, v = qkv.reshape(n, -1, spec.head_dim).split_with_sizes(self.head_split, 1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused:
            fused.rope_(q, k, cos, sin)  # in place: q and k are views of qkv, or q_norm's new tensors
        else:
            q, k = rope(q, k, cos, sin)
        o = attn.attend(q, k, v, k_cache, v_cache, self.window).reshape(n, -1)  # [N, Hq * D]
        attended = project(self.o_proj, o, self.invariant)
        if lora is not None:
            lora.add(("o",), o, attended, (spec.hidden_size,))
        if fused:  # the residual add and the norm in one pass
            h, x = fused.rms_norm(attended, self.post_norm.weight, self.post_norm.eps, add=x)
        else:
            x, h = self.post_norm.add_and_norm(x, attended)
        gate_up = project(self.gate_up_proj, h, self.invariant)
        if lora is not None:
            lora.add(("gate", "up"), h, gate_up, (spec.intermediate_size,) * 2)
        m = fused.silu_mul(gate_up) if fused else silu_mul(gate_up)  # in gate_up's first half: no new [N, I] tensors
        down = project(self.down_proj, m, self.invariant)
        if lora is not None:
            lora.add(("down",), m, down, (spec.hidden_size,))
        return (x + down, None) if fused else (x, down)


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, w) for w in spec.layer_windows)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.invariant = False

    def set_batch_invariant(self, invariant: bool) -> None:
        """Batch-invariant matmuls (``linear``'s ``invariant``) in every layer and the LM head, or the fastest."""
        self.invariant = invariant
        for layer in self.layers:
            layer.invariant = invariant

    def use_fused_ops(self) -> None:
        """Every layer's RMSNorm (with the residual add after attention), RoPE and SiLU*mul as one
        Triton kernel each (engine/execution/triton_ops.py; CUDA, norms' weights in the model's dtype)."""
        from engine.execution import triton_ops

        for layer in self.layers:
            layer.fused = triton_ops

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_position, D] in the model's dtype, computed in float32 like transformers."""
        if self._rope_cache is None:
            device = self.norm.weight.device
            table = self.embed_tokens  # the model's dtype: the embeddings' (norms may be kept in float32)
            dtype = table.dtype if isinstance(table, QuantizedEmbedding) else table.weight.dtype
            positions = torch.arange(self.spec.max_position, device=device, dtype=torch.float32)
            freqs = positions[:, None] * self.spec.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = ((emb.cos() * self.spec.rope_scaling).to(dtype),
                                (emb.sin() * self.spec.rope_scaling).to(dtype))
        return self._rope_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: StepAttention,
                kv_cache: torch.Tensor, embedding_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                lora=None) -> torch.Tensor:
        """input_ids, positions [N]; kv_cache [L, 2, S, Hkv, D]; ``embedding_rows`` (rows [M],
        embeddings [M, H]) replace those rows' embeddings (p-tuning); ``lora``: the step's LoRA
        deltas (engine/execution/lora.py LoraStep). Returns hidden states [N, H]."""
        cos_table, sin_table = self.rope_tables()
        cos, sin = cos_table[positions], sin_table[positions]  # [N, D]
        x = self.embed_tokens(input_ids)
        if embedding_rows is not None:
            rows, embeddings = embedding_rows
            x[rows] = embeddings.to(x.dtype)
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, pending, cos, sin, attn, kv_cache[i, 0], kv_cache[i, 1],
                               lora.layer(i) if lora is not None else None)
        if self.layers and self.layers[0].fused:
            return self.layers[0].fused.rms_norm(x, self.norm.weight, self.norm.eps)[0]
        return self.norm.add_and_norm(x, pending)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, V], contiguous (the sampler reads rows)."""
        if self.lm_head is not None:
            return project(self.lm_head, hidden, self.invariant).contiguous()
        if isinstance(self.embed_tokens, QuantizedEmbedding):  # tied to the quantized table
            return self.embed_tokens.table(hidden, self.invariant).contiguous()
        return linear(hidden, self.embed_tokens.weight, invariant=self.invariant).contiguous()
