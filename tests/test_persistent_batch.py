"""The persistent batch (engine/execution/persistent_batch.py): after every change to the running
batch, its arrays equal the state rebuilt from the sequences alone.

Model-free: the real scheduler and block manager, driven by random join / finish / abort /
preempt / fork / token append (and the block appends it brings) over sequences with their own
sampling and stop controls and LoRA adapters. Then the engine on a tiny model: the same check
after each of its steps, over n choices, beams, stop ids and preemption.
"""

import copy
import random
import time

import numpy as np
import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.execution.persistent_batch import NO_ROW, PersistentBatch
from engine.execution.processor_columns import NONE
from engine import llm_engine
from engine.llm_engine import LLMEngine
from engine.lora_adapter import LoraAdapter
from engine.request import GenerationRequest, Mode, PendingChoice, Sequence
from engine.scheduler import ScheduledBatch, Scheduler
from sampling import SamplingParams, SamplingRow
from sampling.processors import ProcessorInputs, apply_all, uses_penalties

BLOCK = 4


def assert_matches_rebuild(rows: PersistentBatch, running: list[Sequence]) -> None:
    """The arrays of every running sequence equal a fresh batch's, joined from scratch; no other slot is taken."""
    assert rows.num_running == len(running)
    assert sorted(seq.row for seq in running) == sorted(set(seq.row for seq in running))
    fresh = PersistentBatch(1, rows.table_width, rows.vocab_size)
    fresh.adapters = dict(rows.adapters)  # adapter indices are the batch's own numbering
    for seq in running:
        assert rows.seqs[seq.row] is seq
        for name, value in fresh.row_columns(seq).items():
            column = getattr(rows, name)
            np.testing.assert_array_equal(column[seq.row], np.asarray(value, dtype=column.dtype),
                                          err_msg=f"{seq.key} {name}")
        # The ragged controls: a history where a penalty or ban reads one, the request's logit bias.
        history = rows.controls.history_tokens(seq.row, seq.num_tokens)
        assert history == (seq.token_ids if rows.controls.needs_history(seq) else None), seq.key
        mine = rows.controls.bias_slots == seq.row
        assert dict(zip(rows.controls.bias_ids[mine].tolist(), rows.controls.bias_values[mine].tolist())) == {
            token: np.float32(value) for token, value in seq.params.logit_bias.items()}, seq.key
        assert seen_counts(rows, seq) == counted_afresh(rows, seq), seq.key
        table = rows.tables[seq.row]
        assert rows.table_len[seq.row] == len(seq.block_table)
        assert table[:len(seq.block_table)].tolist() == seq.block_table, seq.key
        assert not table[len(seq.block_table):].any()
    taken = {seq.row for seq in running}
    assert all(rows.seqs[slot] is None for slot in range(rows.capacity) if slot not in taken)
    assert set(rows.controls.bias_slots.tolist()) <= taken
    assert rows.controls.num_histories == sum(rows.controls.needs_history(seq) for seq in running)


def seen_counts(rows: PersistentBatch, seq: Sequence) -> dict[int, int] | None:
    """The distinct ids ``seq``'s counter row holds (engine/execution/seen_ids.py) -> their output
    counts; None when it keeps none."""
    r = rows.controls.seen_of[seq.row]
    if r == NONE:
        return None
    seen = rows.controls.seen
    n = seen.num_seen[r]
    ids, _, delta = seen.inputs(np.array([r]))
    p = seq.params  # the step's penalties read the kept delta of each id: the count's, padded with the first's
    assert np.array_equal(delta[0], seen.delta[r, :delta.shape[1]])
    assert delta[0, :n].tolist() == (np.float32(p.frequency_penalty) * seen.counts[r, :n] + np.float32(
        p.presence_penalty) * (seen.counts[r, :n] > 0).astype(np.float32)).tolist()
    assert set(ids[0, n:].tolist()) <= {ids[0, 0]} and set(delta[0, n:].tolist()) <= {delta[0, 0]}
    return dict(zip(seen.ids[r, :n].tolist(), seen.counts[r, :n].astype(int).tolist()))


def counted_afresh(rows: PersistentBatch, seq: Sequence) -> dict[int, int] | None:
    """What ``seen_counts`` holds for ``seq``, counted from its tokens (None: it asks for no penalty)."""
    if not uses_penalties(seq.params):
        return None
    return {t: seq.output_ids.count(t) for t in seq.token_ids if t < rows.vocab_size}


def scheduled(batch: ScheduledBatch) -> tuple:
    """What a schedule decided, by sequence key (two schedulers' sequences are copies)."""
    return ([(seq.key, n) for seq, n in batch.entries], batch.block_copies, [seq.key for seq in batch.preempted],
            batch.drafted, batch.sampling, batch.decode_only, batch.slots.tolist())


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_new_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.7, 1.0]),
                          top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]),
                          logprobs=rng.choice([None, 2]), ignore_eos=rng.random() < 0.5,
                          repetition_penalty=rng.choice([1.0, 1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
                          logit_bias=rng.choice([{}, {}, {4: 1.5, 9: -2.0}]), min_new_tokens=rng.choice([0, 3]),
                          bad_words_ids=rng.choice([[], [[5], [6, 8]]]), no_repeat_ngram_size=rng.choice([0, 0, 2]),
                          stop_token_ids=rng.choice([[], [[7]], [[7], [8, 9]], [[1], [2], [3], [4], [5]]]),
                          eos_token_id=rng.choice([None, 11]))


@pytest.mark.parametrize("seed", range(6))
def test_arrays_equal_a_rebuild_after_random_changes(seed):
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=40, block_size=BLOCK)
    scheduler = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=48,
                          rows=PersistentBatch(2, 40, vocab_size=50))  # grows past 2 rows as they join
    rows = scheduler.rows
    adapters = [None] + [LoraAdapter.of(f"a{k}", {(0, "q"): (np.full((1, 2), k, np.float32),
                                                           np.ones((2, 1), np.float32))}) for k in range(2)]
    arrivals = iter(range(10**6))

    def new_sequence() -> Sequence:
        request = GenerationRequest(f"r{next(arrivals)}", [rng.randrange(3, 50) for _ in range(rng.randint(1, 14))],
                                    random_params(rng), priority=rng.randint(1, 5))
        seq = Sequence(request, rng.randrange(1, 2**64), next(arrivals), Mode.GENERATE, time.time() + 60,
                       lora=rng.choice(adapters))
        seq.eos_token_ids = [request.params.eos_token_id or 2]
        seq.decode_side = rng.random() < 0.3
        return seq

    forks = fast_steps = 0
    for _ in range(120):
        action = rng.choice(["join", "join", "step", "step", "step", "finish", "abort", "preempt", "fork"])
        running = list(scheduler.running)
        if action == "join":
            scheduler.add(new_sequence())
        elif action == "step":  # block appends, joins (admission) and preemption happen in here
            assert blocks.covered(rows.tables[[s.row for s in running]], rows.table_len[[s.row for s in running]],
                                  rows.num_computed[[s.row for s in running]] + 1).tolist() == [
                blocks.covers(s, s.num_computed_tokens + 1) for s in running]
            per_row = copy.deepcopy(scheduler)
            per_row._all_decode = lambda ordered, budget: None  # the loop over rows, as the reference
            ordered = sorted(running, key=lambda s: s.order_key)
            fast_steps += scheduler._all_decode(ordered, scheduler.max_num_batched_tokens) is not None
            batch = scheduler.schedule()
            assert scheduled(batch) == scheduled(per_row.schedule())
            assert batch.slots.tolist() == [seq.row for seq, _ in batch.entries]
            scheduler.commit(batch)
            for (seq, _), due in zip(batch.entries, batch.sampling):
                if due and seq.row != NO_ROW:
                    seq.token_ids.append(rng.randrange(3, 50))
                    rows.write_token(seq)
        elif action in ("finish", "abort") and running:
            scheduler.remove(rng.choice(running))
        elif action == "abort" and scheduler.waiting:  # one that never ran
            scheduler.remove(rng.choice(scheduler.waiting))
        elif action == "preempt" and running:
            scheduler._preempt(rng.choice(running), ScheduledBatch())
        elif action == "fork" and running:
            parent = rng.choice(running)
            forks += 1
            child = scheduler.fork(parent, PendingChoice(forks, rng.randrange(1, 2**64)))
            child.token_ids.append(rng.randrange(3, 50))
            rows.write_token(child)
        assert_matches_rebuild(rows, scheduler.running)
        # The service order the scheduler keeps at each join and leave: the running rows, sorted.
        assert scheduler._ordered == sorted(scheduler.running, key=lambda s: s.order_key)
    assert rows.capacity > 2
    assert fast_steps >= 3, "the random changes were meant to reach steps of decodes only"


def test_processor_inputs_from_the_columns_equal_those_from_the_rows():
    """Model-free: rows with random penalties, biases, bans and min_new_tokens (and some with none),
    prompt-table ids (past the vocabulary) among some prompts, output lengths on both sides of
    min_new_tokens, tokens appended one row at a time and a step's rows at once, the step's rows
    in another order than their slots: the processors change the logits from the batch's columns
    exactly as from the per-row ``SamplingRow``s (the engine's: prompt-table ids left out)."""
    rng = random.Random(3)
    vocab = 30
    rows = PersistentBatch(2, 16, vocab_size=vocab)
    seqs = []
    for k in range(14):
        params = SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.7]), presence_penalty=rng.choice([0.0, 0.5]),
                                frequency_penalty=rng.choice([0.0, 0.3]), min_new_tokens=rng.choice([0, 3]),
                                logit_bias=rng.choice([{}, {rng.randrange(4, vocab): 2.0, 3: -1.5}]),
                                no_repeat_ngram_size=rng.choice([0, 1, 2]),
                                bad_words_ids=rng.choice([[], [[5], [6, 7]]]))
        prompt = [rng.randrange(vocab + 4) for _ in range(rng.randint(1, 9))]  # ids >= vocab: a prompt table's
        if k == 0:  # bans every token of its context but the prompt table's
            params, prompt = SamplingParams(no_repeat_ngram_size=1), [4, vocab + 1, 6]
        if k == 1:  # nothing to penalise until its first output: no real prompt token
            params, prompt = SamplingParams(repetition_penalty=1.5), [vocab + 1, vocab + 2]
        seq = Sequence(GenerationRequest(f"p{k}", prompt, params), k, k, Mode.GENERATE, time.time() + 60)
        seq.eos_token_ids = [2] if k % 3 else [2, 9]
        rows.join(seq)
        seqs.append(seq)
    changed = 0
    for step in range(7):
        order = rng.sample(seqs, len(seqs))
        slots = np.array([seq.row for seq in order])
        columns = rows.sampling_columns(slots).processors
        per_row = ProcessorInputs.from_rows([
            SamplingRow(seq.params, seq.seed, [t for t in seq.prompt_ids if t < vocab], seq.output_ids,
                        seq.eos_token_ids)
            for seq in order])
        logits = torch.randn(len(order), vocab, generator=torch.Generator().manual_seed(step)) * 3
        from_columns, from_rows = logits.clone(), logits.clone()
        apply_all(from_columns, columns)
        apply_all(from_rows, per_row)
        assert torch.equal(from_columns, from_rows), step
        changed += int((from_columns != logits).any(1).sum())
        tokens = np.array([rng.randrange(vocab) for _ in order])
        for seq, token in zip(order, tokens.tolist()):
            seq.token_ids.append(token)
        if step % 2:
            for seq in order:
                rows.write_token(seq)
        else:
            rows.append_tokens(slots, tokens)
    assert changed >= 40, "most rows were meant to ask for some control"


def test_the_seen_counts_follow_preemption_resume_fork_and_a_rewritten_token():
    """A penalised row's running counts (kept per appended token, not re-read from its context)
    after decode steps, a preemption and its resume, a fork, a token rewritten in place and a slot's
    counter row taken by another request: each equals its tokens counted afresh, and the penalties
    change the logits as the per-row path's."""
    vocab = 50
    blocks = BlockManager(num_blocks=40, block_size=BLOCK)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, rows=PersistentBatch(2, 40, vocab))
    rows = scheduler.rows
    params = SamplingParams(max_new_tokens=40, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.25)
    seq = Sequence(GenerationRequest("s", [5, 6, 5, vocab + 2, 7], params), 1, 0, Mode.GENERATE, time.time() + 60)
    seq.eos_token_ids = [2]
    scheduler.add(seq)

    def step(tokens: list[int]) -> None:
        batch = scheduler.schedule()
        scheduler.commit(batch)
        running = [s for s, due in zip((s for s, _ in batch.entries), batch.sampling) if due]
        for s, token in zip(running, tokens):
            s.token_ids.append(token)
        if batch.decode_only:
            rows.append_tokens(batch.slots, np.array(tokens[:len(running)]))
        else:
            for s in running:
                rows.write_token(s)
        check()

    def check() -> None:
        assert_matches_rebuild(rows, scheduler.running)
        running = sorted(scheduler.running, key=lambda s: s.row)
        logits = torch.randn(len(running), vocab, generator=torch.Generator().manual_seed(len(seq.token_ids))) * 3
        from_columns, from_rows = logits.clone(), logits.clone()
        apply_all(from_columns, rows.sampling_columns(np.array([s.row for s in running])).processors)
        apply_all(from_rows, ProcessorInputs.from_rows([
            SamplingRow(s.params, s.seed, [t for t in s.prompt_ids if t < vocab], s.output_ids, s.eos_token_ids)
            for s in running]))
        assert torch.equal(from_columns, from_rows)

    for token in (8, 5, 8, 9):
        step([token, token])
    assert seen_counts(rows, seq) == {5: 1, 6: 0, 7: 0, 8: 2, 9: 1}
    scheduler._preempt(seq, ScheduledBatch())  # its slot and counter row given back, its tokens kept
    step([8, 8])  # resumed: joined again, counted from its whole context
    assert seen_counts(rows, seq) == {5: 1, 6: 0, 7: 0, 8: 3, 9: 1}
    child = scheduler.fork(seq, PendingChoice(1, 7))
    child.token_ids.append(6)
    rows.write_token(child)
    check()
    seq.token_ids[-1] = 10  # the same position written again: its count moves, not a second token's
    rows.write_token(seq)
    check()
    assert seen_counts(rows, seq) == {5: 1, 6: 0, 7: 0, 8: 2, 9: 1, 10: 1}
    for token in (6, 10):
        step([token, token])
    scheduler.remove(seq)
    wide = list(range(11, 31))  # more distinct ids than the rows held: every row's pads widen with them
    plain = Sequence(GenerationRequest("t", wide, SamplingParams(frequency_penalty=1.0)), 2, 1, Mode.GENERATE,
                     time.time() + 60)
    plain.eos_token_ids = [2]
    scheduler.add(plain)  # takes the counter row seq left: none of seq's ids stay in it
    step([8, 8])
    assert seen_counts(rows, plain) == {**dict.fromkeys(wide, 0), 8: 1}


def test_decode_step_gathers_equal_the_sequences():
    """The decode inputs and stop verdicts from the arrays are those of the sequences."""
    blocks = BlockManager(num_blocks=30, block_size=BLOCK)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = []
    for k, (eos, stops, max_new) in enumerate([(2, [], 50), (11, [[7]], 50), (2, [], 2)]):
        request = GenerationRequest(f"d{k}", list(range(3, 9 + k)),
                                    SamplingParams(max_new_tokens=max_new, stop_token_ids=stops))
        seq = Sequence(request, 5, k, Mode.GENERATE, time.time() + 60)
        seq.eos_token_ids = [eos]
        scheduler.add(seq)
        seqs.append(seq)
    batch = scheduler.schedule()  # the prompts
    scheduler.commit(batch)
    for seq in seqs:
        seq.token_ids.append(20)
        scheduler.rows.write_token(seq)
    batch = scheduler.schedule()
    assert batch.decode_only
    ids, positions, slots = scheduler.rows.decode_inputs(batch.slots, BLOCK)
    assert ids.tolist() == [seq.token_ids[-1] for seq, _ in batch.entries]
    assert positions.tolist() == [seq.num_tokens - 1 for seq, _ in batch.entries]
    assert slots.tolist() == [blocks.slot(seq, seq.num_tokens - 1) for seq, _ in batch.entries]
    scheduler.commit(batch)
    sampled = np.array([2, 7, 30])  # d0: EOS; d1: its stop id (its EOS is 11); d2: its second token, its cap
    scheduler.rows.append_tokens(batch.slots, sampled)
    eos, stop, length = scheduler.rows.stops(batch.slots, sampled, max_model_len=1000, max_iter_times=1000)
    by_id = {seq.request_id: k for k, (seq, _) in enumerate(batch.entries)}
    assert [eos[by_id[r]] for r in ("d0", "d1", "d2")] == [True, False, False]
    assert [stop[by_id[r]] for r in ("d0", "d1", "d2")] == [False, True, False]
    assert [length[by_id[r]] for r in ("d0", "d1", "d2")] == [False, False, True]


def test_engine_steps_keep_the_arrays_equal_to_a_rebuild():
    """A tiny model's engine, a small pool (preemption), n choices, beams and stop ids: the arrays
    match the running sequences after every step, and every request ends."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=48, max_num_seqs=8,
                                    max_num_batched_tokens=64))
    specs = [dict(n=3, params=SamplingParams(max_new_tokens=14, temperature=0.8, seed=3)),
             dict(params=SamplingParams(max_new_tokens=12, beam_width=2)),
             dict(params=SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[[5], [6, 7]])),
             dict(params=SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True), priority=1),
             dict(params=SamplingParams(max_new_tokens=9, temperature=1.0, logprobs=2, repetition_penalty=1.3))]
    for k, spec in enumerate(specs * 2):
        engine.add_request(GenerationRequest(f"e{k}", list(range(10 + k, 40 + 3 * k)), **spec))
    finished = set()
    steps = 0
    while engine.has_work():
        finished |= {(o.request_id, o.index) for o in engine.step() if o.finished}
        assert_matches_rebuild(engine.rows, engine.scheduler.running)
        steps += 1
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to run out"
    assert {rid for rid, _ in finished} == {f"e{k}" for k in range(2 * len(specs))}
    assert engine.rows.num_running == 0


def test_a_resumed_prefill_whose_context_ends_in_one_uncached_token_hands_over():
    """PREFILL of a resumed request whose context is cached but for its last token: that step is
    one decode-like token per entry, and still ends in the hand-over to D, not a decoded token."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64, enable_prefix_caching=True))
    prompt = list(range(20, 28))  # two blocks
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.generate([GenerationRequest("whole", prompt, params)])["whole"].output_token_ids
    longer = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)  # not ended by its next token
    resumed = GenerationRequest("resumed", prompt, longer, resumed_output_ids=first[:5])  # 13 tokens: 12 cached
    out = engine.prefill([resumed])["resumed"]
    assert not out.finished and out.prefill is not None and out.new_token_ids == [first[5]]
    assert engine.blocks.counts().held == 0  # P keeps nothing


def streams(engine: LLMEngine, requests: list[GenerationRequest]) -> list[tuple]:
    """Every output of ``requests`` run together, in order, less the clock's fields."""
    for request in requests:
        engine.add_request(request)
    outputs = []
    while engine.has_work():
        for out in engine.step():
            outputs.append((out.request_id, out.index, out.new_token_ids, out.new_text, out.finished,
                            out.finish_reason, out.num_output_tokens, out.cumulative_logprob,
                            [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs], out.output_token_ids, out.text))
    return outputs


@pytest.mark.parametrize("array_stops_min_rows", [1, llm_engine.ARRAY_STOPS_MIN_ROWS])
def test_decode_steps_from_the_columns_give_the_per_row_outputs(monkeypatch, array_stops_min_rows):
    """The same requests through the column paths (the all-decode schedule, append_decoded) and
    through the per-row ones: every output equal, token, text piece, logprobs and end alike,
    with EOS, stop ids, stop strings (cut, kept) and length caps among the ends; the batch's stop
    arrays at every batch size (1), or from the engine's threshold on (smaller batches row by row)."""
    monkeypatch.setattr(llm_engine, "ARRAY_STOPS_MIN_ROWS", array_stops_min_rows)
    config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=256, max_num_seqs=16)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    end_id = LLMEngine(config).generate([GenerationRequest("q0", list(range(30, 42)), greedy)])["q0"].output_token_ids[5]
    specs = [SamplingParams(max_new_tokens=24, temperature=0.0, eos_token_id=end_id),  # ends at its 6th token
             SamplingParams(max_new_tokens=24, temperature=0.9, seed=5, logprobs=2),
             SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, stop=["e", "an"]),
             SamplingParams(max_new_tokens=24, temperature=1.0, seed=8, stop=[" "], include_stop_str_in_output=True),
             SamplingParams(max_new_tokens=24, temperature=1.0, seed=9, stop_token_ids=[[13], [29], [31]]),
             SamplingParams(max_new_tokens=6, temperature=1.0, seed=10, ignore_eos=True, logprobs=0)]
    runs = column_and_per_row_runs(config, specs)
    assert runs[0] == runs[1]
    ends = {out[5] for out in runs[0] if out[4]}
    assert {"eos_token", "stop_sequence", "length"} <= ends, ends


def column_and_per_row_runs(config: EngineConfig, specs: list[SamplingParams]) -> list[list[tuple]]:
    """The outputs (``streams``) of the same requests, two of each of ``specs``, through the column
    paths and through the per-row ones."""
    runs = []
    for per_row in (False, True):
        engine = LLMEngine(config)
        columns = engine._from_columns
        used = []
        if per_row:
            engine._from_columns = lambda batch: False
            engine.scheduler._all_decode = lambda ordered, budget: None
        else:
            engine._from_columns = lambda batch: used.append(columns(batch)) or used[-1]
        requests = [GenerationRequest(f"q{k}", list(range(30 + k, 42 + 2 * k)), params)
                    for k, params in enumerate(specs * 2)]
        runs.append(streams(engine, requests))
        if not per_row:
            assert sum(used) >= 5, "the column path was meant to run most decode steps"
    return runs


# Rows with penalties, biases and bans beside rows without any, greedy and seeded.
MIXED_CONTROLS = [
    SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=0.0, repetition_penalty=1.6, logit_bias={40: 2.5, 41: -1.0},
                   logprobs=3),
    SamplingParams(max_new_tokens=20, temperature=0.9, seed=4, presence_penalty=1.5, frequency_penalty=1.2),
    SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, logprobs=1),
    SamplingParams(max_new_tokens=20, temperature=1.0, seed=6, no_repeat_ngram_size=2, bad_words_ids=[[40], [41, 42]]),
    SamplingParams(max_new_tokens=20, temperature=0.0, min_new_tokens=15, repetition_penalty=0.6),
    SamplingParams(max_new_tokens=20, temperature=1.2, seed=7, logit_bias={3: 4.0}, min_new_tokens=8),
]


@pytest.mark.parametrize("array_stops_min_rows", [1, llm_engine.ARRAY_STOPS_MIN_ROWS])
def test_a_step_mixing_rows_with_penalties_biases_and_bans_stays_on_the_columns(monkeypatch, array_stops_min_rows):
    """Rows with penalties, logit biases, bans and min_new_tokens beside rows with none: their decode
    steps run from the columns, and every output (tokens, logprobs, ends) equals the per-row path's."""
    monkeypatch.setattr(llm_engine, "ARRAY_STOPS_MIN_ROWS", array_stops_min_rows)
    config = EngineConfig(model="tiny-llama", block_size=4, num_blocks=256, max_num_seqs=16)
    runs = column_and_per_row_runs(config, MIXED_CONTROLS)
    assert runs[0] == runs[1]
    assert any(out[8] for out in runs[0]), "some rows were meant to report logprobs"


def test_each_row_of_a_mixed_batch_gets_the_tokens_it_gets_alone():
    """fp32, batch invariance on: each request with penalties, biases or bans (or none) makes the
    same tokens and logprobs in the mixed batch as alone, so no row's controls reach another row."""
    config = EngineConfig(model="tiny-llama", dtype="float32", block_size=4, num_blocks=256, max_num_seqs=16,
                          batch_invariant=True)
    engine = LLMEngine(config)
    requests = [GenerationRequest(f"m{k}", list(range(30 + k, 42 + 2 * k)), params)
                for k, params in enumerate(MIXED_CONTROLS)]
    together = engine.generate(requests)
    for request in requests:
        alone = engine.generate([request])[request.request_id]
        mixed = together[request.request_id]
        assert alone.output_token_ids == mixed.output_token_ids, request.request_id
        assert alone.cumulative_logprob == mixed.cumulative_logprob, request.request_id
    assert together["m5"].num_output_tokens >= 15  # min_new_tokens held its EOS back
