"""The engine: requests in, token outputs out, one model forward per ``step``.

    batch = scheduler.schedule()          # the scheduler decides
    result = runner.run(batch, rows)      # the runner owns the device
    outputs = self._postprocess(...)      # the output processor: tokens, stops, text, finished requests

Three modes share the loop (engine/request.py ``Mode``): GENERATE runs a request to the
end; PREFILL stops after the first token and returns the prompt's KV; DECODE starts from
that KV and the first token. Deadlines are checked before every step.

A request with n choices runs as one sequence until its prompt is computed; then its choices
fork from it (blocks shared, the partial tail copied on write): one prefill for all n, and in
PD one KV transfer. Their first tokens are sampled together from the prompt's last logits,
each with its own seed (``sampling.params.choice_seed``).

A decoding sequence may verify draft tokens in its step, and a request may run with a LoRA
adapter (engine/lora_adapter.py) in the same steps as requests without one.

This file keeps the loop and the one registry of running sequences (``_seqs``); the loop
composes parts, each owning its state and built with what it reads: ``validator``
(engine/validation.py), ``scheduler``, ``runner`` (the device), ``output_processor``
(engine/output_processor.py: tokens, text, stop checks, outputs, PREFILL's hand-over to D), and
the decoding strategies ``beam_search`` and ``drafts`` (engine/decoding/). The synchronous runs
of tests, benchmarks and the CLI are engine/offline.py's functions, with one-line methods here
for their callers.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import weakref

import numpy as np
import torch

from engine import offline, running_export
from engine.block_manager import BlockCounts, BlockManager
from engine.config import EngineConfig
from engine.decoding.beam_steps import BeamSearch
from engine.decoding.draft_steps import DraftVerification
from engine.decoding.speculative import Drafter
from engine.execution.loader import load_model
from engine.execution.model_runner import ModelRunner, StepResult, kv_pool_blocks, kv_tier
from engine.execution.persistent_batch import PersistentBatch
from engine.kv_transfer import KVPayload
from engine.lora_adapter import LoraAdapter, ModelShape
from engine.output_processor import UNDECIDED, OutputProcessor, sampled_tokens
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, PrefillResult, RequestOutput, Sampled
from engine.prefix_holds import PrefixHolds
from engine.request import GenerationRequest, Mode, PendingChoice, Sequence, SequenceStatus
from engine.running_export import Moved
from engine.scheduler import ScheduledBatch, Scheduler
from engine.validation import RequestValidator
from sampling import SamplingRow
from sampling.grammar import GrammarCompiler
from sampling.params import MAX_SEED, choice_seed

logger = logging.getLogger(__name__)

# A decode step of fewer rows decides its ends row by row (``append_token``): the batch's stop
# arrays cost ~30 numpy calls whatever the rows (~50 µs, a tenth of a one-row step on the CPU
# proxy), a row's own checks ~1 µs more per row than the arrays'; the two meet near 16 rows
# (docs/architecture.md, the persistent batch).
ARRAY_STOPS_MIN_ROWS = 16
# A decode step's verdict per row by its stop code: none, EOS, a stop id, a length cap, decided row by row.
VERDICTS = np.array([None, EOS, STOP, LENGTH, UNDECIDED], dtype=object)


class LLMEngine:
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
                                   config.enable_prefix_caching, kv_tier(config, self.loaded))
        # A request can never hold more KV than the whole pool: past that it would preempt itself forever.
        self.max_model_len = min(self.loaded.max_model_len, self.blocks.num_blocks * config.block_size)
        # The running rows' columns (engine/execution/persistent_batch.py): the scheduler joins and
        # leaves them, the output processor appends tokens, the runner reads a decode step from them.
        self.rows = PersistentBatch(config.max_num_seqs, self.blocks.blocks_for(self.max_model_len), self.vocab_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.rows)
        self.holds = PrefixHolds(self.blocks)
        self.runner = ModelRunner(self.loaded, self.blocks, config, self.rows)
        self.runner.warm_up(config.max_num_batched_tokens)
        self.lora_shape = ModelShape.of(self.loaded.spec)  # what an adapter must fit
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.loaded.eos_token_ids)
        self.validator = RequestValidator(config, self.vocab_size, self.loaded.spec.hidden_size, self.lora_shape,
                                          self.grammars, self.runner.kv_meta, self.max_model_len)
        # The parts call back into the engine through weak methods: a bound method would be a cycle
        # (engine -> part -> engine) that only the cyclic collector frees, KV pool and weights with it.
        release, register, sampling_row = (_weak(m) for m in (self._release, self._register, self._sampling_row))
        self.output_processor = OutputProcessor(self.tokenizer, self.grammars, config, self.max_model_len,
                                                self.loaded.eos_token_ids, self.runner, release, self.rows)
        self.beam_search = BeamSearch(self.scheduler, register, release, self.output_processor,
                                      self.tokenizer, config, self.max_model_len)
        self.drafts = DraftVerification(config, self.max_model_len, sampling_row,
                                        self.output_processor.capped_tokens)
        self._kv_namespace = f"{self.loaded.model_id}:{self.dtype}".encode()
        self._seqs: dict[tuple[str, int], Sequence] = {}  # every running sequence, by (request id, choice index)
        # The keys of those whose decode-like step takes the per-row path whatever their columns: PREFILL's
        # (the step hands over to D) and those with choices still to fork. Mostly none: no look per row then.
        self._apart: set[tuple[str, int]] = set()
        self._arrivals = itertools.count()
        self._kv_wanted: list[str] = []  # requests admitted into RECEIVING since last asked (take_kv_wanted)
        logger.info("engine ready: model %s, dtype %s (asked: %s), %d KV blocks of %d tokens, prefix caching %s, "
                    "attention %s, batch invariance %s", self.loaded.path, self.dtype, config.dtype,
                    self.blocks.num_blocks, config.block_size, "on" if config.enable_prefix_caching else "off",
                    self.runner.attention.name, "on" if self.runner.batch_invariant else "off")

    @property
    def drafter(self) -> Drafter:
        """The drafter the draft verification proposes with (its counts feed the metrics)."""
        return self.drafts.drafter

    # ---- requests in -------------------------------------------------------------------

    def validate(self, request: GenerationRequest, mode: Mode = Mode.GENERATE,
                 prefill: PrefillResult | None = None, lora: LoraAdapter | None = None) -> None:
        """Raise ValueError naming the field if the request can never run (engine/validation.py)."""
        self.validator.check(request, mode, prefill, lora)

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
        seq.eos_token_ids = self.output_processor.eos_ids(request.params)
        seq.decode_side = mode is Mode.DECODE or self.config.first_token_from_prefill
        if mode is Mode.DECODE:
            seq.pending_kv = prefill.kv
            self.output_processor.start_from_first_token(seq, choices[0])
        else:
            self.output_processor.start(seq)
        self._register(seq)
        if request.params.beam_width > 1:
            self.beam_search.start(seq, prefill)
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

    def prefix_keys(self, request: GenerationRequest, lora: LoraAdapter | None = None) -> list[bytes]:
        """The content keys of ``request``'s full context blocks (BlockManager.block_hashes: the
        model, dtype, prompt table and adapter in their namespace): what the app's prefix store
        (engine/prefix_store.py) is asked and published under. Reads no engine state: any thread."""
        probe = Sequence(request, 0, -1, Mode.PREFILL, 0.0, self._kv_namespace, 0, lora)
        return self.blocks.block_hashes(probe, probe.num_tokens // self.config.block_size)

    def import_prefix(self, request_id: str, keys: list[bytes], first: int, data, until: float) -> int:
        """Blocks brought from the prefix store for a request about to be added: ``data``
        [L, 2, (len(keys) - first) * block_size, Hkv, D] is the KV of ``keys[first:]``, the pool's
        own blocks are expected to hold ``keys[:first]``. The blocks this pool lacks are written and
        keyed, and the whole chain is held for ``request_id`` until it ends (or ``until`` if it does
        not come: engine/prefix_holds.py), so its admission finds them as prefix hits. Returns the
        blocks written: 0 when the pool's own chain no longer reaches ``first`` (evicted meanwhile:
        the request computes them) or already holds them all."""
        local = self.blocks.chain_blocks(keys)
        self.blocks.hold(local)  # not evicted by the blocks taken below
        written = []
        if first <= len(local) < len(keys):
            written = self.blocks.adopt(keys[len(local):])
            offset = (len(local) - first) * self.config.block_size
            self.runner.write_blocks(written, data[:, :, offset:offset + len(written) * self.config.block_size])
        self.holds.hold(request_id, local + written, until)
        self.blocks.release(local + written)  # the hold keeps its own reference
        return len(written)

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

    def abort(self, request_id: str, reason: str = ABORT) -> list[RequestOutput]:
        """End every choice of a request wherever it is and free its blocks, and its prefix hold;
        [] if it is not here."""
        outputs = [out for seq in self._choices(request_id) for out in self._end(seq, reason)]
        self.holds.drop(request_id)
        return outputs

    def move_out(self, request_id: str) -> Moved | None:
        """Hand a running request to another engine (engine/running_export.py): each choice's tokens,
        sampler state and KV copied out, then its blocks freed and its prefix hold dropped, with no
        output (the caller's stream ends with the ``Moved``). None, and nothing changes, while it
        cannot move (waiting, receiving its KV, forking, beam search) or is not here."""
        seqs = self._choices(request_id)
        if not running_export.movable(seqs, self.beam_search.searching(request_id)):
            return None
        moved = Moved(request_id, [running_export.export_choice(seq, self.runner) for seq in seqs])
        for seq in seqs:
            self._release(seq)  # the last one drops the request's prefix hold
        return moved

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
        self.drafts.propose(self._seqs.values())
        batch = self.scheduler.schedule()
        self._kv_wanted += [seq.request_id for seq in batch.kv_wanted]
        for seq, why in batch.unservable:
            outputs += self._end(seq, ABORT, error=why)
        if batch.entries and batch.decode_only and self._from_columns(batch):
            result = self.runner.run(batch, None, [1] * len(batch.entries))
            self.scheduler.commit(batch)
            return outputs + self._postprocess_decode(batch, result)
        if batch.entries:
            rows, repeats = [], []
            for (seq, _), samples, drafted in zip(batch.entries, batch.sampling, batch.drafted):
                if drafted:
                    rows += self.drafts.rows(seq, drafted)
                    repeats.append(drafted + 1)
                    continue
                choices = self._sampled_choices(seq) if samples else []
                # Choices not forked yet stand where seq stands (no output): they share its mask.
                bitmask = self.output_processor.grammar_bitmask(seq) if choices and seq.params.grammar else None
                rows += [self._sampling_row(seq, c.seed, bitmask) for c in choices]
                repeats.append(len(choices))
            result = self.runner.run(batch, rows, repeats)
            accepted = self.drafts.accepted(batch, result, repeats)
            self.output_processor.keep_prompt_rows(result)
            self.scheduler.commit(batch, [k - a for k, a in zip(batch.drafted, accepted)])
            outputs += self._postprocess(batch, result, repeats, accepted)
        return outputs

    def _from_columns(self, batch: ScheduledBatch) -> bool:
        """Whether a decode step's rows all sample and stop from their persistent-batch columns
        alone, penalties, biases and bans included: no grammar, beam or generation logits, no choice
        left to fork, and not PREFILL (a resumed request's context can end in one decode-like token:
        it hands over)."""
        apart = self._apart
        return bool(self.rows.plain[batch.slots].all()) and not (apart and any(
            (seq.request_id, seq.index) in apart for seq, _ in batch.entries))

    def _postprocess_decode(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """The outputs of a step from the columns: the sampled tokens appended and EOS, stop ids and
        length caps decided for the whole batch with array operations; text and stop strings per row."""
        sampled, slots = result.sampled, batch.slots
        seqs = [seq for seq, _ in batch.entries]
        if len(seqs) < ARRAY_STOPS_MIN_ROWS:  # the row's own checks (append_token) cost less than the arrays'
            return self.output_processor.append_decoded(seqs, sampled, [UNDECIDED] * len(seqs))
        tokens = np.asarray(sampled.token_ids, dtype=np.int64)
        self.rows.append_tokens(slots, tokens)
        eos, stop, length = self.rows.stops(slots, tokens, self.max_model_len, self.config.max_iter_times)
        # finish_reason's order; a row with stop ids the columns do not hold decides its end row by row.
        codes = np.where(self.rows.stops_per_row[slots], 4,
                         np.where(eos, 1, np.where(stop, 2, np.where(length, 3, 0))))
        return self.output_processor.append_decoded(seqs, sampled, VERDICTS[codes].tolist())

    def _sampled_choices(self, seq: Sequence) -> list[PendingChoice]:
        """The choices whose next token this sequence's last logits give: its own, and at the
        prompt's end the choices still to fork whose first token is not known yet."""
        own = PendingChoice(seq.index, seq.seed)
        return [own] + [c for c in seq.pending_choices if c.first_token_id is None]

    def _expire(self, now: float) -> list[RequestOutput]:
        self.holds.expire(now, lambda request_id: bool(self._choices(request_id)))
        expired = [seq for seq in self._seqs.values() if now >= seq.deadline]
        return [out for seq in expired for out in self._end(seq, TIMEOUT)]

    def _sampling_row(self, seq: Sequence, seed: int, bitmask: torch.Tensor | None = None) -> SamplingRow:
        prompt = seq.prompt_ids
        if seq.prompt_table is not None:  # penalties see the prompt's real tokens (transformers: none with embeds)
            prompt = [t for t in prompt if t < self.vocab_size]
        return SamplingRow(seq.params, seed, prompt, seq.output_ids, self.output_processor.eos_ids(seq.params), bitmask)

    def _postprocess(self, batch: ScheduledBatch, result: StepResult, repeats: list[int],
                     accepted: list[int]) -> list[RequestOutput]:
        outputs, row = [], 0
        for (seq, _), repeat, drafted, standing in zip(batch.entries, repeats, batch.drafted, accepted):
            if not repeat:
                continue
            if self.beam_search.searching(seq.request_id):  # a beam reports its logits; the search decides
                if seq.pending_choices:  # DECODE: P's other beams start now that the prompt's KV is in
                    outputs += self._fork_choices(seq, [])
                self.beam_search.report(seq, result.sample_logits[row])
                row += repeat
                continue
            tokens = sampled_tokens(seq, result, range(row, row + repeat))
            row += repeat
            if seq.mode is Mode.PREFILL:
                outputs += self.output_processor.hand_over(seq, list(zip(self._sampled_choices(seq), tokens)))
                continue
            if drafted:  # the drafts that stand and the token after them, one output each, until one ends it
                for token in tokens[:standing + 1]:
                    outputs += self.output_processor.append_token(seq, token)
                    if seq.status is SequenceStatus.FINISHED:
                        break
                continue
            if seq.pending_choices:
                outputs += self._fork_choices(seq, tokens[1:])
            outputs += self.output_processor.append_token(seq, tokens[0])
        return outputs + self.beam_search.advance()

    def _fork_choices(self, seq: Sequence, sampled: list[Sampled]) -> list[RequestOutput]:
        """The prompt is computed: start the request's other choices, sharing its blocks. Their
        first tokens are ``sampled`` (GENERATE) or came from P (DECODE)."""
        choices, seq.pending_choices = seq.pending_choices, []
        self._apart.discard(seq.key)  # never PREFILL: its prompt's end hands over instead
        outputs = []
        beams = self.beam_search.searching(seq.request_id)
        for choice, token in itertools.zip_longest(choices, sampled):
            child = self.scheduler.fork(seq, choice)
            self._register(child)
            if beams:  # DECODE: one of P's beams
                self.beam_search.adopt(seq, child, choice)
            if token is None:  # DECODE: continues after P's first token
                self.output_processor.start_from_first_token(child, choice)
            else:
                self.output_processor.start(child)
                outputs += self.output_processor.append_token(child, token)
        return outputs

    # ---- the registry of running sequences -----------------------------------------------

    def _register(self, seq: Sequence) -> None:
        self._seqs[seq.key] = seq
        if seq.mode is Mode.PREFILL or seq.pending_choices:
            self._apart.add(seq.key)

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> list[RequestOutput]:
        """End ``seq`` where it stands (abort, timeout, unservable); a beam ends its whole search."""
        if self.beam_search.searching(seq.request_id):
            return self.beam_search.end(seq.request_id, reason, error)
        if seq.key not in self._seqs:  # a beam whose search ended a moment ago
            return []
        return self.output_processor.finish(seq, reason, error=error)

    def _release(self, seq: Sequence) -> None:
        """seq has ended (its outputs are made): free its blocks, forget it, and drop the
        request's prefix hold with its last choice."""
        seq.status = SequenceStatus.FINISHED
        seq.pending_choices = []
        self.scheduler.remove(seq)
        del self._seqs[seq.key]
        self._apart.discard(seq.key)
        self.output_processor.forget(seq)
        if seq.request_id in self.holds and not self._choices(seq.request_id):
            self.holds.drop(seq.request_id)

    # ---- synchronous runs, for tests, benchmarks and the CLI: engine/offline.py's functions ----

    def run_to_completion(self) -> dict[str, list[RequestOutput]]:
        return offline.run_to_completion(self)

    final_choices = staticmethod(offline.final_choices)

    def generate_choices(self, requests, loras=()) -> dict[str, list[RequestOutput]]:
        return offline.generate_choices(self, requests, loras)

    def generate(self, requests, loras=()) -> dict[str, RequestOutput]:
        return offline.generate(self, requests, loras)

    def prefill(self, requests, loras=()) -> dict[str, RequestOutput]:
        return offline.prefill(self, requests, loras)

    def decode(self, pairs, loras=()) -> dict[str, RequestOutput]:
        return offline.decode(self, pairs, loras)


def _weak(method):
    """``method`` called through a weak reference to its object (see LLMEngine.__init__)."""
    ref = weakref.WeakMethod(method)
    return lambda *args, **kwargs: ref()(*args, **kwargs)
