"""Attention over the paged KV cache.

The KV cache of one layer is a flat pool of slots, [num_blocks * block_size, kv_heads,
head_dim]; token i of a sequence lives in slot block_table[i // B] * B + i % B. One engine
step's tokens are a flat batch of N tokens: decode tokens (one per sequence) and prefill
chunks (several tokens of one sequence). All of them write their K/V into their slots;
then decodes attend in one batched call and each prefill chunk in one call of its own.
Masks are built once per step (``AttentionBatch``) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # first index of the chunk in the flat batch
    num_tokens: int
    context_slots: torch.Tensor  # [ctx] slots of positions 0..ctx-1, ctx = start_pos + num_tokens
    start_pos: int  # position of the chunk's first token in its sequence
    masks: dict[int | None, torch.Tensor | None]  # window -> [num_tokens, ctx] bool, None: plain causal


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [N] slot each new token's K/V is written to
    decode_rows: torch.Tensor  # [Bd] indices of decode tokens in the flat batch
    decode_blocks: torch.Tensor  # [Bd, MB] block table per decoding sequence, 0-padded
    decode_masks: dict[int | None, torch.Tensor]  # window -> [Bd, 1, 1, MB * block_size] bool
    block_size: int
    prefills: list[PrefillChunk]


def build_attention_batch(slot_mapping: torch.Tensor, decodes: list[tuple[int, int, list[int]]],
                          prefills: list[tuple[int, int, int, list[int]]], windows: set[int | None],
                          block_size: int, device: torch.device) -> AttentionBatch:
    """slot_mapping: [N] on the device; decodes: (flat index, context length, block table);
    prefills: (flat start, n tokens, start position, context slots). ``windows``: the sliding
    windows of the model's layers (None = full attention)."""
    max_blocks = max((len(t) for _, _, t in decodes), default=1)
    decode_blocks = torch.zeros(len(decodes), max_blocks, dtype=torch.int64)
    lengths = torch.tensor([n for _, n, _ in decodes], dtype=torch.int64)
    for i, (_, _, table) in enumerate(decodes):
        decode_blocks[i, : len(table)] = torch.tensor(table)
    key_pos = torch.arange(max_blocks * block_size)[None, :]  # [1, Lmax]
    query_pos = (lengths - 1)[:, None]  # [Bd, 1]
    decode_masks = {w: _window_mask(query_pos, key_pos, w)[:, None, None, :].to(device) for w in windows}

    chunks = []
    for start, n, start_pos, slots in prefills:
        q_pos = torch.arange(start_pos, start_pos + n)[:, None]  # [n, 1]
        k_pos = torch.arange(start_pos + n)[None, :]  # [1, ctx]
        masks = {w: None if start_pos == 0 and (w is None or w >= n) else _window_mask(q_pos, k_pos, w).to(device)
                 for w in windows}
        chunks.append(PrefillChunk(start, n, torch.tensor(slots, device=device), start_pos, masks))
    return AttentionBatch(
        slot_mapping=slot_mapping,
        decode_rows=torch.tensor([i for i, _, _ in decodes], dtype=torch.int64, device=device),
        decode_blocks=decode_blocks.to(device),
        decode_masks=decode_masks,
        block_size=block_size,
        prefills=chunks,
    )


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key j is visible to query i when j <= i and, with a sliding window w, j > i - w."""
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, window: int | None) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] for the step's new tokens; k_cache/v_cache [S, Hkv, D]
    (written in place at ``batch.slot_mapping``). Returns [N, Hq, D]."""
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    if batch.decode_rows.numel():
        num_seqs, hkv, d = batch.decode_blocks.shape[0], k_cache.shape[1], k_cache.shape[2]
        q_d = q[batch.decode_rows].unsqueeze(2)  # [Bd, Hq, 1, D]
        k_d = _gather_blocks(k_cache, batch.decode_blocks, batch.block_size).view(num_seqs, -1, hkv, d)
        v_d = _gather_blocks(v_cache, batch.decode_blocks, batch.block_size).view(num_seqs, -1, hkv, d)
        k_d, v_d = k_d.transpose(1, 2), v_d.transpose(1, 2)  # [Bd, Hkv, Lmax, D]
        o = F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=batch.decode_masks[window], enable_gqa=True)
        out[batch.decode_rows] = o.squeeze(2)
    for chunk in batch.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        q_p = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        mask = chunk.masks[window]
        if mask is None:  # the chunk is the whole context so far: attend to the fresh K/V
            k_p, v_p = k[rows], v[rows]
        else:
            k_p = k_cache.index_select(0, chunk.context_slots)  # [ctx, Hkv, D]
            v_p = v_cache.index_select(0, chunk.context_slots)
        o = F.scaled_dot_product_attention(q_p, k_p.transpose(0, 1).unsqueeze(0), v_p.transpose(0, 1).unsqueeze(0),
                                           attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [S, Hkv, D] viewed as blocks; block_tables [B, MB] -> [B * MB, block_size * Hkv * D].
    Whole blocks are copied as rows with index_select: several times faster on the CPU than
    advanced indexing slot by slot."""
    by_block = cache.view(cache.shape[0] // block_size, -1)
    return by_block.index_select(0, block_tables.flatten())
