"""The speculative-sampling rule for draft tokens that come with the draft model's probabilities.

For a row with target distribution p (the sampler's: processors, temperature, min-p, top-k,
top-p applied) and a draft token d drawn from q: keep d with probability min(1, p(d) / q(d));
otherwise draw from the residual max(0, p - q), normalised (Leviathan et al. 2023, Chen et
al. 2023). The token that comes out is distributed as p, whatever q is. The uniform of the
test and the residual's draw use the row's keyed noise (sampling/noise.py): reproducible for a
seed. A draft without probabilities is a point mass, and for it the rule is plain sampling
followed by a comparison, which the engine does (engine/decoding/speculative.py): this module serves
only rows with q.

A readable torch reference over the whole vocabulary, never on the hot path: the rows that
reach it are the ones whose caller sent ``draft_logits``.
"""

from __future__ import annotations

import torch

from sampling.noise import exponential_noise


def target_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [r, V] float32 (min-p already applied) -> the distribution the sampler draws from
    [r, V], with top-k and top-p as sampling/topk_topp.py applies them."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [r, V]; ties: lowest id first
    positions = torch.arange(vocab, device=logits.device)
    k_on = (top_k >= 1) & (top_k <= vocab)
    sorted_logits = sorted_logits.masked_fill(k_on[:, None] & (positions >= top_k[:, None]), -float("inf"))
    probs = sorted_logits.softmax(-1)
    drop = (top_p[:, None] < 1.0) & ((probs.cumsum(-1) - probs) > top_p[:, None])
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.empty_like(probs).scatter_(-1, order, probs)


def verify_drafts(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor, seed_lo: torch.Tensor,
                  seed_hi: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """p, q [r, V]; draft_tokens, seed_lo, seed_hi, step [r]. Returns [r] token ids: the draft
    where it is kept, else the residual's draw."""
    vocab = p.shape[1]
    rows = torch.arange(len(p), device=p.device)
    p_d, q_d = p[rows, draft_tokens], q[rows, draft_tokens]
    # The test's uniform: the keyed draw of an id no token has (V), so it is independent of the race's.
    uniform = torch.exp(-exponential_noise(seed_lo, seed_hi, step, torch.tensor([vocab], device=p.device)))[:, 0]
    keep = uniform * q_d < p_d  # u < p(d) / q(d), without dividing by a q(d) of 0
    residual = (p - q).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q: any rejection is p's draw
    race = exponential_noise(seed_lo, seed_hi, step, torch.arange(vocab, device=p.device))  # [r, V]
    drawn = (residual / race).argmax(-1)
    return torch.where(keep, draft_tokens, drawn)
