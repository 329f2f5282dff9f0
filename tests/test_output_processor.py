"""The output processor (engine/output_processor.py): the outputs a step builds, field by field."""

from dataclasses import fields
import itertools
import random
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import ABORT, RequestOutput, TokenLogprob, new_output, output_base
from engine.request import GenerationRequest
from sampling import SamplingParams


def test_an_output_from_its_base_equals_the_dataclass_made_with_keywords():
    """``new_output(output_base(...))``, the step's constructor, has every field of the dataclass,
    each default where not given; and two outputs from one base share no dict."""
    logprob = TokenLogprob(5, -0.5, [(5, -0.5)])
    given = dict(request_id="r", new_token_ids=[5], new_text="a", num_output_tokens=2, finished=False,
                 finish_reason=None, seed=3, logprobs=[logprob], index=1, arrival_time=1.0)
    base = output_base(request_id="r", seed=3, index=1, arrival_time=1.0)
    made = new_output(base | {k: v for k, v in given.items() if k not in base or base[k] != v})
    assert made == RequestOutput(**given)
    assert set(vars(made)) == {f.name for f in fields(RequestOutput)}
    assert "logprobs" not in base  # a factory's field: each output's own list
    other = new_output(base | {"logprobs": []})
    other.text = "changed"
    other.logprobs.append(logprob)
    assert base["text"] is None and made.text is None and made.logprobs == [logprob]


def test_a_requests_outputs_keep_its_clock_and_are_objects_of_their_own():
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=64))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    engine.add_request(GenerationRequest("a", list(range(20, 30)), params))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert len(outputs) == 6 and len({id(vars(out)) for out in outputs}) == 6
    first = outputs[0]
    assert first.first_token_time is not None and first.scheduled_time is not None
    assert all((out.first_token_time, out.scheduled_time, out.arrival_time, out.seed) ==
               (first.first_token_time, first.scheduled_time, first.arrival_time, first.seed) for out in outputs)
    assert [out.num_output_tokens for out in outputs] == list(range(1, 7))
    assert [len(out.logprobs) for out in outputs] == [1] * 6
    assert outputs[-1].cumulative_logprob == sum(out.logprobs[0].logprob for out in outputs)
    assert [out.finished for out in outputs] == [False] * 5 + [True]
    # One still waiting when it ends: no scheduled time, no first token.
    engine.add_request(GenerationRequest("b", list(range(20, 30)), params, deadline=time.time() + 60))
    (ended,) = engine.abort("b")
    assert (ended.finish_reason, ended.scheduled_time, ended.first_token_time) == (ABORT, None, None)


def test_each_choices_outputs_come_in_order_end_once_and_an_abort_mid_flight_ends_it_once():
    """Requests (n choices, stop strings, logprobs) stepped together while some are aborted mid-flight:
    each choice's outputs count up one token at a time, add up to its last output's tokens and text,
    and stop at its one finished output; an aborted request's running choices end once, with abort,
    and a second abort finds nothing."""
    rng = random.Random(5)
    engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=4, num_blocks=128, max_num_seqs=8))
    specs = [dict(params=SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)),
             dict(n=2, params=SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, logprobs=1)),
             dict(params=SamplingParams(max_new_tokens=16, temperature=1.0, seed=4, stop=["e"]))]
    for k in range(12):
        engine.add_request(GenerationRequest(f"r{k}", list(range(20 + k, 31 + k)), **specs[k % 3]))
    outputs: dict[tuple[str, int], list[RequestOutput]] = {}
    aborted = set()
    while engine.has_work():
        step = engine.step()
        running = engine.active_request_ids()
        if running and rng.random() < 0.3:
            victim = rng.choice(running)
            aborted.add(victim)
            ends = engine.abort(victim)
            assert ends and all(out.finished and out.finish_reason == ABORT for out in ends)
            assert engine.abort(victim) == []
            step += ends
        for out in step:
            outputs.setdefault((out.request_id, out.index), []).append(out)
    assert aborted and {rid for rid, _ in outputs} == {f"r{k}" for k in range(12)}
    for (rid, index), outs in outputs.items():
        counts = [out.num_output_tokens for out in outs]
        assert counts == list(itertools.accumulate(len(out.new_token_ids) for out in outs)), (rid, counts)
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True], (rid, index)
        last = outs[-1]
        assert sum((out.new_token_ids for out in outs), []) == last.output_token_ids
        assert "".join(out.new_text for out in outs) == last.text
        assert (last.finish_reason == ABORT) <= (rid in aborted)
    assert any(len(outs) > 1 and outs[-1].finish_reason == ABORT for outs in outputs.values()), "no abort mid-flight"
    assert engine.blocks.counts().held == 0
