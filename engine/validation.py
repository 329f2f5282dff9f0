"""A request's checks before it is queued: every reason it could never run, as a ValueError
whose message starts with the field's name (the dialects turn it into a 400 naming it).

``RequestValidator`` is built from the facts it reads (vocabulary, hidden size, LoRA shape,
limits, grammars, the KV layout D must import) and owns none of the engine's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig
from engine.kv_transfer import KVMeta, check_compatible
from engine.lora_adapter import LoraAdapter, ModelShape
from engine.outputs import PrefillResult
from engine.request import GenerationRequest, Mode
from sampling.grammar import GrammarCompiler


@dataclass(eq=False)
class RequestValidator:
    """What a request is checked against; it holds no state of its own."""

    config: EngineConfig
    vocab_size: int
    hidden_size: int
    lora_shape: ModelShape  # what an adapter must fit
    grammars: GrammarCompiler
    kv_meta: Callable[[int], KVMeta]  # kv_meta(n): this engine's KV layout for n tokens, what D imports
    max_model_len: int

    def check(self, request: GenerationRequest, mode: Mode = Mode.GENERATE,
              prefill: PrefillResult | None = None, lora: LoraAdapter | None = None) -> None:
        """Raise ValueError (message starting with the field's name) if the request can never run.
        ``lora``: the weights of the request's adapter (``request.lora`` names it)."""
        table = request.prompt_table
        prompt_ids_end = self.vocab_size + (table.size if table is not None else 0)  # p-tuning ids past the vocabulary
        drafts = request.draft.token_ids if request.draft is not None else []
        for name, ids, end in (("prompt_token_ids", request.prompt_token_ids, prompt_ids_end),
                               ("parameters", request.params.token_ids_in_use(), self.vocab_size),
                               ("resumed_output_ids", request.resumed_output_ids, self.vocab_size),
                               ("draft_input_ids", drafts, self.vocab_size)):
            bad = [t for t in ids if not 0 <= t < end]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {end})")
        if table is not None:
            hidden = self.hidden_size
            if table.embeddings.ndim != 2 or table.embeddings.shape[1] != hidden:
                raise ValueError(f"prompt_embedding_table: shape {list(table.embeddings.shape)}, this model needs "
                                 f"[prompt_vocab_size, {hidden}]")
            if request.params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs: a prompt with p-tuning ids has no token to score at those ids")
        if request.draft is not None:
            self._check_drafts(request)
        if (request.lora is None) != (lora is None) or lora is not None and lora.ref != request.lora:
            raise ValueError("lora: the engine must be given the weights of the adapter the request names")
        if lora is not None:
            lora.check(self.lora_shape, self.config.max_lora_rank)
        if request.prompt_lookup and (request.params.beam_width > 1 or request.params.grammar is not None):
            raise ValueError("prompt_lookup: beam search and grammars (response_format, tools) run without drafts")
        if len(request.resumed_output_ids) >= request.params.max_new_tokens:
            raise ValueError("resumed_output_ids: the request already has max_new_tokens tokens")
        if request.params.grammar is not None:
            self.grammars.check(request.params.grammar)  # compiled here, on the caller's thread, once per digest
        n = request.num_context_tokens  # what P computes, D imports
        if n >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: {n} tokens leave no room to generate within the maximum "
                             f"length of {self.max_model_len} (the model's, or the KV pool's)")
        if mode is Mode.DECODE:
            if prefill is None or not prefill.choices:
                raise ValueError("prefill: decode needs the prefill result with at least one choice")
            check_compatible(prefill.kv.meta, self.kv_meta(n), n)
            bound = max(request.n, request.params.beam_width)  # P's running beams come as choices
            bad = [c.index for c in prefill.choices if not 0 <= c.index < bound]
            if bad:
                raise ValueError(f"prefill.choices: choice {bad[0]} is outside [0, {bound})")
        if request.params.beam_width > 1 and (request.n != 1 or request.resumed_output_ids):
            raise ValueError("beam_width: beam search runs one choice (n=1) and is never resumed")

    def _check_drafts(self, request: GenerationRequest) -> None:
        """The draft tokens (and logits) a client sent to be verified (engine/decoding/draft_steps.py)."""
        draft, limit = request.draft, self.config.max_draft_tokens
        if len(draft.token_ids) > limit:
            raise ValueError(f"draft_input_ids: {len(draft.token_ids)} draft tokens, at most {limit} here "
                             "(max_draft_tokens)")
        if request.params.beam_width > 1 or request.params.grammar is not None:
            raise ValueError("draft_input_ids: beam search and grammars run without drafts")
        if draft.logits is not None:
            if draft.logits.shape[1] != self.vocab_size:
                raise ValueError(f"draft_logits: shape {list(draft.logits.shape)}, this model needs "
                                 f"[draft tokens, {self.vocab_size}]")
            if not np.isfinite(draft.logits).all():
                raise ValueError("draft_logits: values must be finite")
