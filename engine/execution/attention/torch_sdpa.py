"""The reference attention backend: torch's scaled_dot_product_attention over gathered blocks.

Decodes attend in one batched call over a padded copy of their blocks, [Bd, Hkv, Lmax, D]; each
prefill chunk in one call of its own, over its context gathered slot by slot (or, for a chunk
that is its whole context, over its fresh K/V). Masks are built once per step and shared by every
layer. Readable and runs anywhere; the other backends are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.execution.attention import AttentionSeq


@dataclass
class PrefillChunk:
    token_start: int  # first index of the chunk in the flat batch
    num_tokens: int
    context_slots: torch.Tensor  # [ctx] slots of positions 0..ctx-1, ctx = start_pos + num_tokens
    start_pos: int  # position of the chunk's first token in its sequence
    masks: dict[int | None, torch.Tensor | None]  # window -> [num_tokens, ctx] bool, None: plain causal


@dataclass
class SdpaStep:
    slot_mapping: torch.Tensor  # [N] slot each new token's K/V is written to
    decode_rows: torch.Tensor  # [Bd] indices of decode tokens in the flat batch
    decode_blocks: torch.Tensor  # [Bd, MB] block table per decoding sequence, 0-padded
    decode_masks: dict[int | None, torch.Tensor]  # window -> [Bd, 1, 1, MB * block_size] bool
    block_size: int
    prefills: list[PrefillChunk]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, window: int | None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D]; k_cache/v_cache [S, Hkv, D]. Returns [N, Hq, D]."""
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        out = torch.empty_like(q)
        if self.decode_rows.numel():
            num_seqs, hkv, d = self.decode_blocks.shape[0], k_cache.shape[1], k_cache.shape[2]
            q_d = q[self.decode_rows].unsqueeze(2)  # [Bd, Hq, 1, D]
            k_d = _gather_blocks(k_cache, self.decode_blocks, self.block_size).view(num_seqs, -1, hkv, d)
            v_d = _gather_blocks(v_cache, self.decode_blocks, self.block_size).view(num_seqs, -1, hkv, d)
            k_d, v_d = k_d.transpose(1, 2), v_d.transpose(1, 2)  # [Bd, Hkv, Lmax, D]
            o = F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=self.decode_masks[window], enable_gqa=True)
            out[self.decode_rows] = o.squeeze(2)
        self.attend_chunks(q, k, v, k_cache, v_cache, window, out)
        return out

    def attend_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, window: int | None, out: torch.Tensor) -> None:
        """The prefill chunks' rows of ``out``, their K/V already in the caches."""
        for chunk in self.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            q_p = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            mask = chunk.masks[window]
            if mask is None:  # the chunk is the whole context so far: attend to the fresh K/V
                k_p, v_p = k[rows], v[rows]
            else:
                k_p = k_cache.index_select(0, chunk.context_slots)  # [ctx, Hkv, D]
                v_p = v_cache.index_select(0, chunk.context_slots)
            o = F.scaled_dot_product_attention(q_p, k_p.transpose(0, 1).unsqueeze(0),
                                               v_p.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[rows] = o.squeeze(0).transpose(0, 1)


class SdpaBackend:
    name = "torch_sdpa"

    def prepare(self, slot_mapping: torch.Tensor, seqs: list[AttentionSeq], windows: set[int | None],
                block_size: int, device: torch.device) -> SdpaStep:
        decodes = [s for s in seqs if s.num_tokens == 1]
        max_blocks = max((len(s.block_table) for s in decodes), default=1)
        decode_blocks = torch.zeros(len(decodes), max_blocks, dtype=torch.int64)
        for i, s in enumerate(decodes):
            decode_blocks[i, : len(s.block_table)] = torch.tensor(s.block_table)
        key_pos = torch.arange(max_blocks * block_size)[None, :]  # [1, Lmax]
        query_pos = torch.tensor([s.start_pos for s in decodes], dtype=torch.int64)[:, None]  # [Bd, 1]
        decode_masks = {w: _window_mask(query_pos, key_pos, w)[:, None, None, :].to(device) for w in windows}

        chunks = []
        for s in seqs:
            if s.num_tokens == 1:
                continue
            n, start_pos = s.num_tokens, s.start_pos
            q_pos = torch.arange(start_pos, start_pos + n)[:, None]  # [n, 1]
            k_pos = torch.arange(start_pos + n)[None, :]  # [1, ctx]
            masks = {w: None if start_pos == 0 and (w is None or w >= n) else _window_mask(q_pos, k_pos, w).to(device)
                     for w in windows}
            table = torch.tensor(s.block_table, dtype=torch.int64)
            positions = torch.arange(start_pos + n)
            slots = table[positions // block_size] * block_size + positions % block_size
            chunks.append(PrefillChunk(s.flat_start, n, slots.to(device), start_pos, masks))
        return SdpaStep(
            slot_mapping=slot_mapping,
            decode_rows=torch.tensor([s.flat_start for s in decodes], dtype=torch.int64, device=device),
            decode_blocks=decode_blocks.to(device),
            decode_masks=decode_masks,
            block_size=block_size,
            prefills=chunks,
        )


BACKEND = SdpaBackend()


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key j is visible to query i when j <= i and, with a sliding window w, j > i - w."""
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [S, Hkv, D] viewed as blocks; block_tables [B, MB] -> [B * MB, block_size * Hkv * D].
    Whole blocks are copied as rows with index_select: several times faster on the CPU than
    advanced indexing slot by slot."""
    by_block = cache.view(cache.shape[0] // block_size, -1)
    return by_block.index_select(0, block_tables.flatten())
