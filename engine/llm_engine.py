"""The engine: requests in, token outputs out, one model forward per ``step``.

    batch = scheduler.schedule()          # the scheduler decides
    sampled = runner.run(batch, rows)     # the runner owns the device
    outputs = self._postprocess(...)      # tokens, stop conditions, text, finished requests

Three modes share the loop (engine/request.py ``Mode``): GENERATE runs a request to the
end; PREFILL stops after the first token and returns the prompt's KV; DECODE starts from
that KV and the first token. Deadlines are checked before every step.
"""

from __future__ import annotations

import itertools
import random
import time

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_transfer import KVPayload, check_compatible
from engine.loader import load_model
from engine.model_runner import ModelRunner, kv_pool_blocks
from engine.outputs import ABORT, EOS, LENGTH, STOP, TIMEOUT, PrefillResult, RequestOutput, TokenLogprob
from engine.request import GenerationRequest, Mode, Sequence, SequenceStatus
from engine.scheduler import ScheduledBatch, Scheduler
from sampling import SamplerOutput, SamplingParams, SamplingRow
from sampling.params import MAX_SEED


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.torch_threads:
            import torch

            torch.set_num_threads(config.torch_threads)
        self.config = config
        self.loaded = load_model(config)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.spec.vocab_size
        self.blocks = BlockManager(kv_pool_blocks(config, self.loaded), config.block_size)
        # A request can never hold more KV than the whole pool: past that it would preempt itself forever.
        self.max_model_len = min(self.loaded.max_model_len, self.blocks.num_blocks * config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.loaded, self.blocks, config)
        self.runner.warm_up(config.max_num_batched_tokens)
        self._seqs: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()

    # ---- requests in -------------------------------------------------------------------

    def validate(self, request: GenerationRequest, mode: Mode = Mode.GENERATE,
                 prefill: PrefillResult | None = None) -> None:
        """Raise ValueError (message starting with the field's name) if the request can never run."""
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in request.params.token_ids_in_use() if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"parameters: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        n = len(request.prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: {n} tokens leave no room to generate within the maximum "
                             f"length of {self.max_model_len} (the model's, or the KV pool's)")
        if mode is Mode.DECODE:
            if prefill is None:
                raise ValueError("prefill: decode needs the prefill result")
            check_compatible(prefill.kv.meta, self.runner.kv_meta(n), n)

    def add_request(self, request: GenerationRequest, mode: Mode = Mode.GENERATE,
                    prefill: PrefillResult | None = None) -> None:
        self.validate(request, mode, prefill)
        if request.request_id in self._seqs:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        seed = prefill.seed if prefill else request.params.seed or random.randint(1, MAX_SEED)
        deadline = request.deadline or time.time() + self.config.default_timeout_s
        seq = Sequence(request, seed, next(self._arrivals), mode, deadline)
        detok = IncrementalDetokenizer(self.tokenizer, request.params.stop, request.params.skip_special_tokens)
        if mode is Mode.DECODE:
            seq.pending_kv = prefill.kv
            seq.token_ids.append(prefill.first_token_id)
            seq.first_token_time = seq.arrival_time
            if prefill.first_logprob is not None:
                seq.cumulative_logprob = prefill.first_logprob.logprob
            detok.add(prefill.first_token_id)  # P released this token's text; start after it
        self._seqs[request.request_id] = seq
        self._detokenizers[request.request_id] = detok
        self.scheduler.add(seq)

    def abort(self, request_id: str, reason: str = ABORT) -> RequestOutput | None:
        """End a request wherever it is and free its blocks; None if it is not here."""
        seq = self._seqs.get(request_id)
        return self._finish(seq, reason, [], "", []) if seq else None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def active_request_ids(self) -> list[str]:
        return list(self._seqs)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._expire(time.time())
        batch = self.scheduler.schedule()
        if batch.entries:
            rows = [self._sampling_row(seq) for seq, n in batch.entries if batch.samples(seq, n)]
            sampled = self.runner.run(batch, rows)
            outputs += self._postprocess(batch, sampled)
        return outputs

    def _expire(self, now: float) -> list[RequestOutput]:
        expired = [seq for seq in self._seqs.values() if now >= seq.deadline]
        return [self.abort(seq.request_id, TIMEOUT) for seq in expired]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(seq.params, seq.seed, seq.prompt_ids, seq.output_ids, self._eos_ids(seq.params))

    def _eos_ids(self, params: SamplingParams) -> list[int]:
        """The request's end id (TensorRT-LLM's end_id), else the model's EOS ids."""
        return [params.eos_token_id] if params.eos_token_id is not None else self.loaded.eos_token_ids

    def _postprocess(self, batch: ScheduledBatch, sampled: SamplerOutput | None) -> list[RequestOutput]:
        outputs, row = [], 0
        for seq, n in batch.entries:
            samples = batch.samples(seq, n)
            seq.num_computed_tokens += n
            if not samples:
                continue
            token = sampled.token_ids[row]
            logprob = None
            if sampled.logprobs[row] is not None:
                logprob = TokenLogprob(token, sampled.logprobs[row], sampled.top_logprobs[row])
            row += 1
            outputs.append(self._append_token(seq, token, logprob))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.time()
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
        logprobs = [logprob] if logprob else []
        text, stopped = self._detokenizers[seq.request_id].add(token)
        reason = self._finish_reason(seq, token, stopped)
        if reason is not None:
            return self._finish(seq, reason, [token], text, logprobs)
        if seq.mode is Mode.PREFILL:
            return self._hand_over(seq, token, text, logprobs)
        return self._output(seq, [token], text, logprobs, finished=False)

    def _finish_reason(self, seq: Sequence, token: int, stopped_by_string: bool) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self._eos_ids(p):
            return EOS
        output = seq.output_ids
        if stopped_by_string or any(output[-len(s):] == s for s in p.stop_token_ids):
            return STOP
        # In DECODE mode P's first token is not this engine's: the server cap counts D's own.
        own = seq.num_output_tokens - (1 if seq.mode is Mode.DECODE else 0)
        if seq.num_output_tokens >= p.max_new_tokens or own >= self.config.max_iter_times:
            return LENGTH
        if seq.num_tokens >= self.max_model_len:
            return LENGTH
        return None

    def _hand_over(self, seq: Sequence, token: int, text: str, logprobs: list[TokenLogprob]) -> RequestOutput:
        """PREFILL mode: export the prompt's KV, free the blocks, return the result for D."""
        kv = KVPayload(self.runner.kv_meta(seq.num_prompt_tokens), self.runner.export_kv(seq))
        result = PrefillResult(seq.request_id, token, logprobs[0] if logprobs else None, seq.seed, kv,
                               (seq.first_token_time - seq.arrival_time) * 1000.0)
        output = self._output(seq, [token], text, logprobs, finished=False)
        output.prefill = result
        self._release(seq)
        return output

    def _finish(self, seq: Sequence, reason: str, tokens: list[int], text: str,
                logprobs: list[TokenLogprob]) -> RequestOutput:
        seq.finish_reason = reason
        detok = self._detokenizers[seq.request_id]
        text += detok.finish()
        output = self._output(seq, tokens, text, logprobs, finished=True)
        output.output_token_ids = seq.output_ids
        output.text = detok.text
        self._release(seq)
        return output

    def _release(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]
        del self._detokenizers[seq.request_id]

    def _output(self, seq: Sequence, tokens: list[int], text: str, logprobs: list[TokenLogprob],
                finished: bool) -> RequestOutput:
        wants_logprobs = seq.params.logprobs is not None
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=tokens, new_text=text, num_output_tokens=seq.num_output_tokens,
            finished=finished, finish_reason=seq.finish_reason, seed=seq.seed, logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            first_token_time=seq.first_token_time, arrival_time=seq.arrival_time)

    # ---- synchronous helpers (tests, benchmarks, the CLI) ------------------------------

    def run_to_completion(self) -> dict[str, list[RequestOutput]]:
        """Step until no request is left; every output, grouped by request."""
        streams: dict[str, list[RequestOutput]] = {}
        while self.has_work():
            for out in self.step():
                streams.setdefault(out.request_id, []).append(out)
        return streams

    def generate(self, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
        """Run requests together to the end; each request's last output."""
        for request in requests:
            self.add_request(request)
        return {rid: outs[-1] for rid, outs in self.run_to_completion().items()}

    def prefill(self, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
        for request in requests:
            self.add_request(request, Mode.PREFILL)
        return {rid: outs[-1] for rid, outs in self.run_to_completion().items()}

    def decode(self, pairs: list[tuple[GenerationRequest, PrefillResult]]) -> dict[str, RequestOutput]:
        for request, prefill in pairs:
            self.add_request(request, Mode.DECODE, prefill)
        return {rid: outs[-1] for rid, outs in self.run_to_completion().items()}
