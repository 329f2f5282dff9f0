"""The native (torch) backend: ``aclnnTopKTopPSample`` semantics, batched.

For each row b of logits [R, V] (seeds/003, and torch_npu's reference of the operator):
1. top-k: valid when 1 <= top_k[b] <= min(V, top_k_limit); otherwise skipped for that row.
   Keep the k largest logits; ties go to the lowest token id (a stable descending sort).
2. top-p: softmax over what top-k kept (the whole row when top-k was skipped), sort
   descending (stable), drop a token when the mass before it exceeds top_p[b]; top_p[b] >= 1 skips.
3. exponential race: probs = softmax(kept logits); choose argmax(probs / (q + eps)), q ~ Exp(1).
   ``q`` is read in the order of the candidates: q[b, j] belongs to the j-th candidate of the
   sorted, truncated row (``logitsIdx``), and to token j when neither top-k nor top-p sorted it.

Like the operator, top-p without top-k first tries the ``top_k_guess`` largest candidates
and fully sorts only the rows whose mass those do not cover. ``top_k_limit`` is 1024 for
the operator's exact skip rule; the engine passes the vocabulary size, so that a k in
(1024, V) keeps k tokens (docs/sampling.md).
"""

from __future__ import annotations

from typing import Callable

import torch

EPS = 1e-8
# noise_fn(rows [r] int64, positions [C] int64) -> q [r, C] float32: the noise of each row's
# candidates 0..C-1, in candidate order (the operator's q[b, :C]).
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


def stable_top(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest of each row of ``logits`` [r, V], descending, equal values in
    ascending id order (as a stable descending sort lists them). Returns values, ids [r, width].

    ``torch.topk`` orders ties as it likes, so they are re-ordered here, only when some are
    among the candidates; which tied ids made the cut is the caller's check (``_cut_in_tie``)."""
    values, ids = logits.topk(width, dim=-1)
    if bool((values[:, 1:] == values[:, :-1]).any()):
        ids, by_id = ids.sort(dim=-1)
        values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, by_value)
    return values, ids


def _candidate_race(logits: torch.Tensor, rows: torch.Tensor, width: int, top_k: torch.Tensor, k_on: torch.Tensor,
                    top_p: torch.Tensor, p_on: torch.Tensor, noise: NoiseFn, eps: float) -> torch.Tensor:
    """Top-k, then top-p, on each row's ``width`` largest logits; rows whose top-p the
    candidates do not cover (top-p without top-k), or whose kept candidates tie with tokens
    past the window, are redone with a full stable sort."""
    row_logits = take_rows(logits, rows)
    cand_logits, cand_ids = stable_top(row_logits, width)  # [r, C]
    window_last = cand_logits[:, -1].clone()  # [r]: no token outside the window is larger
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
    exact = covered & ~_cut_in_tie(cand_logits, window_last, row_logits.shape[1])
    out = torch.empty(rows.numel(), dtype=torch.int64, device=logits.device)
    done = torch.nonzero(exact).flatten()
    out[done] = _race(cand_logits[done], cand_ids[done], rows[done], noise, eps)
    redo = torch.nonzero(~exact).flatten()
    if redo.numel():
        out[redo] = _sorted_race(row_logits[redo], top_k[redo], k_on[redo], top_p[redo], p_on[redo], rows[redo],
                                 noise, eps)
    return out


def _cut_in_tie(kept_logits: torch.Tensor, window_last: torch.Tensor, vocab: int) -> torch.Tensor:
    """[r] bool: rows whose last kept candidate has the value of the window's last one, so that a
    token outside the window with that value and a lower id could belong in its place.
    kept_logits [r, C]: the candidates, descending, those dropped at -inf; window_last [r]: the
    last candidate's value before anything was dropped."""
    width = kept_logits.shape[1]
    if width >= vocab:
        return torch.zeros(kept_logits.shape[0], dtype=torch.bool, device=kept_logits.device)
    kept = torch.isfinite(kept_logits)
    last_kept = kept_logits.gather(-1, (kept.sum(-1, keepdim=True) - 1).clamp_min(0))[:, 0]
    return torch.isfinite(last_kept) & (last_kept == window_last)


def take_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor[rows] without the copy when ``rows`` is every row (as nonzero() lists them)."""
    return tensor if rows.numel() == tensor.shape[0] else tensor[rows]


def _sorted_race(logits: torch.Tensor, top_k: torch.Tensor, k_on: torch.Tensor, top_p: torch.Tensor,
                 p_on: torch.Tensor, rows: torch.Tensor, noise: NoiseFn, eps: float) -> torch.Tensor:
    """Top-k and top-p by a full stable descending sort (the operator's fallback when the guess
    fails; here also for ties at the window's edge)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [r, V]
    positions = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(k_on[:, None] & (positions >= top_k[:, None]), -float("inf"))
    probs = sorted_logits.softmax(-1)
    drop = p_on[:, None] & ((probs.cumsum(-1) - probs) > top_p[:, None].to(probs.dtype))
    return _race(sorted_logits.masked_fill(drop, -float("inf")), sorted_ids, rows, noise, eps)


def _race(cand_logits: torch.Tensor, cand_ids: torch.Tensor, rows: torch.Tensor, noise: NoiseFn,
          eps: float) -> torch.Tensor:
    """argmax(probs / (q + eps)) over each row's candidates [r, C], q read in candidate order;
    returns the winners' token ids [r]."""
    probs = cand_logits.softmax(-1)  # [r, C]; dropped candidates have probability 0
    q = noise(rows, torch.arange(cand_logits.shape[1], device=cand_logits.device))
    winner = (probs / (q + eps)).argmax(-1, keepdim=True)
    return cand_ids.gather(-1, winner).squeeze(-1)
