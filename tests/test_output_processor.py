"""The output processor (engine/output_processor.py): the outputs a step builds, field by field."""

from dataclasses import fields
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
    other = new_output(base.copy())
    other.text = "changed"
    assert base["text"] is None and made.text is None


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
