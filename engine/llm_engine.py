"""The engine: requests in, token outputs out, one model forward per ``step``.

    batch = scheduler.schedule()          # the scheduler decides
    result = runner.run(batch, rows)      # the runner owns the device
    outputs = self._postprocess(...)      # tokens, stop conditions, text, finished requests

Three modes share the loop (engine/request.py ``Mode``): GENERATE runs a request to the
end; PREFILL stops after the first token and returns the prompt's KV; DECODE starts from
that KV and the first token. Deadlines are checked before every step.

A request with n choices runs as one sequence until its prompt is computed; then its choices
fork from it (blocks shared, the partial tail copied on write): one prefill for all n, and in
PD one KV transfer. Their first tokens are sampled together from the prompt's last logits,
each with its own seed (``sampling.params.choice_seed``).

A decoding sequence may verify draft tokens in its step (engine/decoding/draft_steps.py), and a request
may run with a LoRA adapter (engine/lora_adapter.py) in the same steps as requests without one.

This file keeps the loop; its other jobs are mixins beside it: a request's checks
(engine/validation.py), PREFILL's hand-over to D (engine/prefill_handover.py), beams and drafts
(engine/decoding/), and the synchronous runs of tests and benchmarks (engine/offline.py).
"""

from __future__ import annotations

import itertools
import logging
import random
import time

import numpy as np
import torch

from engine.block_manager import BlockCounts, BlockManager
from engine.config import EngineConfig
from engine.decoding.beam_search import BeamGroup
from engine.decoding.beam_steps import BeamSteps
from engine.decoding.draft_steps import DraftSteps
from engine.decoding.speculative import Drafter
from engine.detokenizer import IncrementalDetokenizer
from engine.execution.loader import load_model
from engine.lora_adapter import LoraAdapter, ModelShape
from engine.execution.model_runner import ModelRunner, StepResult, kv_pool_blocks
from engine.kv_transfer import KVPayload
from engine.offline import OfflineRuns
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, PrefillResult, RequestOutput, Sampled, TokenLogprob
from engine.prefill_handover import PrefillHandOver
from engine.prefix_holds import PrefixHolds
from engine.request import GenerationRequest, Mode, PendingChoice, Sequence, SequenceStatus
from engine.scheduler import ScheduledBatch, Scheduler
from engine.validation import RequestValidation
from sampling import SamplerOutput, SamplingParams, SamplingRow
from sampling.grammar import GrammarCompiler, GrammarDeadEnd, Matcher, MatcherState
from sampling.params import MAX_SEED, choice_seed

logger = logging.getLogger(__name__)


class LLMEngine(RequestValidation, PrefillHandOver, BeamSteps, DraftSteps, OfflineRuns):
    def __init__(self, config: EngineConfig) -> None:
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.loaded = load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.spec.vocab_size
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None and pad < self.vocab_size else self.loaded.eos_token_ids[0]
        self.dtype = str(self.loaded.dtype).removeprefix("torch.")
        self.blocks = BlockManager(kv_pool_blocks(config, self.loaded), config.block_size,
                                   config.enable_prefix_caching)
        # A request can never hold more KV than the whole pool: past that it would preempt itself forever.
        self.max_model_len = min(self.loaded.max_model_len, self.blocks.num_blocks * config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.holds = PrefixHolds(self.blocks)
        self.runner = ModelRunner(self.loaded, self.blocks, config)
        self.runner.warm_up(config.max_num_batched_tokens)
        self.drafter = Drafter(config)
        self._kv_namespace = f"{self.loaded.model_id}:{self.dtype}".encode()
        self._seqs: dict[tuple[str, int], Sequence] = {}
        self._detokenizers: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self.lora_shape = ModelShape.of(self.loaded.spec)  # what an adapter must fit
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.loaded.eos_token_ids)
        self._matchers: dict[tuple[str, int], MatcherState] = {}  # per constrained choice, made on first use
        self._arrivals = itertools.count()
        self._kv_wanted: list[str] = []  # requests admitted into RECEIVING since last asked (take_kv_wanted)
        self._beams: dict[str, BeamGroup] = {}  # requests searching with beams, by id
        logger.info("engine ready: model %s, dtype %s (asked: %s), %d KV blocks of %d tokens, prefix caching %s, "
                    "attention %s, batch invariance %s", self.loaded.path, self.dtype, config.dtype,
                    self.blocks.num_blocks, config.block_size, "on" if config.enable_prefix_caching else "off",
                    self.runner.attention.name, "on" if self.runner.batch_invariant else "off")

    # ---- requests in -------------------------------------------------------------------

    def add_request(self, request: GenerationRequest, mode: Mode = Mode.GENERATE,
                    prefill: PrefillResult | None = None, kv_export_start: int = 0,
                    lora: LoraAdapter | None = None) -> None:
        """Queue a request. PREFILL mode exports the prompt's KV from token ``kv_export_start``
        on (the decode side holds the tokens before it). DECODE mode imports ``prefill.kv``; if
        its data is None, the request waits for it with its blocks held (``take_kv_wanted``,
        ``receive_kv``). ``lora``: the weights of the adapter ``request.lora`` names."""
        self.validate(request, mode, prefill, lora)
        if request.request_id in {rid for rid, _ in self._seqs}:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        deadline = request.deadline or time.time() + self.config.default_timeout_s
        if mode is Mode.DECODE:
            choices = [PendingChoice(c.index, c.seed, c.first_token_id,
                                     c.first_logprob.logprob if c.first_logprob else None) for c in prefill.choices]
        else:
            choices = [PendingChoice(j, choice_seed(request.params.seed, j) or random.randint(1, MAX_SEED))
                       for j in range(request.n)]
        seq = Sequence(request, choices[0].seed, next(self._arrivals), mode, deadline, self._kv_namespace,
                       choices[0].index, lora)
        seq.pending_choices = choices[1:]
        seq.kv_export_start = kv_export_start
        if mode is Mode.DECODE:
            seq.pending_kv = prefill.kv
            self._start_from_first_token(seq, choices[0])
        else:
            self._add_detokenizer(seq)
        self._seqs[seq.key] = seq
        if request.params.beam_width > 1:
            self._beams[request.request_id] = self._beam_group(seq, prefill)
        self.scheduler.add(seq)

    def hold_prefix(self, request: GenerationRequest, lora: LoraAdapter | None, until: float) -> int:
        """D, before P works: how many leading tokens of ``request``'s prompt (and resumed output)
        this engine's prefix cache holds, the token P's KV may begin at (``kv_export_start``).
        Their blocks are held for the request until it ends, or until ``until`` if it does not
        come (engine/prefix_holds.py)."""
        self.validate(request, lora=lora)
        probe = Sequence(request, 0, -1, Mode.DECODE, until, self._kv_namespace, 0, lora)
        probe.token_ids.append(0)  # as D admits it: with P's first token, so the last prompt block can hit
        hits = self.blocks.computed_prefix(probe)
        self.holds.hold(request.request_id, hits, until)
        return len(hits) * self.config.block_size

    def take_kv_wanted(self) -> list[str]:
        """The requests admitted since the last call whose KV bytes must now be fetched (DECODE
        requests added with ``prefill.kv.data`` None: their blocks are held for it)."""
        wanted, self._kv_wanted = self._kv_wanted, []
        return wanted

    def receive_kv(self, request_id: str, data) -> bool:
        """A receiving request's KV bytes [L, 2, T, Hkv, D] have arrived: it runs from the next
        step. False if the request is not waiting for them (it ended meanwhile)."""
        for seq in self.scheduler.receiving:
            if seq.request_id == request_id:
                seq.pending_kv = KVPayload(seq.pending_kv.meta, data)
                self.scheduler.kv_arrived(seq)
                return True
        return False

    def _add_detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        detok = self._detokenizers[seq.key] = self._detokenizer(seq)
        return detok

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        """A detokenizer that has seen seq's output so far (a resumed request's earlier tokens,
        whose text the client has): its held-back text and stop-string state go on from there."""
        p = seq.params
        detok = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens, p.include_stop_str_in_output)
        for token in seq.output_ids:
            detok.add(token)
        return detok

    def _start_from_first_token(self, seq: Sequence, choice: PendingChoice) -> None:
        """DECODE mode: the choice's first token came from P, whose text P already released."""
        detok = self._add_detokenizer(seq)
        seq.token_ids.append(choice.first_token_id)
        seq.first_token_time = seq.arrival_time
        if choice.first_logprob is not None:
            seq.cumulative_logprob += choice.first_logprob
        detok.add(choice.first_token_id)

    def abort(self, request_id: str, reason: str = ABORT) -> list[RequestOutput]:
        """End every choice of a request wherever it is and free its blocks, and its prefix hold;
        [] if it is not here."""
        outputs = [out for seq in self._choices(request_id) for out in self._finish(seq, reason, [], "", [])]
        self.holds.drop(request_id)
        return outputs

    def _choices(self, request_id: str) -> list[Sequence]:
        return [seq for (rid, _), seq in self._seqs.items() if rid == request_id]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def active_request_ids(self) -> list[str]:
        return list(dict.fromkeys(rid for rid, _ in self._seqs))

    def block_counts(self) -> BlockCounts:
        """Blocks held, cached (evictable) and free: every block is one of them."""
        return self.blocks.counts()

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._expire(time.time())
        self._propose_drafts()
        batch = self.scheduler.schedule()
        self._kv_wanted += [seq.request_id for seq in batch.kv_wanted]
        for seq, why in batch.unservable:
            outputs += self._finish(seq, ABORT, [], "", [], error=why)
        if batch.entries:
            rows, repeats = [], []
            for (seq, _), samples, drafted in zip(batch.entries, batch.sampling, batch.drafted):
                if drafted:
                    rows += self._draft_rows(seq, drafted)
                    repeats.append(drafted + 1)
                    continue
                choices = self._sampled_choices(seq) if samples else []
                # Choices not forked yet stand where seq stands (no output): they share its mask.
                bitmask = self._grammar_bitmask(seq) if choices and seq.params.grammar else None
                rows += [self._sampling_row(seq, c.seed, bitmask) for c in choices]
                repeats.append(len(choices))
            result = self.runner.run(batch, rows, repeats)
            accepted = self._accepted_drafts(batch, result, repeats)
            for scores in result.prompt_scores:
                scores.seq.prompt_logprobs[scores.first:scores.first + len(scores.entries)] = scores.entries
            for kept in result.context_logits:  # by position: a preempted prompt's rows come again
                seq = kept.seq
                if seq.context_logits is None:
                    seq.context_logits = torch.empty(seq.num_prompt_tokens, kept.logits.shape[1])
                seq.context_logits[kept.first:kept.first + len(kept.logits)] = kept.logits
            self.scheduler.commit(batch, [k - a for k, a in zip(batch.drafted, accepted)])
            outputs += self._postprocess(batch, result, repeats, accepted)
        return outputs

    def _sampled_choices(self, seq: Sequence) -> list[PendingChoice]:
        """The choices whose next token this sequence's last logits give: its own, and at the
        prompt's end the choices still to fork whose first token is not known yet."""
        own = PendingChoice(seq.index, seq.seed)
        return [own] + [c for c in seq.pending_choices if c.first_token_id is None]

    def _expire(self, now: float) -> list[RequestOutput]:
        self.holds.expire(now, lambda request_id: bool(self._choices(request_id)))
        expired = [seq for seq in self._seqs.values() if now >= seq.deadline]
        return [out for seq in expired for out in self._finish(seq, TIMEOUT, [], "", [])]

    def _sampling_row(self, seq: Sequence, seed: int, bitmask: torch.Tensor | None = None) -> SamplingRow:
        prompt = seq.prompt_ids
        if seq.prompt_table is not None:  # penalties see the prompt's real tokens (transformers: none with embeds)
            prompt = [t for t in prompt if t < self.vocab_size]
        return SamplingRow(seq.params, seed, prompt, seq.output_ids, self._eos_ids(seq.params), bitmask)

    def _grammar_bitmask(self, seq: Sequence) -> torch.Tensor:
        """[W] int32: the tokens seq's grammar allows next."""
        return self.grammars.bitmask(self._matcher(seq))

    def _grammar_complete(self, seq: Sequence) -> bool:
        """Whether seq's grammar is complete after its output so far: nothing but EOS may follow."""
        return seq.params.grammar is not None and self._matcher(seq).is_stopped()

    def _matcher(self, seq: Sequence) -> Matcher:
        """seq's grammar matcher, advanced over its whole output. It is made on first use from the
        output so far, which covers D after P's first token and a choice after its fork."""
        entry = self._matchers.get(seq.key)
        if entry is None:
            entry = self._matchers[seq.key] = MatcherState(self.grammars.matcher(seq.params.grammar, []))
        new = seq.output_ids[entry.consumed:]
        if new and not entry.matcher.consume_tokens(new):  # the mask allowed them: only a bug gets here
            raise GrammarDeadEnd(f"grammar: the matcher refused tokens {new}: {entry.matcher.get_error()}")
        entry.consumed += len(new)
        return entry.matcher

    def _eos_ids(self, params: SamplingParams) -> list[int]:
        """The request's end id (TensorRT-LLM's end_id), else the model's EOS ids."""
        return [params.eos_token_id] if params.eos_token_id is not None else self.loaded.eos_token_ids

    def _postprocess(self, batch: ScheduledBatch, result: StepResult, repeats: list[int],
                     accepted: list[int]) -> list[RequestOutput]:
        outputs, row = [], 0
        stepped: dict[str, BeamGroup] = {}
        for (seq, _), repeat, drafted, standing in zip(batch.entries, repeats, batch.drafted, accepted):
            if not repeat:
                continue
            group = self._beams.get(seq.request_id)
            if group is not None:  # a beam reports its next-token logits; the group decides once all have
                if seq.pending_choices:  # DECODE: P's other beams start now that the prompt's KV is in
                    outputs += self._fork_choices(seq, [])
                group.reported[seq.index] = result.sample_logits[row]
                stepped[seq.request_id] = group
                row += repeat
                continue
            tokens = [Sampled(result.sampled.token_ids[r], self._logprob(result.sampled, r),
                              self._generation_logits(seq, result, r)) for r in range(row, row + repeat)]
            row += repeat
            if seq.mode is Mode.PREFILL:
                outputs += self._hand_over(seq, list(zip(self._sampled_choices(seq), tokens)))
                continue
            if drafted:  # the drafts that stand and the token after them, one output each, until one ends it
                for token in tokens[:standing + 1]:
                    outputs += self._append_token(seq, token)
                    if seq.status is SequenceStatus.FINISHED:
                        break
                continue
            if seq.pending_choices:
                outputs += self._fork_choices(seq, tokens[1:])
            outputs += self._append_token(seq, tokens[0])
        for group in stepped.values():
            if group.all_reported():
                outputs += self._advance_beams(group)
        return outputs

    @staticmethod
    def _generation_logits(seq: Sequence, result: StepResult, row: int) -> np.ndarray | None:
        """[1, V] float32: row's raw logits, when seq's request asked for them."""
        if not seq.params.return_generation_logits:
            return None
        return result.sample_logits[row:row + 1].numpy().copy()  # not a view that keeps the step's [R, V] alive

    @staticmethod
    def _logprob(sampled: SamplerOutput, row: int) -> TokenLogprob | None:
        if sampled.logprobs[row] is None:
            return None
        return TokenLogprob(sampled.token_ids[row], sampled.logprobs[row], sampled.top_logprobs[row])

    def _fork_choices(self, seq: Sequence, sampled: list[Sampled]) -> list[RequestOutput]:
        """The prompt is computed: start the request's other choices, sharing its blocks. Their
        first tokens are ``sampled`` (GENERATE) or came from P (DECODE)."""
        choices, seq.pending_choices = seq.pending_choices, []
        outputs = []
        group = self._beams.get(seq.request_id)
        for choice, token in itertools.zip_longest(choices, sampled):
            child = self.scheduler.fork(seq, choice)
            self._seqs[child.key] = child
            if group is not None:  # DECODE: one of P's beams
                group.beams.append(child)
                group.token_logprobs[child.index] = [choice.first_logprob]
                if group.token_logits is not None:
                    group.token_logits[child.index] = list(group.token_logits[seq.index])
            if token is None:  # DECODE: continues after P's first token
                self._start_from_first_token(child, choice)
            else:
                self._add_detokenizer(child)
                outputs += self._append_token(child, token)
        return outputs

    def _append_token(self, seq: Sequence, sampled: Sampled) -> list[RequestOutput]:
        token, logprob = sampled.token_id, sampled.logprob
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.time()
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
        logprobs = [logprob] if logprob else []
        text, stopped = self._detokenizers[seq.key].add(token)
        try:
            complete = self._grammar_complete(seq)
        except GrammarDeadEnd as error:
            return self._finish(seq, ABORT, [token], text, logprobs, error=str(error), logits=sampled.logits)
        reason = self._finish_reason(seq, token, complete or stopped)
        if reason is not None:
            return self._finish(seq, reason, [token], text, logprobs, logits=sampled.logits)
        return [self._output(seq, [token], text, logprobs, finished=False, logits=sampled.logits)]

    def _finish_reason(self, seq: Sequence, token: int, stopped: bool) -> str | None:
        """``stopped``: a stop string ended the text, or the grammar is complete."""
        p = seq.params
        if not p.ignore_eos and token in self._eos_ids(p):
            return EOS
        if stopped or (p.stop_token_ids and any(seq.output_ids[-len(s):] == s for s in p.stop_token_ids)):
            return STOP
        if seq.num_output_tokens >= p.max_new_tokens or self._capped_tokens(seq) >= self.config.max_iter_times:
            return LENGTH
        if seq.num_tokens >= self.max_model_len:
            return LENGTH
        return None

    def _capped_tokens(self, seq: Sequence) -> int:
        """The output tokens of ``seq`` that the server cap (max_iter_times) counts: on D, the
        first is P's (MindIE counts P's and D's tokens)."""
        decode_side = seq.mode is Mode.DECODE or self.config.first_token_from_prefill
        return seq.num_output_tokens - (1 if decode_side and seq.num_output_tokens else 0)

    def _finish(self, seq: Sequence, reason: str, tokens: list[int], text: str,
                logprobs: list[TokenLogprob], error: str | None = None,
                logits: np.ndarray | None = None) -> list[RequestOutput]:
        """End ``seq`` (and its choices still to fork, which end with it); a beam ends its whole search."""
        group = self._beams.get(seq.request_id)
        if group is not None:
            return self._end_beams(group, reason, error)
        if seq.key not in self._seqs:  # a beam whose search ended a moment ago
            return []
        outputs = [self._end_unforked(seq, choice, reason, error) for choice in seq.pending_choices]
        seq.finish_reason = reason
        detok = self._detokenizers[seq.key]
        text += detok.finish()
        output = self._output(seq, tokens, text, logprobs, finished=True, logits=logits)
        output.output_token_ids = seq.output_ids
        output.text = detok.text
        output.error = error
        self._release(seq)
        return outputs + [output]

    def _end_unforked(self, seq: Sequence, choice: PendingChoice, reason: str, error: str | None) -> RequestOutput:
        """The final output of a choice that never forked (its request ended before the prompt did)."""
        tokens = [choice.first_token_id] if choice.first_token_id is not None else []
        text = self.tokenizer.decode(tokens, skip_special_tokens=seq.params.skip_special_tokens) if tokens else ""
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="",
                             num_output_tokens=len(tokens), finished=True, finish_reason=reason, seed=choice.seed,
                             first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
                             scheduled_time=seq.scheduled_time, error=error,
                             output_token_ids=tokens, text=text, index=choice.index)

    def _release(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.pending_choices = []
        self.scheduler.remove(seq)
        del self._seqs[seq.key]
        self._detokenizers.pop(seq.key, None)  # beams after the first have none: text is made at the end
        self._matchers.pop(seq.key, None)
        if seq.request_id in self.holds and not self._choices(seq.request_id):
            self.holds.drop(seq.request_id)

    def _output(self, seq: Sequence, tokens: list[int], text: str, logprobs: list[TokenLogprob],
                finished: bool, logits: np.ndarray | None = None) -> RequestOutput:
        wants_logprobs = seq.params.logprobs is not None
        first_token = bool(tokens) and seq.num_output_tokens == 1
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=tokens, new_text=text, num_output_tokens=seq.num_output_tokens,
            finished=finished, finish_reason=seq.finish_reason, seed=seq.seed, logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            first_token_time=seq.first_token_time, arrival_time=seq.arrival_time,
            scheduled_time=seq.scheduled_time, index=seq.index,
            prompt_logprobs=seq.prompt_logprobs if first_token else None,
            context_logits=self._context_logits(seq) if first_token else None, generation_logits=logits)

    @staticmethod
    def _context_logits(seq: Sequence) -> np.ndarray | None:
        return seq.context_logits.numpy() if seq.context_logits is not None else None

