"""The native (torch) backend: ``aclnnTopKTopPSample`` semantics, batched.

For each row b of logits [R, V] (SPEC §4, seeds/003):
1. top-k: valid when 1 <= top_k[b] <= min(V, top_k_limit); otherwise skipped for that row.
   Keep the k largest logits.
2. top-p: softmax over what top-k kept (the whole row when top-k was skipped), sort
   descending, drop a token when the mass before it exceeds top_p[b]; top_p[b] >= 1 skips.
3. exponential race: probs = softmax(kept logits); choose argmax(probs / (q + eps)), q ~ Exp(1).

Like the operator, top-p without top-k first tries the ``top_k_guess`` largest candidates
and fully sorts only the rows whose mass those do not cover. ``top_k_limit`` is 1024 for
the operator's exact skip rule; the engine passes the vocabulary size, so that a k in
(1024, V) keeps k tokens (docs/sampling.md).
"""

from __future__ import annotations

from typing import Callable

import torch

EPS = 1e-8
# noise_fn(rows [r] int64, token_ids [r, C] int64) -> q [r, C] float32
NoiseFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def top_k_top_p_sample(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: NoiseFn | None,
                       *, top_k_limit: int = 1024, top_k_guess: int = 32, eps: float = EPS) -> torch.Tensor:
    """Sample one token id per row. logits [R, V] float32 (not modified); top_k [R] int;
    top_p [R] float. ``noise=None`` skips the race: the result is the argmax. Returns [R] int64."""
    num_rows, vocab = logits.shape
    if noise is None:
        return logits.argmax(dim=-1)
    k_on = (top_k >= 1) & (top_k <= min(vocab, top_k_limit))
    p_on = top_p < 1.0
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)

    # Rows with top-k, or with top-p whose mass the guessed candidates may cover: one topk call.
    cand_rows = torch.nonzero(k_on | p_on).flatten()
    full_rows = torch.nonzero(~(k_on | p_on)).flatten()
    if cand_rows.numel():
        k_rows = top_k[cand_rows]
        width = int(torch.where(k_on[cand_rows], k_rows, top_k_guess).max().clamp(max=vocab))
        cand_logits, cand_ids = logits[cand_rows].topk(width, dim=-1)  # [r, C], sorted descending
        positions = torch.arange(width, device=logits.device)
        cand_logits = cand_logits.masked_fill(k_on[cand_rows, None] & (positions >= k_rows[:, None]), -float("inf"))
        # Top-p mass is relative to what top-k kept, or to the whole row when top-k is off.
        log_norm = torch.where(k_on[cand_rows], cand_logits.logsumexp(-1), logits[cand_rows].logsumexp(-1))
        probs = (cand_logits - log_norm[:, None]).exp()
        cumulative = probs.cumsum(-1)
        rows_p = top_p[cand_rows, None].to(probs.dtype)
        # Without top-k the guess must carry more than top_p, else every token past the
        # candidates could still be kept: those rows are redone with a full sort.
        covered = k_on[cand_rows] | (cumulative[:, -1] > rows_p[:, 0])
        drop = p_on[cand_rows, None] & ((cumulative - probs) > rows_p)
        cand_logits = cand_logits.masked_fill(drop, -float("inf"))
        done = torch.nonzero(covered).flatten()
        out[cand_rows[done]] = _race(cand_logits[done], cand_ids[done], cand_rows[done], noise, eps)
        uncovered = cand_rows[~covered]
        if uncovered.numel():
            out[uncovered] = _sorted_top_p_race(logits[uncovered], top_p[uncovered], uncovered, noise, eps)
    if full_rows.numel():
        ids = torch.arange(vocab, device=logits.device).expand(full_rows.numel(), vocab)
        out[full_rows] = _race(logits[full_rows], ids, full_rows, noise, eps)
    return out


def _sorted_top_p_race(logits: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor, noise: NoiseFn,
                       eps: float) -> torch.Tensor:
    """Top-p by a full descending sort (the operator's fallback when the guess fails)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [r, V]
    probs = sorted_logits.softmax(-1)
    drop = (probs.cumsum(-1) - probs) > top_p[:, None].to(probs.dtype)
    return _race(sorted_logits.masked_fill(drop, -float("inf")), sorted_ids, rows, noise, eps)


def _race(cand_logits: torch.Tensor, cand_ids: torch.Tensor, rows: torch.Tensor, noise: NoiseFn,
          eps: float) -> torch.Tensor:
    """argmax(probs / (q + eps)) over each row's candidates; returns the winners' token ids [r]."""
    probs = cand_logits.softmax(-1)  # [r, C]; dropped candidates have probability 0
    q = noise(rows, cand_ids)
    winner = (probs / (q + eps)).argmax(-1, keepdim=True)
    return cand_ids.gather(-1, winner).squeeze(-1)
