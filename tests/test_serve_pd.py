"""The PD and colocated apps on a real Ray Serve, over HTTP."""

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest
from ray import serve

from deployments.app import colocated_app, pd_app
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, PromptTable
from sampling import SamplingParams
from tests.serving import (assert_nothing_held, deploy, element_size, serve_session, sse_events, stopped,
                           wait_until, work_done)

PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [300, 301], list(range(100, 131))]
LOOPING_PROMPT = [1, 5, 9, 30, 31, 32, 33, 5, 9, 30, 31, 7, 5, 9]  # tests/test_speculative.py's
CAP = 5  # max_iter_times of the "cap" apps
MAX_LOGITS_FLOATS = 5000  # the cap apps': 5 rows of tiny-llama's 891 logits fit, 6 do not


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        # no test here embeds: four replicas fewer to start; every prompt goes through P (none is prefilled on D)
        common = {"torch_threads": 1, "embeddings": False, "pd_local_prefill_tokens": 0}
        capped = {**common, "max_iter_times": CAP, "max_logits_floats": MAX_LOGITS_FLOATS}
        deploy({"pd": pd_app(common), "co": colocated_app(common), "pdcap": pd_app(capped),
                "cocap": colocated_app(capped)})
        yield url


@pytest.fixture(scope="module")
def reference_engine() -> LLMEngine:
    """The served model in this process, with the served settings: what each app must answer."""
    return LLMEngine(EngineConfig(model="tiny-llama"))


def infer(url, app, input_id, stream=False, **parameters):
    body = {"input_id": input_id, "stream": stream, "parameters": {"details": True, **parameters}}
    response = httpx.post(f"{url}/{app}/infer_token", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return sse_events(response) if stream else response.json()


def stream_tokens(events):
    return [e["token"]["id"] for e in events]


def test_pd_colocated_and_engine_agree_greedy(base_url):
    engine = LLMEngine(EngineConfig(model="tiny-llama"))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = engine.generate([GenerationRequest(str(i), p, params) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        for app in ("pd", "co"):
            events = infer(base_url, app, prompt, stream=True, max_new_tokens=12, do_sample=False, ignore_eos=True)
            assert stream_tokens(events) == expected[str(i)].output_token_ids
            assert events[-1]["generated_text"] == expected[str(i)].text
            text = infer(base_url, app, prompt, max_new_tokens=12, do_sample=False, ignore_eos=True)
            assert text["generated_text"] == expected[str(i)].text
            assert text["details"]["generated_tokens"] == 12


def test_stream_shape_first_event_is_prefill(base_url):
    events = infer(base_url, "pd", PROMPTS[1], stream=True, max_new_tokens=6, ignore_eos=True, seed=42)
    assert len(events) == 6
    assert events[0]["prefill_time"] > 0 and events[0]["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] >= 0 for e in events[1:])
    assert "generated_text" not in events[0] and "details" not in events[-2]
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": 42}
    assert events[-1]["token"]["text"] is None  # as seeds/000's example: generated_text has it all
    assert events[-1]["generated_text"].startswith("".join(e["token"]["text"] for e in events[:-1]))


def test_seeded_sampling_matches_between_pd_and_colocated(base_url):
    runs = [infer(base_url, app, PROMPTS[0], stream=True, max_new_tokens=10, temperature=0.9, top_k=40,
                  seed=7, ignore_eos=True) for app in ("pd", "co", "pd")]
    assert stream_tokens(runs[0]) == stream_tokens(runs[1]) == stream_tokens(runs[2])


def test_generated_tokens_follow_the_pd_rule(base_url):
    pd = infer(base_url, "pdcap", PROMPTS[0], max_new_tokens=100, ignore_eos=True)["details"]
    co = infer(base_url, "cocap", PROMPTS[0], max_new_tokens=100, ignore_eos=True)["details"]
    assert pd == {**pd, "finish_reason": "length", "generated_tokens": CAP + 1}
    assert co == {**co, "finish_reason": "length", "generated_tokens": CAP}
    # A limit from max_new_tokens counts P's token and D's together, in both.
    pd = infer(base_url, "pdcap", PROMPTS[0], max_new_tokens=3, ignore_eos=True)["details"]
    assert pd["generated_tokens"] == 3


def engine_stats(app, deployment):
    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result()


@pytest.mark.parametrize("app, engines", [("pd", ("DecodeServer", "PrefillServer")), ("co", ("LLMServer",))])
def test_client_disconnect_frees_blocks(base_url, app, engines):
    """The client goes away mid-stream: the engine that streams (D, or the colocated engine,
    reached over gRPC) stops the request and frees its blocks; P has freed its own already."""
    streaming = engines[0]
    aborted = engine_stats(app, streaming).finished_by_reason.get("abort", 0)
    body = {"input_id": PROMPTS[1], "stream": True, "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{base_url}/{app}/infer_token", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert wait_until(lambda: engine_stats(app, streaming).running == 1, 30)
    assert_nothing_held(list(engines), app)
    assert engine_stats(app, streaming).finished_by_reason.get("abort", 0) == aborted + 1  # stopped, not run out


def test_expired_deadline_ends_the_request_and_frees_blocks(base_url):
    """D is held still (SIGSTOP) from the stream's first token until past the request's deadline:
    the next step D makes ends the request with the timeout, whatever the machine's speed (no
    bound on the token count that a clock decides). Stopped for less than stall_timeout_s: the
    stream does not migrate."""
    body = {"input_id": PROMPTS[1], "stream": True,
            "parameters": {"details": True, "max_new_tokens": 1_000_000, "ignore_eos": True, "timeout": 1}}
    with httpx.stream("POST", f"{base_url}/pd/infer_token", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = next(lines)  # the request arrived before this: its deadline is at most 1 s away
        with stopped("DecodeServer"):
            time.sleep(2)  # not a bound on a result: it puts the deadline in the past while D cannot step
        events = [json.loads(line[len("data: "):]) for line in (first, *lines)]
    details = events[-1]["details"]
    assert details["finish_reason"] == "stop_sequence" and details["err_msg"] == "request timed out", details
    tokens = [e["token"] for e in events if e["token"] is not None]  # the last event says why it ended
    assert details["generated_tokens"] == len(tokens) < 1025  # 1025: the cap (max_iter_times, and P's token)
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd")


def test_kv_transfers_are_measured(base_url):
    handle = serve.get_deployment_handle("DecodeServer", app_name="pd")
    before = handle.kv_transfers.remote().result()
    fresh = list(range(200, 250))  # a prompt D holds none of: its whole KV is sent
    infer(base_url, "pd", fresh, max_new_tokens=4)
    after = handle.kv_transfers.remote().result()
    info = handle.info.remote().result()
    assert after["count"] == before["count"] + 1
    # tiny-llama: 4 layers x (k, v) x 50 tokens x 4 KV heads x 32 dims x the dtype's bytes ("auto": the CPU's)
    assert after["bytes"] - before["bytes"] == 4 * 2 * len(fresh) * 4 * 32 * element_size(info.dtype)
    assert after["seconds"] > before["seconds"] and info.model_id


def test_bad_input_is_a_400_naming_the_field_and_serving_goes_on(base_url):
    for app in ("pd", "co"):
        response = httpx.post(f"{base_url}/{app}/infer_token", json={"input_id": [5, 10**5]}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "input_id"
        assert infer(base_url, app, [5, 6], max_new_tokens=2)["details"]["generated_tokens"] == 2


def test_health(base_url):
    for app in ("pd", "co"):
        body = httpx.get(f"{base_url}/{app}/health", timeout=30).json()
        assert body["status"] == "ok" and 0 <= body["canary_age_s"] < 10


def test_pd_n_choices_share_one_prefill_and_d_reuses_imported_kv(base_url):
    """n = 3 through the PD app: P computes the prompt once, one KV transfer reaches D; the
    same prompt again finds its blocks in D's prefix cache (imported KV is cached there)."""
    decode = serve.get_deployment_handle("DecodeServer", app_name="pd")
    message = {"role": "user", "content": "three choices from one prefill, please. " * 6}
    body = {"model": "tiny-llama", "messages": [message], "n": 3, "seed": 5, "max_tokens": 6, "ignore_eos": True}
    p_before, d_before = engine_stats("pd", "PrefillServer"), engine_stats("pd", "DecodeServer")
    transfers_before = decode.kv_transfers.remote().result()["count"]
    response = httpx.post(f"{base_url}/pd/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in answer["choices"]}) > 1
    computed = engine_stats("pd", "PrefillServer").prompt_tokens_computed - p_before.prompt_tokens_computed
    assert 0 < computed <= prompt_tokens  # once for three choices (less where P's own cache hit)
    assert decode.kv_transfers.remote().result()["count"] - transfers_before == 1
    assert engine_stats("pd", "DecodeServer").prompt_tokens_computed == d_before.prompt_tokens_computed
    again = httpx.post(f"{base_url}/pd/v1/chat/completions", json=body, timeout=120).json()
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in answer["choices"]]
    hits = engine_stats("pd", "DecodeServer").prefix_cache_hits - d_before.prefix_cache_hits
    assert hits >= (prompt_tokens - 1) // 16 * 16 > 0
    models = httpx.get(f"{base_url}/pd/v1/models", timeout=30).json()["data"][0]
    assert models["dtype"] == engine_stats("pd", "PrefillServer").dtype and models["enable_prefix_caching"] is True


def decode_floats(encoded: dict) -> np.ndarray:
    """docs/api.md's encoding: base64 of little-endian float32, the shape beside it."""
    assert encoded["dtype"] == "float32"
    return np.frombuffer(base64.b64decode(encoded["data"]), dtype="<f4").reshape(encoded["shape"])


def test_logits_come_from_p_and_d_in_order_and_equal_one_engines(base_url, reference_engine):
    engine = reference_engine
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, return_context_logits=True,
                            return_generation_logits=True)
    engine.add_request(GenerationRequest("ref", PROMPTS[3], params))
    outputs = engine.run_to_completion()["ref"]
    context = outputs[0].context_logits  # [31, 891]
    generation = np.concatenate([o.generation_logits for o in outputs])[None]  # [1, 5, 891]
    for app in ("pd", "co"):
        for stream in (False, True):
            answer = infer(base_url, app, PROMPTS[3], stream=stream, max_new_tokens=5, do_sample=False,
                           ignore_eos=True, return_context_logits=True, return_generation_logits=True)
            details = answer[-1]["details"] if stream else answer["details"]
            assert details["context_logits"]["shape"] == [len(PROMPTS[3]), engine.vocab_size]
            assert details["generation_logits"]["shape"] == [1, 5, engine.vocab_size]
            np.testing.assert_allclose(decode_floats(details["context_logits"]), context, atol=1e-5, rtol=0)
            np.testing.assert_allclose(decode_floats(details["generation_logits"]), generation, atol=1e-5, rtol=0)
    plain = infer(base_url, "pd", PROMPTS[3], max_new_tokens=2)["details"]
    assert "context_logits" not in plain and "generation_logits" not in plain


@pytest.mark.parametrize("app", ["pdcap", "cocap"])
def test_logits_beyond_the_limit_are_refused_before_any_work(base_url, app):
    """PD may return max_iter_times + 1 tokens (P's first), colocated max_iter_times: 6 and 5 rows."""
    def ask(input_id, **parameters):
        body = {"input_id": input_id, "parameters": {"max_new_tokens": 100, **parameters}}
        return httpx.post(f"{base_url}/{app}/infer_token", json=body, timeout=120)

    engines = ("PrefillServer", "DecodeServer") if app == "pdcap" else ("LLMServer",)
    before = {engine: work_done(engine, app) for engine in engines}
    generation = ask(PROMPTS[0], return_generation_logits=True, ignore_eos=True)  # to the cap, whatever the model says
    if app == "pdcap":
        assert generation.status_code == 400
        assert generation.json()["error"]["param"] == "parameters.return_generation_logits"
        assert {engine: work_done(engine, app) for engine in engines} == before  # no engine saw the request
    else:
        assert generation.status_code == 200 and generation.json()["details"]["generation_logits"]["shape"][1] == CAP
        before = {engine: work_done(engine, app) for engine in engines}  # that one ran: count from here
    context = ask(PROMPTS[1], return_context_logits=True)  # 50 rows
    assert context.status_code == 400 and context.json()["error"]["param"] == "parameters.return_context_logits"
    assert {engine: work_done(engine, app) for engine in engines} == before
    assert ask(PROMPTS[0], return_context_logits=True).status_code == 200  # 4 rows


def beams_with_one_ended_early(engine: LLMEngine, prompt: list[int], width: int, new: int):
    """An end id the search meets (the best beam's nth token, for the first n that makes a beam end
    before ``new`` tokens), and the in-process engine's hypotheses with it."""
    free = SamplingParams(max_new_tokens=new, beam_width=width, ignore_eos=True)
    best = engine.generate([GenerationRequest("free", prompt, free)])["free"].output_token_ids
    for nth in range(new - 1):
        params = SamplingParams(max_new_tokens=new, beam_width=width, early_stopping=True, eos_token_id=best[nth])
        final = engine.generate([GenerationRequest(f"end{nth}", prompt, params)])[f"end{nth}"]
        if min(len(h.token_ids) for h in final.beams) < new:
            return best[nth], final.beams
    pytest.fail("no end id made a beam end early")


def test_beam_search_over_pd_and_colocated_equals_one_engine(base_url, reference_engine):
    engine = reference_engine
    end_id, beams = beams_with_one_ended_early(engine, PROMPTS[1], 3, 6)
    for app in ("pd", "co"):
        body = {"input_id": PROMPTS[1], "parameters": {
            "max_new_tokens": 6, "beam_width": 3, "early_stopping": 1, "end_id": end_id, "pad_id": 7,
            "return_log_probs": True, "return_generation_logits": True}}
        response = httpx.post(f"{base_url}/{app}/infer_token", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        details = answer["details"]
        assert details["sequence_length"] == [len(b.token_ids) for b in beams]
        longest = max(details["sequence_length"])
        assert details["output_ids"] == [b.token_ids + [7] * (longest - len(b.token_ids)) for b in beams]
        assert details["cum_log_probs"] == pytest.approx([b.cum_logprob for b in beams], abs=1e-4)
        assert [sum(lps) for lps in details["output_log_probs"]] == pytest.approx(details["cum_log_probs"], abs=1e-4)
        assert answer["generated_text"] == engine.tokenizer.decode(beams[0].token_ids, skip_special_tokens=True)
        assert details["generated_tokens"] == len(beams[0].token_ids)
        logits = decode_floats(details["generation_logits"])  # [beam_width, longest, vocab], zeros past an end
        assert logits.shape == (3, longest, engine.vocab_size)
        assert all(not logits[i, n:].any() and logits[i, :n].any() for i, n in enumerate(details["sequence_length"]))
    # Every beam's blocks are given back on P, D and the colocated engine (every replica, each read directly).
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd")
    assert_nothing_held(["LLMServer"], "co")


@pytest.mark.parametrize("parameters, stream, param", [
    ({"beam_width": 2, "top_k": 5}, False, "parameters.top_k"),
    ({"beam_width": 2, "do_sample": True}, False, "parameters.do_sample"),
    ({"beam_width": 2, "seed": 3}, False, "parameters.seed"),
    ({"beam_width": 2}, True, "stream"),
    ({"beam_width": 9}, False, "parameters.beam_width"),
    ({"pad_id": 3}, False, "parameters.pad_id"),
    ({"beam_width": 2, "pad_id": 100000}, False, "parameters.pad_id"),
    ({"beam_width": 2, "early_stopping": 2}, False, "parameters.early_stopping"),
])
def test_beam_search_refusals_name_the_field(base_url, parameters, stream, param):
    body = {"input_id": PROMPTS[0], "stream": stream, "parameters": {"max_new_tokens": 3, **parameters}}
    response = httpx.post(f"{base_url}/pd/infer_token", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def encoded_table(rows: int, hidden: int, dtype: str = "float32") -> tuple[dict, np.ndarray]:
    values = (np.random.default_rng(3).standard_normal((rows, hidden)) * 0.05).astype(dtype)
    wire = {"shape": [rows, hidden], "dtype": dtype, "data": base64.b64encode(values.astype("<" + values.dtype.str[1:])
                                                                              .tobytes()).decode()}
    return wire, values.astype(np.float32)


def test_prompt_table_over_pd_and_colocated_equals_one_engine(base_url, reference_engine):
    engine = reference_engine
    vocab, hidden = engine.vocab_size, engine.loaded.spec.hidden_size
    wire, values = encoded_table(4, hidden, "float16")  # TensorRT-LLM's table type
    ids = [vocab, vocab + 1, vocab + 2, vocab + 3] + PROMPTS[0]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    expected = engine.generate([GenerationRequest("t", ids, params, prompt_table=PromptTable.of(values))])["t"]
    plain = engine.generate([GenerationRequest("n", PROMPTS[0], params)])["n"]
    assert expected.output_token_ids != plain.output_token_ids  # the table changes the answer
    for app in ("pd", "co"):
        answer = infer(base_url, app, ids, max_new_tokens=8, do_sample=False, ignore_eos=True,
                       prompt_embedding_table=wire, prompt_vocab_size=4)
        assert answer["generated_text"] == expected.text


@pytest.mark.parametrize("change, param", [
    (lambda p, v: p.pop("prompt_vocab_size"), "parameters.prompt_vocab_size"),
    (lambda p, v: p.update(prompt_vocab_size=3), "parameters.prompt_embedding_table"),
    (lambda p, v: p["prompt_embedding_table"].update(data="***"), "parameters.prompt_embedding_table.data"),
    (lambda p, v: p["prompt_embedding_table"].update(shape=[4, 7]), "parameters.prompt_embedding_table.data"),
    (lambda p, v: p["prompt_embedding_table"].update(dtype="int8"), "parameters.prompt_embedding_table.dtype"),
    (lambda p, v: v.append(v[0] + 4), "input_id"),  # one past the table
])
def test_prompt_table_mistakes_name_the_field(base_url, reference_engine, change, param):
    wire, _ = encoded_table(4, reference_engine.loaded.spec.hidden_size)
    ids = [reference_engine.vocab_size, 5, 6]
    parameters = {"max_new_tokens": 2, "prompt_embedding_table": wire, "prompt_vocab_size": 4}
    change(parameters, ids)
    response = httpx.post(f"{base_url}/pd/infer_token", json={"input_id": ids, "parameters": parameters}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def spec_counts(url: str, app: str) -> dict[str, float]:
    """The speculative-decoding counters /metrics shows, by deployment."""
    text = httpx.get(f"{url}/{app}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_spec_decode_num_"):
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels] = float(value)
    return out


def test_draft_tokens_over_pd_and_colocated_stream_the_plain_tokens(base_url, reference_engine):
    """Drafts partly right: the same tokens, one event each; D (or the colocated engine) verified
    the drafts after P's first token, and /metrics counts them."""
    engine = reference_engine
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = engine.generate([GenerationRequest("d", PROMPTS[1], params)])["d"].output_token_ids
    drafts = expected[:6] + [(expected[6] + 1) % engine.vocab_size]  # 6 right, the 7th wrong
    for app, deployment in (("pd", "DecodeServer"), ("co", "LLMServer")):
        before = spec_counts(base_url, app)
        events = infer(base_url, app, PROMPTS[1], stream=True, max_new_tokens=12, do_sample=False, ignore_eos=True,
                       draft_input_ids=drafts)
        assert stream_tokens(events) == expected and events[-1]["details"]["generated_tokens"] == 12
        after = spec_counts(base_url, app)
        label = f'{{deployment="{deployment}"}}'
        # The first draft meets the prompt's token; the other 6 are verified in one step, 5 stand.
        assert after[f"pdserve_spec_decode_num_draft_tokens{label}"] - \
            before.get(f"pdserve_spec_decode_num_draft_tokens{label}", 0) == 6
        assert after[f"pdserve_spec_decode_num_accepted_tokens{label}"] - \
            before.get(f"pdserve_spec_decode_num_accepted_tokens{label}", 0) == 5
        seeded = dict(max_new_tokens=12, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
        assert infer(base_url, app, PROMPTS[3], prompt_lookup=True, **seeded)["generated_text"] == \
            infer(base_url, app, PROMPTS[3], **seeded)["generated_text"]
        # tiny-llama's greedy output loops, as a model copying from its context does: lookup drafts, and
        # the counters prove it did (equal text alone would pass with lookup doing nothing).
        looping = dict(max_new_tokens=24, do_sample=False, ignore_eos=True)
        before = spec_counts(base_url, app)
        assert infer(base_url, app, LOOPING_PROMPT, prompt_lookup=True, **looping)["generated_text"] == \
            infer(base_url, app, LOOPING_PROMPT, **looping)["generated_text"]
        after = spec_counts(base_url, app)
        for counter in ("num_draft_tokens", "num_accepted_tokens"):
            name = f"pdserve_spec_decode_{counter}{label}"
            assert after[name] > before.get(name, 0), counter
    # The server's cap inside an accepted run, with MindIE's P + D count.
    for app, cap in (("pdcap", CAP + 1), ("cocap", CAP)):
        answer = infer(base_url, app, PROMPTS[1], max_new_tokens=100, do_sample=False, ignore_eos=True,
                       draft_input_ids=expected[:8])
        assert answer["details"]["generated_tokens"] == cap and answer["details"]["finish_reason"] == "length"
        assert answer["generated_text"] == engine.tokenizer.decode(expected[:cap], skip_special_tokens=True)


@pytest.mark.parametrize("parameters, param", [
    ({"draft_input_ids": [5] * 9}, "parameters.draft_input_ids"),  # max_draft_tokens is 8
    ({"draft_input_ids": [100000]}, "parameters.draft_input_ids"),
    ({"draft_logits": {"shape": [1, 2], "dtype": "float32", "data": "AAAAAAAAAAA="}}, "parameters.draft_logits"),
    ({"draft_input_ids": [5], "draft_logits": {"shape": [1, 2], "dtype": "float32", "data": "AAAAAAAAAAA="}},
     "parameters.draft_logits"),
    ({"draft_input_ids": [5], "beam_width": 2}, "parameters.draft_input_ids"),
    ({"prompt_lookup": True, "beam_width": 2}, "parameters.prompt_lookup"),
])
def test_draft_mistakes_name_the_field(base_url, parameters, param):
    body = {"input_id": PROMPTS[0], "parameters": {"max_new_tokens": 3, **parameters}}
    response = httpx.post(f"{base_url}/pd/infer_token", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_lora_fields_need_an_app_with_enable_lora(base_url):
    response = httpx.post(f"{base_url}/pd/infer_token", json={"input_id": PROMPTS[0], "parameters": {
        "max_new_tokens": 2, "lora_task_id": 3}}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "parameters.lora_task_id"
    assert "enable_lora" in response.json()["error"]["message"]


@pytest.mark.slow
def test_streams_at_once_in_both_dialects_carry_the_engines_tokens(base_url, reference_engine):
    """Many streams at once, so that replicas fall behind their engines and send batches of outputs
    (the batching itself: tests/test_stream_coalescing.py): MindIE's streams still carry one event
    per token, OpenAI's completions with n=2 and logprobs are cut by a stop string, and every
    stream's tokens, text and counts are one engine's."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    plain = reference_engine.generate([GenerationRequest("plain", PROMPTS[1], greedy)])["plain"].text
    stop = plain[len(plain) // 2: len(plain) // 2 + 2]
    cut = reference_engine.generate([GenerationRequest("cut", PROMPTS[1], SamplingParams(
        max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1))])["cut"]
    assert cut.finish_reason == "stop_sequence" and 1 < cut.num_output_tokens < 16
    mindie = reference_engine.generate([GenerationRequest(str(i), p, SamplingParams(
        max_new_tokens=24, temperature=0.0, ignore_eos=True)) for i, p in enumerate(PROMPTS)])

    def infer_token(app: str, i: int) -> None:
        events = infer(base_url, app, PROMPTS[i], stream=True, max_new_tokens=24, do_sample=False, ignore_eos=True)
        assert stream_tokens(events) == mindie[str(i)].output_token_ids  # one event per token
        assert events[-1]["generated_text"] == mindie[str(i)].text and events[-1]["token"]["text"] is None
        assert mindie[str(i)].text.startswith("".join(e["token"]["text"] for e in events[:-1]))
        assert events[-1]["details"]["generated_tokens"] == 24

    def completions(app: str) -> None:
        c = openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="unused", max_retries=0)
        chunks = list(c.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=16, n=2, temperature=0,
                                           logprobs=1, stop=[stop], stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        texts, tokens, reasons = {0: "", 1: ""}, {0: 0, 1: 0}, {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                tokens[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert texts == {0: cut.text, 1: cut.text} and reasons == {0: "stop", 1: "stop"}
        assert tokens == {0: cut.num_output_tokens, 1: cut.num_output_tokens}
        assert chunks[-1].usage.completion_tokens == 2 * cut.num_output_tokens

    with ThreadPoolExecutor(16) as pool:
        calls = [pool.submit(infer_token, app, i) for app in ("pd", "co") for i in range(len(PROMPTS)) for _ in (0, 1)]
        calls += [pool.submit(completions, app) for app in ("pd", "co") for _ in (0, 1)]
        for call in calls:
            call.result()


# Last in the module: D's plan for this P-only request holds a prefix until the hold expires
# (kv_lease_s, 30 s), and every test that waits until nothing is held on "pd" would wait it out.
def test_first_token_finishing_at_p_never_reaches_d(base_url):
    """P computes the prompt and ends the request; no D replica decodes, computes or imports
    anything for it. D is asked for its plan (prefix-aware PD asks before P works, whatever
    max_new_tokens is: docs/serving.md), which holds a prefix until the hold expires."""
    decode = serve.get_deployment_handle("DecodeServer", app_name="pd")
    d_before, p_before = work_done("DecodeServer", "pd"), work_done("PrefillServer", "pd")
    transfers = decode.kv_transfers.remote().result()["count"]
    events = infer(base_url, "pd", PROMPTS[0], stream=True, max_new_tokens=1, ignore_eos=True)
    assert len(events) == 1 and events[0]["prefill_time"] is not None
    assert events[0]["details"]["generated_tokens"] == 1 and events[0]["details"]["finish_reason"] == "length"
    assert work_done("PrefillServer", "pd")["finished"] == p_before["finished"] + 1  # P ended it
    d_after = work_done("DecodeServer", "pd")
    assert {**d_after, "prefix_holds": 0} == {**d_before, "prefix_holds": 0}
    assert decode.kv_transfers.remote().result()["count"] == transfers


# ---- the timeout rule in every dialect (docs/api.md): after the first token, an error ------------

CHAT_MESSAGES = [{"role": "user", "content": "Count on."}]
TIMING_OUT = {  # each dialect's request that runs past its 1 s deadline: D is held still meanwhile
    "mindie": ("infer_token", {"input_id": PROMPTS[1],
                               "parameters": {"max_new_tokens": 1_000_000, "ignore_eos": True, "timeout": 1}}),
    "chat": ("v1/chat/completions", {"model": "tiny-llama", "messages": CHAT_MESSAGES, "ignore_eos": True,
                                     "timeout": 1}),
    "messages": ("v1/messages", {"model": "tiny-llama", "messages": CHAT_MESSAGES, "max_tokens": 1000,
                                 "temperature": 0.0, "timeout": 1}),
    "responses": ("v1/responses", {"model": "tiny-llama", "input": "Count on.", "temperature": 0.0, "timeout": 1}),
}


LIMIT_FIELD = {"responses": "max_output_tokens"}


@pytest.mark.slow
@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_a_stream_whose_deadline_passes_ends_with_the_dialects_error_event(base_url, dialect):
    """As test_expired_deadline_ends_the_request_and_frees_blocks for MindIE's stream: D is held
    still from the first event until past the deadline; the stream then ends in an error event,
    never in a normal ending, and nothing is held on P or D."""
    path, body = TIMING_OUT[dialect]
    # The route warmed up first (the ingress's first chat request loads the tokenizer), and 3 s to
    # the first token: the deadline is meant to pass after it, while D is held still.
    httpx.post(f"{base_url}/pd/{path}", json={**body, "timeout": 600, LIMIT_FIELD.get(dialect, "max_tokens"): 1},
               timeout=120).raise_for_status()
    with httpx.stream("POST", f"{base_url}/pd/{path}", json={**body, "stream": True, "timeout": 3},
                      timeout=120) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        next(lines)
        with stopped("DecodeServer"):
            time.sleep(4)  # not a bound on a result: it puts the deadline in the past while D cannot step
        events = [line[len("data: "):] for line in lines]
    if dialect == "chat":
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "timeout" and error["message"].startswith("request timed out")
        assert all(c["finish_reason"] is None for e in events[:-2] for c in json.loads(e)["choices"])
    else:
        last = json.loads(events[-1])
        kinds = [json.loads(e)["type"] for e in events]
        if dialect == "messages":
            assert last == {"type": "error", "error": {"type": "timeout_error", "message": last["error"]["message"]}}
            assert "message_stop" not in kinds
        else:
            assert last["type"] == "response.failed" and last["response"]["error"]["code"] == "timeout"
            assert "response.completed" not in kinds and "response.incomplete" not in kinds
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd")


@pytest.mark.slow
@pytest.mark.parametrize("dialect", ["mindie", "chat", "messages"])
def test_a_whole_answer_whose_deadline_passes_is_a_408_in_the_dialects_shape(base_url, dialect):
    """Whether the deadline passes before the first token or after it, the answer is the same 408."""
    path, body = TIMING_OUT[dialect]
    answers = []
    thread = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{base_url}/pd/{path}", json=body, timeout=120)))
    thread.start()
    try:
        assert wait_until(lambda: engine_stats("pd", "DecodeServer").running == 1, 30)
        with stopped("DecodeServer"):
            time.sleep(2)
    finally:
        thread.join(timeout=120)
    (answer,) = answers
    assert answer.status_code == 408, answer.text
    body = answer.json()
    if dialect == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "timeout_error"
    else:
        assert body["error"]["code"] == "timeout" and body["error"]["message"].startswith("request timed out")
    if dialect == "mindie":  # MindIE's form of an error beside it: an empty output, err_msg set
        assert body["generated_text"] == "" and body["details"]["finish_reason"] == "stop_sequence"
        assert body["details"]["err_msg"] == body["error"]["message"]
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd")
