"""The torch references of the decoder's RMSNorm and RoPE give transformers' bits in float32 (the kernels of
engine/execution/fused_ops.py are compared with them in tests/test_fused_ops.py; the fp32 parity promise
rests on them): the same operations in the same order, however they are written here."""

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.execution.fused_ops import rope_reference
from engine.execution.model import RMSNorm


def test_rms_norm_is_transformers_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    ours, theirs = RMSNorm(576, 1e-5), LlamaRMSNorm(576, 1e-5)
    with torch.no_grad():
        weight = torch.randn(576, generator=generator)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        for rows in (1, 7, 300):
            x = torch.randn(rows, 576, generator=generator) * 3
            assert torch.equal(ours(x), theirs(x))


def test_rope_is_transformers_bit_for_bit_on_a_strided_query():
    generator = torch.Generator().manual_seed(1)
    n, heads, kv_heads, d = 37, 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=generator)
    q = qkv[:, : heads * d].reshape(n, heads, d)  # a view of the fused projection, as the layer has it
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=generator)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()  # [N, D]
    # transformers: [B, H, S, D] with cos/sin [B, S, D]
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rope_reference(q, cos, sin), expected[0].transpose(0, 1))
