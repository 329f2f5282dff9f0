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


# torch.topk's cost grows with k (on a CPU, k = 1024 costs ~3x k = 64): rows are grouped
# so that rows needing few candidates do not pay for the row that needs the most.
SMALL_WIDTH = 64


def top_k_top_p_sample(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: NoiseFn | None,
                       *, top_k_limit: int = 1024, top_k_guess: int = 32, eps: float = EPS,
                       sample_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token id per row. logits [R, V] float32 (not modified); top_k [R] int;
    top_p [R] float. ``noise=None`` skips the race: the result is the argmax.
    ``sample_rows``: sample only these rows (default: all), without copying the others.
    Returns [len(sample_rows)] int64, in the order of ``sample_rows``."""
    num_rows, vocab = logits.shape
    if sample_rows is None:
        sample_rows = torch.arange(num_rows, device=logits.device)
    if noise is None:
        return take_rows(logits, sample_rows).argmax(dim=-1)
    k_on = (top_k >= 1) & (top_k <= min(vocab, top_k_limit))
    p_on = top_p < 1.0
    # Candidates each row needs: its k, or the guess for top-p alone; 0 = the whole row.
    width = torch.where(k_on, top_k, torch.where(p_on, min(top_k_guess, vocab), 0))[sample_rows]
    out = torch.empty(sample_rows.numel(), dtype=torch.int64, device=logits.device)
    for group in ((width > 0) & (width <= SMALL_WIDTH), width > SMALL_WIDTH):
        local = torch.nonzero(group).flatten()
        if local.numel():
            rows = sample_rows[local]
            out[local] = _candidate_race(logits, rows, int(width[local].max()), top_k[rows], k_on[rows],
                                         top_p[rows], p_on[rows], noise, eps)
    local = torch.nonzero(width == 0).flatten()
    if local.numel():
        rows = sample_rows[local]
        ids = torch.arange(vocab, device=logits.device).expand(rows.numel(), vocab)
        out[local] = _race(take_rows(logits, rows), ids, rows, noise, eps)
    return out


def _candidate_race(logits: torch.Tensor, rows: torch.Tensor, width: int, top_k: torch.Tensor, k_on: torch.Tensor,
                    top_p: torch.Tensor, p_on: torch.Tensor, noise: NoiseFn, eps: float) -> torch.Tensor:
    """Top-k, then top-p, on each row's ``width`` largest logits; rows whose top-p the
    candidates do not cover (top-p without top-k) are redone with a full sort."""
    row_logits = take_rows(logits, rows)
    cand_logits, cand_ids = row_logits.topk(width, dim=-1)  # [r, C], sorted descending
    positions = torch.arange(width, device=logits.device)
    cand_logits = cand_logits.masked_fill(k_on[:, None] & (positions >= top_k[:, None]), -float("inf"))
    # Top-p mass is relative to what top-k kept, or to the whole row when top-k is off.
    log_norm = cand_logits.logsumexp(-1)
    whole = torch.nonzero(~k_on).flatten()
    if whole.numel():
        log_norm[whole] = take_rows(row_logits, whole).logsumexp(-1)
    probs = (cand_logits - log_norm[:, None]).exp()
    cumulative = probs.cumsum(-1)
    p = top_p[:, None].to(probs.dtype)
    # Without top-k the candidates must carry more than top_p, else a token past them could
    # still be kept: those rows take the full sort.
    covered = k_on | (cumulative[:, -1] > p[:, 0])
    cand_logits = cand_logits.masked_fill(p_on[:, None] & ((cumulative - probs) > p), -float("inf"))
    out = torch.empty(rows.numel(), dtype=torch.int64, device=logits.device)
    done = torch.nonzero(covered).flatten()
    out[done] = _race(cand_logits[done], cand_ids[done], rows[done], noise, eps)
    uncovered = torch.nonzero(~covered).flatten()
    if uncovered.numel():
        out[uncovered] = _sorted_top_p_race(row_logits[uncovered], top_p[uncovered], rows[uncovered], noise, eps)
    return out


def take_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor[rows] without the copy when ``rows`` is every row (as nonzero() lists them)."""
    return tensor if rows.numel() == tensor.shape[0] else tensor[rows]


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
