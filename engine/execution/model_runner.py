"""The model runner owns the device: the weights, the KV pool, the forward and the sampler.

``run`` turns a step (engine/execution/step_inputs.py StepBatch) into one flat batch of tokens, runs one forward over it,
computes logits only for the rows that sample (and, for a request that asked for prompt
logprobs or context logits, the rows of its prompt chunk), and samples them. Before the forward it writes
imported KV and makes the block copies of copy-on-write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import mmap
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.execution.attention import (AttentionSeq, batch_invariant_by_default, batch_invariant_supported,
                                        select_backend)
from engine.config import EngineConfig
from engine.kv_tier import KVTier, TierMove
from engine.kv_transfer import KVMeta, numpy_to_tensor, tensor_to_numpy
from engine.execution.loader import LoadedModel
from engine.execution.model import RMSNorm
from engine.execution.persistent_batch import PersistentBatch
from engine.execution.step_inputs import KVBlocks, StepBatch, StepSequence
from engine.execution.lora import LoraStacks, LoraStep
from engine.outputs import TokenLogprob
from sampling import Sampler, SamplerOutput, SamplingBatch, SamplingRow

if TYPE_CHECKING:  # imported where used: it needs Triton, which a CPU install need not have
    from engine.execution.cuda_graphs import DecodeGraphs

SCORE_ROWS = 256  # prompt rows scored per LM-head call: bounds the [rows, V] float32 logits
CPU_WARM_UP_TOKENS = 64  # a CPU replica's start-up forward: enough to load and run every kernel once


@dataclass
class PromptScores:
    """The logprobs of prompt tokens [first, first + len(entries)) of ``seq``, scored this step."""

    seq: StepSequence
    first: int
    entries: list[TokenLogprob]


@dataclass
class ContextRows:
    """The raw logits of prompt positions [first, first + len(logits)) of ``seq``, computed this step."""

    seq: StepSequence
    first: int
    logits: torch.Tensor  # [t, V] float32, on the host


@dataclass
class StepResult:
    sampled: SamplerOutput | None  # None when no entry reached its last token
    prompt_scores: list[PromptScores] = field(default_factory=list)
    context_logits: list[ContextRows] = field(default_factory=list)
    # [R, V] float32 on the host: the sampled rows' raw logits, before any processor; None unless
    # a row's request asked for its generation logits or searches with beams.
    sample_logits: torch.Tensor | None = None


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """K and V of every layer for one token, in the model's dtype."""
    spec = loaded.spec
    element = torch.empty((), dtype=loaded.dtype).element_size()
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * element


def _norms_in(loaded: LoadedModel, dtype: torch.dtype) -> bool:
    """Whether every RMSNorm weight is in ``dtype`` (the fused kernels' assumption)."""
    return all(m.weight.dtype == dtype for m in loaded.model.modules() if isinstance(m, RMSNorm))


def _tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _check_device_memory(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """On CUDA, refuse a KV pool larger than the device's free memory, saying both."""
    if device.type != "cuda":
        return
    asked = _tensor_bytes(shape, dtype)
    free, total = torch.cuda.mem_get_info(device)
    if asked > free:
        raise ValueError(f"kv_cache_memory_gb / num_blocks: the KV pool needs {asked / (1 << 30):.2f} GiB on {device}, "
                         f"which has {free / (1 << 30):.2f} GiB free of {total / (1 << 30):.2f} GiB")


KV_POOL_MAPPING = "pdserve-kv-pool"  # the CPU pool's name in /proc/<pid>/maps: "/memfd:pdserve-kv-pool (deleted)"


def kv_pool_resident_bytes(process) -> int:
    """The bytes of ``process``'s (a ``psutil.Process``) CPU KV pools now resident: what its traffic
    has touched of them, which a reading of the process's memory for leaks leaves out."""
    return sum(m.rss for m in process.memory_maps() if KV_POOL_MAPPING in m.path)


def zeroed_kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The KV pool, every element 0. On the CPU it lies in a mapping of its own, named
    ``KV_POOL_MAPPING`` (a memfd): the kernel hands its pages out zeroed, each only when first
    touched, so a replica holds in memory the part of its pool it has used (a few MB of the default
    0.5 GB for short prompts), not the whole pool from the start as ``torch.zeros`` (which writes
    every page) would. The name lets a process's memory be read as its pool's (which grows up to
    the pool's size as traffic touches blocks, the bound a user set) and the rest (where a leak
    would show: tools/soak_invariants.py)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = _tensor_bytes(shape, dtype)
    if not hasattr(os, "memfd_create"):  # not Linux: an anonymous mapping, the same pages without a name
        return torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)
    fd = os.memfd_create(KV_POOL_MAPPING)
    try:
        os.ftruncate(fd, size)
        pool = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the memory; it is freed with the tensor
    return torch.frombuffer(pool, dtype=dtype).view(shape)


def kv_pool_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """Blocks in the pool: ``num_blocks``, or as many as ``kv_cache_memory_gb`` holds."""
    if config.num_blocks is not None:
        return config.num_blocks
    return max(1, int(config.kv_cache_memory_gb * (1 << 30)) // (config.block_size * kv_bytes_per_token(loaded)))


def kv_tier(config: EngineConfig, loaded: LoadedModel) -> KVTier | None:
    """The second tier behind the pool (engine/kv_tier.py), when ``kv_tier_gb`` asks for one."""
    if not config.kv_tier_gb or not config.enable_prefix_caching:
        return None
    spec = loaded.spec
    block = (spec.num_layers, 2, config.block_size * spec.num_kv_heads * spec.head_dim)  # a pool block's KV
    return KVTier(int(config.kv_tier_gb * (1 << 30)), block, loaded.dtype, loaded.device, config.kv_tier_dir)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, blocks: KVBlocks, config: EngineConfig, rows: PersistentBatch) -> None:
        self.loaded = loaded
        self.blocks = blocks
        self.rows = rows  # the running rows' columns: a decode step's inputs and sampling controls
        self.device = loaded.device
        spec = loaded.spec
        # [layers, k/v, slots, kv_heads, head_dim], allocated once.
        shape = (spec.num_layers, 2, blocks.num_blocks * blocks.block_size, spec.num_kv_heads, spec.head_dim)
        _check_device_memory(self.device, shape, loaded.dtype)
        self.kv_cache = zeroed_kv_pool(shape, loaded.dtype, self.device)
        self.sampler = Sampler(self.device, spec.vocab_size, config.top_k_guess, config.sampler_backend)
        self.windows = set(spec.layer_windows)
        self.batch_invariant = config.batch_invariant
        if self.batch_invariant is None:  # the environment's choice, else this device's default
            choice = os.environ.get("PDSERVE_BATCH_INVARIANT")
            if config.attention_backend == "torch_sdpa" or choice == "0":
                self.batch_invariant = False
            elif choice == "1":  # wherever this engine can have it
                self.batch_invariant = batch_invariant_supported(self.device, loaded.dtype)
            else:
                self.batch_invariant = batch_invariant_by_default(self.device, loaded.dtype,
                                                                  quantized=":" in loaded.weight_storage)
        self.attention = select_backend(config.attention_backend, self.device, loaded.dtype, self.batch_invariant,
                                        group=spec.num_heads // spec.num_kv_heads)
        loaded.model.set_batch_invariant(self.batch_invariant)
        if self.attention.name == "triton_paged" and self.device.type == "cuda" and _norms_in(loaded, loaded.dtype):
            loaded.model.use_fused_ops()  # Triton is there: RMSNorm, RoPE and SiLU*mul fused too
        # Step inputs, allocated once: [max tokens per step] each, filled from one host array
        # (pinned on CUDA, so that its copy to the device does not wait on a staging copy).
        pinned = self.device.type == "cuda"
        self._inputs = torch.zeros(3, config.max_num_batched_tokens, dtype=torch.int64, pin_memory=pinned)
        self._inputs_np = self._inputs.numpy()  # ids, positions, slots
        self._lora_stacks: LoraStacks | None = None  # the last steps' adapters, stacked (engine/execution/lora.py)
        self.graphs: DecodeGraphs | None = None  # built by warm_up on CUDA with triton_paged
        if self.attention.name == "triton_paged" and self.device.type == "cuda" and not config.enforce_eager:
            max_batch = min(config.max_cuda_graph_batch, config.max_num_seqs)
            width = -(-loaded.max_model_len // blocks.block_size)
            if max_batch > 0:
                from engine.execution.cuda_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(loaded.model, self.kv_cache, blocks.block_size, max_batch, width,
                                           spec.num_heads // spec.num_kv_heads)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One throw-away forward at start-up: the first real request then finds the kernels loaded
        and warm. On CUDA it is a full step's tokens (as vLLM's profile run: the caching allocator
        and Triton's compiled shapes at their largest); on a CPU a few blocks' worth, which loads
        every kernel as well: a full step there is only a long prefill (~15 s for a 2,048-token step
        of a 135M model in float32 on 2 cores) that every replica start would wait for. It writes KV
        into pool slots that no sequence owns yet; every slot is written by its owner before it is
        read. On CUDA with triton_paged it then captures the decode steps' graphs."""
        if self.device.type == "cpu":
            num_tokens = min(num_tokens, CPU_WARM_UP_TOKENS)
        num_tokens = min(num_tokens, self.kv_cache.shape[2], self.loaded.spec.max_position)
        positions = torch.arange(num_tokens, device=self.device)
        blocks = list(range(-(-num_tokens // self.blocks.block_size)))
        attn = self.attention.prepare(positions, [AttentionSeq(0, num_tokens, 0, blocks)], self.windows,
                                      self.blocks.block_size, self.device)
        hidden = self.loaded.model(torch.zeros_like(positions), positions, attn, self.kv_cache)
        self.loaded.model.compute_logits(hidden[-1:])
        if self.graphs is not None:
            self.graphs.capture()

    def kv_meta(self, num_tokens: int, start: int = 0) -> KVMeta:
        spec = self.loaded.spec
        return KVMeta(self.loaded.model_id, str(self.loaded.dtype).removeprefix("torch."), spec.num_layers,
                      spec.num_kv_heads, spec.head_dim, num_tokens, start)

    @torch.inference_mode()
    def run(self, batch: StepBatch, rows: list[SamplingRow] | None, rows_per_entry: list[int]) -> StepResult:
        """One forward over every entry of ``batch``; sample ``rows_per_entry[i]`` rows from the
        last token of each entry that reaches its end (``rows``, in entry order: one per choice
        when a prompt's choices are sampled together; with k drafts, one per position of the
        last token and the drafts), and score the prompt tokens of entries whose sequence asked
        for it. ``rows`` None: a decode step whose rows sample from the persistent batch's columns."""
        self.move_tier_blocks(self.blocks.take_tier_moves())
        for seq, first in batch.kv_imports:
            self.import_kv(seq, first)
        self.copy_blocks(batch.block_copies)
        if batch.decode_only:
            return self._run_decode(batch, rows)
        attention_seqs, sample_rows = [], []
        to_score = []  # (seq, first hidden row, first scored position, count)
        to_keep = []  # (seq, first hidden row, first position, count): context logits
        inputs, flat = self._inputs_np, 0  # [3, N]: ids, positions, slots
        # Entries of one token (decodes): their flat rows, ids, positions and slots, written together.
        single_rows, single_ids, single_positions, single_slots = [], [], [], []
        table_rows, table_embeddings = [], []  # p-tuning: flat rows whose embedding comes from a prompt table
        vocab, block_size = self.loaded.spec.vocab_size, self.blocks.block_size
        for (seq, n), repeat, drafted in zip(batch.entries, rows_per_entry, batch.drafted):
            start = seq.num_computed_tokens
            if n == 1 and not drafted and (seq.prompt_table is None or seq.token_ids[start] < vocab):
                single_rows.append(flat)
                single_ids.append(seq.token_ids[start])
                single_positions.append(start)
                single_slots.append(seq.block_table[start // block_size] * block_size + start % block_size)
                self._plan_row(seq, flat, n, start, repeat, drafted, attention_seqs, sample_rows, to_score, to_keep)
                flat += n
                continue
            chunk = seq.token_ids[start:start + n]
            if drafted:  # the last token, then the drafts: each of the k + 1 rows samples
                chunk += seq.step_drafts.token_ids[:drafted]
            if seq.prompt_table is not None and max(chunk) >= vocab:
                virtual = [(flat + j, t - vocab) for j, t in enumerate(chunk) if t >= vocab]
                table_rows += [row for row, _ in virtual]
                table_embeddings.append(torch.from_numpy(seq.prompt_table.embeddings)[[i for _, i in virtual]])
                chunk = [t if t < vocab else 0 for t in chunk]  # any id: the table's row replaces its embedding
            inputs[0, flat:flat + n] = chunk
            inputs[1, flat:flat + n] = np.arange(start, start + n)
            inputs[2, flat:flat + n] = self.blocks.slots(seq, start, start + n)
            self._plan_row(seq, flat, n, start, repeat, drafted, attention_seqs, sample_rows, to_score, to_keep)
            flat += n
        if single_rows:
            inputs[:, single_rows] = (single_ids, single_positions, single_slots)
        model = self.loaded.model
        if self._graph_eligible(batch, flat, rows_per_entry, table_rows, to_score, to_keep):
            logits = self.graphs.run(inputs[0, :flat], inputs[1, :flat], inputs[2, :flat],
                                     [s.block_table for s in attention_seqs])
            return self._sample_step(logits, rows, [], [], batch.slots)
        ids, positions, slot_mapping = self._inputs[:, :flat].to(self.device, non_blocking=True)
        attn = self.attention.prepare(slot_mapping, attention_seqs, self.windows, self.blocks.block_size, self.device)
        replaced = None
        if table_rows:
            replaced = (torch.tensor(table_rows, device=self.device), torch.cat(table_embeddings).to(self.device))
        hidden = model(ids, positions, attn, self.kv_cache, replaced, self._lora_step(batch, flat))  # [N, H]
        scores = [PromptScores(seq, first, self._score(hidden[row:row + count], seq.token_ids[first:first + count],
                                                       seq.params.prompt_logprobs))
                  for seq, row, first, count in to_score]
        context = [ContextRows(seq, first, self._raw_logits(hidden[row:row + count]))
                   for seq, row, first, count in to_keep]
        if not sample_rows:
            return StepResult(None, scores, context)
        logits = model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])  # [R, V]
        return self._sample_step(logits, rows, scores, context, batch.slots)

    def _run_decode(self, batch: StepBatch, rows: list[SamplingRow] | None) -> StepResult:
        """A step of one decode token per entry, each sampling one row: its inputs and block
        tables are gathers of the persistent batch by the entries' slots, no loop over rows."""
        slots, block_size = batch.slots, self.blocks.block_size
        n = len(slots)
        inputs = self._inputs_np
        inputs[0, :n], inputs[1, :n], inputs[2, :n] = self.rows.decode_inputs(slots, block_size)
        tables = self.rows.tables[slots, :int(self.rows.table_len[slots].max())]  # [n, width] int32
        positions = inputs[1, :n]
        if self.graphs is not None and n <= self.graphs.max_batch and (self.rows.lora[slots] < 0).all():
            logits = self.graphs.run(inputs[0, :n], positions, inputs[2, :n], tables)
            return self._sample_step(logits, rows, [], [], slots)
        ids, positions_t, slot_mapping = self._inputs[:, :n].to(self.device, non_blocking=True)
        if hasattr(self.attention, "prepare_decode") and self.device.type == "cpu":
            attn = self.attention.prepare_decode(slot_mapping, tables, positions.copy(), block_size)
        else:  # the other backends take one AttentionSeq per row
            lengths = self.rows.table_len[slots].tolist()
            seqs = [AttentionSeq(i, 1, p, table[:length])
                    for i, (p, table, length) in enumerate(zip(positions.tolist(), tables.tolist(), lengths))]
            attn = self.attention.prepare(slot_mapping, seqs, self.windows, block_size, self.device)
        # The adapters' per-row look only where the lora column names one (most steps: none).
        lora = self._lora_step(batch, n) if bool((self.rows.lora[slots] >= 0).any()) else None
        hidden = self.loaded.model(ids, positions_t, attn, self.kv_cache, None, lora)  # [n, H]
        return self._sample_step(self.loaded.model.compute_logits(hidden), rows, [], [], slots)

    @staticmethod
    def _plan_row(seq: StepSequence, flat: int, n: int, start: int, repeat: int, drafted: int,
                  attention_seqs: list[AttentionSeq], sample_rows: list[int], to_score: list, to_keep: list) -> None:
        """Record where entry ``seq``'s n tokens (positions from ``start``, flat rows from ``flat``)
        go: its attention rows, the rows that sample, the prompt rows to score or keep."""
        attention_seqs.append(AttentionSeq(flat, n, start, seq.block_table))
        if drafted:
            sample_rows += range(flat + n - 1 - drafted, flat + n)
        elif repeat:
            sample_rows += [flat + n - 1] * repeat
        if start >= seq.num_prompt_tokens:  # a decode row: no prompt row to score or keep
            return
        # Row p's logits score the token at p + 1; the prompt's last row samples instead.
        scored = min(start + n, seq.num_prompt_tokens - 1) - start
        if seq.prompt_logprobs is not None and scored > 0:
            to_score.append((seq, flat, start + 1, scored))
        in_prompt = min(start + n, seq.num_prompt_tokens) - start
        if seq.wants_context_logits and in_prompt > 0:
            to_keep.append((seq, flat, start, in_prompt))

    def _graph_eligible(self, batch: StepBatch, flat: int, rows_per_entry: list[int], table_rows: list,
                        to_score: list, to_keep: list) -> bool:
        """Whether this step replays a CUDA graph: every entry one decode row that samples once,
        nothing the graph does not compute (LoRA, prompt tables, scores, context logits)."""
        return (self.graphs is not None and flat == len(batch.entries) <= self.graphs.max_batch
                and not table_rows and not to_score and not to_keep and not any(batch.drafted)
                and all(repeat == 1 for repeat in rows_per_entry)
                and all(seq.lora is None for seq, _ in batch.entries))

    def _sample_step(self, logits: torch.Tensor, rows: list[SamplingRow] | None, scores: list[PromptScores],
                     context: list[ContextRows], slots: np.ndarray) -> StepResult:
        """The step's result from the sampled rows' logits [R, V]; ``rows`` None: every row samples
        from its persistent-batch columns (``slots`` [R])."""
        if rows is None:
            columns = SamplingBatch.from_columns(self.rows.sampling_columns(slots), self.device)
            return StepResult(self.sampler(logits, columns), scores, context)
        kept = None
        # Copied before the sampler works on them: rows that return them, and beams, which are scored on them.
        if any(row.params.return_generation_logits or row.params.beam_width > 1 for row in rows):
            kept = logits[:, :self.loaded.spec.vocab_size].to("cpu", torch.float32, copy=True)
        return StepResult(self._sample(logits, rows), scores, context, kept)

    def _lora_step(self, batch: StepBatch, num_rows: int) -> LoraStep | None:
        """The step's LoRA deltas: each entry's rows get its sequence's adapter (engine/execution/lora.py);
        None when no entry has one. The stacked weights are kept while the adapters stay the same."""
        adapters = {id(seq.lora): seq.lora for seq, _ in batch.entries if seq.lora is not None}
        if not adapters:
            return None
        ordered = sorted(adapters.values(), key=lambda a: (a.ref.name, a.ref.digest))
        if self._lora_stacks is None or self._lora_stacks.adapters != ordered:
            self._lora_stacks = LoraStacks(ordered, self.loaded.dtype, self.device)
        index = {id(a): j for j, a in enumerate(ordered)}
        row_adapter = np.full(num_rows, -1, dtype=np.int64)
        flat = 0
        for seq, n in batch.entries:
            if seq.lora is not None:
                row_adapter[flat:flat + n] = index[id(seq.lora)]
            flat += n
        return LoraStep(self._lora_stacks, torch.from_numpy(row_adapter).to(self.device))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The sampler over the rows that draw a token; a beam's row draws none (engine/decoding/beam_search.py
        decides from its logits), and its place in the output holds token 0."""
        drawn = [i for i, row in enumerate(rows) if row.params.beam_width == 1]
        vocab = self.loaded.spec.vocab_size
        if len(drawn) == len(rows):
            return self.sampler(logits, SamplingBatch.build(rows, vocab, self.device))
        out = SamplerOutput([0] * len(rows), [None] * len(rows), [None] * len(rows))
        if drawn:
            sampled = self.sampler(logits[drawn], SamplingBatch.build([rows[i] for i in drawn], vocab, self.device))
            for j, i in enumerate(drawn):
                out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = (
                    sampled.token_ids[j], sampled.logprobs[j], sampled.top_logprobs[j])
        return out

    def _raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, V] float32 on the host: the LM head over ``hidden`` [T, H], SCORE_ROWS rows at a time."""
        vocab = self.loaded.spec.vocab_size
        return torch.cat([self.loaded.model.compute_logits(hidden[i:i + SCORE_ROWS])[:, :vocab].to("cpu", torch.float32)
                          for i in range(0, len(hidden), SCORE_ROWS)])

    def _score(self, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
        """Each row's log_softmax (float32, the model's raw distribution) at its target token, and
        its top ``top_n``; ``hidden`` [T, H] with T = len(targets)."""
        entries = []
        vocab = self.loaded.spec.vocab_size
        for start in range(0, len(targets), SCORE_ROWS):
            chunk = targets[start:start + SCORE_ROWS]
            logprobs = self.loaded.model.compute_logits(hidden[start:start + len(chunk)])[:, :vocab].float()
            logprobs = logprobs.log_softmax(-1)  # [t, V]
            chosen = logprobs.gather(-1, torch.tensor(chunk, device=self.device)[:, None]).squeeze(-1).tolist()
            top_values, top_ids = logprobs.topk(top_n, dim=-1)  # [t, top_n]; top_n may be 0
            entries += [TokenLogprob(t, v, list(zip(i, tv)))
                        for t, v, i, tv in zip(chunk, chosen, top_ids.tolist(), top_values.tolist())]
        return entries

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets src's KV in every layer."""
        if copies:
            by_block = self.kv_cache.view(*self.kv_cache.shape[:2], self.blocks.num_blocks, -1)  # [L, 2, NB, B*H*D]
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
            by_block[:, :, dst] = by_block[:, :, src]

    def move_tier_blocks(self, moves: list[TierMove]) -> None:
        """Make the block manager's copies between the pool and its tier, in the order decided: a
        run of spills (pool -> tier) or copy-backs (tier -> pool) at a time; a spilled entry is
        ready for look-ups once its bytes are in."""
        if not moves:
            return
        tier = self.blocks.tier
        by_block = self.kv_cache.view(*self.kv_cache.shape[:2], self.blocks.num_blocks, -1)  # [L, 2, NB, B*H*D]
        run: list[TierMove] = []
        for move in moves + [None]:
            # A run ends where the kind changes or a pool block comes again (copied back twice).
            if run and (move is None or move.spill != run[0].spill or any(m.block == move.block for m in run)):
                blocks = torch.tensor([m.block for m in run], device=self.device)
                slots = torch.tensor([m.slot for m in run])
                if run[0].spill:
                    # A blocking copy from the device: the bytes are in before a look-up may find them.
                    tier.storage.index_copy_(2, slots, by_block.index_select(2, blocks).to("cpu"))  # [L, 2, n, X]
                    tier.written([m.key for m in run])
                else:
                    by_block.index_copy_(2, blocks, tier.storage.index_select(2, slots).to(self.device))
                    tier.copied_back(len(run))
                run = []
            if move is not None:
                run.append(move)

    def write_blocks(self, blocks: list[int], data: np.ndarray) -> None:
        """Write whole blocks' KV: ``data`` [L, 2, len(blocks) * block_size, Hkv, D] (the prefix
        store's blocks, in order) into ``blocks``."""
        bs = self.blocks.block_size
        slots = torch.tensor([b * bs + i for b in blocks for i in range(bs)], device=self.device)
        if slots.numel():
            self.kv_cache[:, :, slots] = numpy_to_tensor(data, self.loaded.dtype).to(self.device)

    def export_kv(self, seq: StepSequence, start: int = 0, end: int | None = None) -> np.ndarray:
        """The KV of tokens [start, end) (end: seq.num_tokens) as one array [L, 2, T, Hkv, D]: in PREFILL
        mode, the prompt and a resumed request's earlier output, every one computed; a decoding
        sequence that moves (engine/running_export.py), every token but its last."""
        end = seq.num_tokens if end is None else end
        slots = torch.tensor(self.blocks.slots(seq, start, end), device=self.device)
        return tensor_to_numpy(self.kv_cache[:, :, slots])

    def import_kv(self, seq: StepSequence, first: int) -> None:
        """Write the pending payload's tokens [first, its num_tokens) into ``seq``'s slots; the
        tokens before ``first`` are already there (prefix-cache hits)."""
        payload = seq.pending_kv
        data = numpy_to_tensor(payload.data, self.loaded.dtype)[:, :, first - payload.meta.start:]
        slots = torch.tensor(self.blocks.slots(seq, first, payload.meta.num_tokens), device=self.device)
        if slots.numel():
            self.kv_cache[:, :, slots] = data.to(self.device)
        seq.pending_kv = None
