"""The OpenAI surface as today's clients speak it, each unmodified against the PD app: the
official openai client (sync and async), LangChain, lm-eval, aiperf and schemathesis.

The app runs in float32 so that scores can be compared with transformers' log_softmax.
"""

import base64
import json
import os
from pathlib import Path
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from deployments.app import pd_app
from deployments.replicas.embeddings import default_model_dir
from engine.execution.tiny_model import ensure_tiny_model
from tests.models import load_hf
from tests.serving import deploy, serve_session, sse_events

MODEL = "tiny-llama"
CAP = 16  # max_iter_times: keeps schemathesis' largest valid requests small
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Grüße, wie geht's?"}]


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        # stall_timeout_s: these are the clients' tests, not the stall watch's (test_faults, test_stalls): in a
        # full run the other worker starts whole Ray clusters beside this app, and a replica that takes a
        # call after 5 s there was taken for stalled three times, a 503 that aiperf counted as an error.
        deploy({"pd": pd_app({"torch_threads": 1, "max_iter_times": CAP, "dtype": "float32",
                              "pd_local_prefill_tokens": 0, "stall_timeout_s": 30})}, {"pd": "/"})
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.fixture(scope="module")
def hf_model():
    return load_hf(ensure_tiny_model(), torch.float32)


def hf_logprobs(hf_model, ids: list[int]) -> list[float]:
    """transformers' log_softmax of each token after the ones before it (from the second on)."""
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
    return logprobs[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


# ---- the official openai client -----------------------------------------------------------


def test_chat_takes_what_current_clients_send(base_url):
    """developer role, text parts, max_completion_tokens (wins over max_tokens), and the fields
    that change nothing here; the answer equals the plain request's."""
    c = client(base_url)
    plain = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    modern = c.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=CAP, max_completion_tokens=5, user="someone", store=False,
        metadata={"team": "a"}, service_tier="auto", parallel_tool_calls=False, prompt_cache_key="k",
        safety_identifier="s", extra_body={"ignore_eos": True},
        messages=[{"role": "developer", "content": MESSAGES[0]["content"]},
                  {"role": "user", "content": [{"type": "text", "text": "Grüße, "},
                                               {"type": "text", "text": "wie geht's?"}]}])
    assert modern.usage.completion_tokens == plain.usage.completion_tokens == 5
    assert modern.choices[0].message.content == plain.choices[0].message.content
    assert modern.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": MESSAGES, "store": True}, "store"),
    ({"messages": MESSAGES, "reasoning_effort": "low"}, "reasoning_effort"),
    ({"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": MESSAGES, "max_completion_tokens": CAP + 1}, "max_completion_tokens"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
])
def test_fields_that_need_what_this_server_lacks_are_refused_by_name(base_url, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client(base_url).chat.completions.create(model=MODEL, **body)
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"


def test_async_streams_are_shaped_as_openai_sends_them(base_url):
    """n=2 with logprobs and usage: role only in each choice's first chunk, every chunk has text
    or a finish reason, each token's logprob arrives once, usage last."""
    raw = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 6, "n": 2, "seed": 7, "stream": True, "logprobs": True,
        "top_logprobs": 2, "stream_options": {"include_usage": True}})
    assert raw.text.endswith("data: [DONE]\n\n")
    events = sse_events(httpx.Response(200, text=raw.text.removesuffix("data: [DONE]\n\n")))
    assert all("usage" in e for e in events) and events[-1]["choices"] == []
    roles, tokens = {0: 0, 1: 0}, {0: 0, 1: 0}
    for event in events[:-1]:
        assert event["usage"] is None
        (choice,) = event["choices"]
        assert choice["delta"].get("content") or choice["finish_reason"], event
        roles[choice["index"]] += "role" in choice["delta"]
        tokens[choice["index"]] += len((choice.get("logprobs") or {}).get("content") or [])
        if "role" in choice["delta"]:
            assert tokens[choice["index"]] <= len(choice["logprobs"]["content"])  # the choice's first chunk
    assert roles == {0: 1, 1: 1}
    assert sum(tokens.values()) == events[-1]["usage"]["completion_tokens"]

    async def whole_and_streamed():
        c = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        whole = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=7)
        stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=7,
                                                 stream=True)
        texts = {0: "", 1: ""}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return whole, texts

    import asyncio

    whole, texts = asyncio.run(whole_and_streamed())
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_completions_score_token_id_prompts_as_transformers_does(base_url, tokenizer, hf_model):
    """Token-id prompts (a list, and a batch of lists), echo with logprobs: every prompt token
    scored (the first null), max_tokens 0 generates nothing; max_tokens 1 adds one token."""
    prompts = [tokenizer.encode("The quick brown fox"), tokenizer.encode("jumps over", add_special_tokens=False)]
    c = client(base_url)
    scored = c.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == sum(len(p) for p in prompts)
    for choice, ids in zip(sorted(scored.choices, key=lambda ch: ch.index), prompts):
        lp = choice.logprobs
        assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(hf_logprobs(hf_model, ids), abs=1e-3)
        assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset)
    one = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = one.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompts[0]) + 1 and one.usage.completion_tokens == 1
    assert lp.token_logprobs[1:-1] == pytest.approx(hf_logprobs(hf_model, prompts[0]), abs=1e-3)
    # greedy: the generated token is the top one, as a scorer's is_greedy reads it
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=1)
    assert caught.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def test_best_of_returns_the_choices_of_highest_mean_logprob(base_url):
    c = client(base_url)
    made = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, n=3, seed=11, logprobs=0,
                                extra_body={"ignore_eos": True})
    means = {ch.text: np.mean(ch.logprobs.token_logprobs) for ch in made.choices}
    best = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, n=1, best_of=3, seed=11,
                                extra_body={"ignore_eos": True})
    assert [ch.text for ch in best.choices] == [max(means, key=means.get)]
    assert best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 18  # all three were generated
    with pytest.raises(openai.BadRequestError) as caught:
        c.completions.create(model=MODEL, prompt="x", n=2, best_of=3, stream=True)
    assert caught.value.body["param"] == "best_of"


def test_embeddings_of_token_ids_equal_sentence_transformers(base_url):
    from sentence_transformers import SentenceTransformer

    texts = ["a cat sat on the mat", "quarterly results"]
    embedder_tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    ids = [embedder_tokenizer(t)["input_ids"] for t in texts]
    expected = SentenceTransformer(str(default_model_dir()), device="cpu").encode(texts)
    response = client(base_url).embeddings.create(model="all-MiniLM-L6-v2", input=ids, user="someone")
    got = np.array([d.embedding for d in response.data])  # the client asks for base64 and decodes it
    assert np.abs(got - expected).max() < 1e-5
    assert response.usage.prompt_tokens == sum(len(i) for i in ids)
    raw = httpx.post(f"{base_url}/v1/embeddings", json={"input": ids[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(vector - expected[0]).max() < 1e-5
    with pytest.raises(openai.BadRequestError) as caught:
        client(base_url).embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=64)
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as caught:
        client(base_url).embeddings.create(model="all-MiniLM-L6-v2", input=[[1, 10**7]])
    assert caught.value.body["param"] == "input"


def test_models_are_retrieved_by_id_and_unknown_ones_are_openai_404s(base_url):
    c = client(base_url)
    assert c.models.retrieve(MODEL).id == MODEL
    assert {m.id for m in c.models.list()} == {MODEL, "all-MiniLM-L6-v2"}
    with pytest.raises(openai.NotFoundError) as caught:
        c.models.retrieve("gpt-4o")
    assert set(caught.value.body) == {"message", "type", "param", "code"}
    assert caught.value.body["code"] == "model_not_found"


# ---- LangChain --------------------------------------------------------------------------


def test_langchain_invoke_stream_and_batch(base_url):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", max_tokens=6, temperature=0,
                      max_retries=0)
    expected = client(base_url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                        temperature=0).choices[0].message.content
    lc_messages = [("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])]
    answer = chat.invoke(lc_messages)
    assert answer.content == expected
    assert answer.usage_metadata["output_tokens"] >= 1
    assert "".join(chunk.content for chunk in chat.stream(lc_messages)) == expected
    assert [m.content for m in chat.batch([lc_messages, lc_messages])] == [expected, expected]


# ---- lm-eval ----------------------------------------------------------------------------

CHOICE_DOCS = [{"question": "The color of the sky is", "choices": [" blue", " green", " loud"], "answer": 0},
               {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
               {"question": "Cats say", "choices": [" meow", " woof", " moo"], "answer": 0}]
TEXT_DOCS = [{"text": "It was the best of times, it was the worst of times."}, {"text": "Call me Ishmael."}]
GEN_DOCS = [{"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
            {"question": "Q: Name a prime number.\nA:", "answer": " 7"}]


def write_task(directory, name: str, docs: list[dict], output_type: str, fields: str) -> None:
    """An lm-eval task over a local JSON-lines file (nothing is fetched)."""
    (directory / f"{name}.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (directory / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / f'{name}.jsonl'}
test_split: test
output_type: {output_type}
{fields}""")


def write_tasks(directory) -> None:
    """loglikelihood (multiple choice), loglikelihood_rolling (perplexity) and generate_until."""
    write_task(directory, "pdserve_choice", CHOICE_DOCS, "multiple_choice", """doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    write_task(directory, "pdserve_ppl", TEXT_DOCS, "loglikelihood_rolling", """doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""")
    write_task(directory, "pdserve_gen", GEN_DOCS, "generate_until", """doc_to_text: "{{question}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
""")


@pytest.mark.slow
def test_lm_eval_local_completions_scores_equal_transformers(base_url, tmp_path, hf_model, monkeypatch):
    """lm-eval's defaults (token-id requests): each loglikelihood equals transformers' on the
    same tokens to 1e-3, acc follows from them, and generations are the server's."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    lm = LocalCompletionsAPI(base_url=f"{base_url}/v1/completions", model=MODEL, tokenizer=str(ensure_tiny_model()),
                             tokenizer_backend="huggingface", max_length=256)
    results = lm_eval.simple_evaluate(model=lm, tasks=["pdserve_choice", "pdserve_ppl", "pdserve_gen"],
                                      log_samples=True, task_manager=TaskManager(include_path=str(tmp_path)))
    correct = []
    for sample in results["samples"]["pdserve_choice"]:
        lls = []
        for (context, continuation), (ll, _) in zip(sample["arguments"], sample["filtered_resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            whole = context_ids + continuation_ids
            expected = sum(hf_logprobs(hf_model, whole)[len(context_ids) - 1:])
            assert float(ll) == pytest.approx(expected, abs=1e-3), (context, continuation)
            lls.append(expected)
        correct.append(int(np.argmax(lls)) == sample["target"])
    assert results["results"]["pdserve_choice"]["acc,none"] == pytest.approx(np.mean(correct))
    for sample in results["samples"]["pdserve_ppl"]:  # each document is one window after the prefix token
        ids = lm.tok_encode(sample["doc"]["text"])
        expected = sum(hf_logprobs(hf_model, [lm.prefix_token_id] + ids))
        assert float(sample["filtered_resps"][0]) == pytest.approx(expected, abs=1e-3)
    assert results["results"]["pdserve_ppl"]["word_perplexity,none"] > 1.0
    c = client(base_url)
    for sample in results["samples"]["pdserve_gen"]:
        context = sample["arguments"][0][0]
        expected = c.completions.create(model=MODEL, prompt=[lm.tok_encode(context)], max_tokens=8, temperature=0,
                                        stop=["\n"], seed=1234).choices[0].text
        assert sample["resps"][0][0] == expected


# ---- aiperf and schemathesis --------------------------------------------------------------


@pytest.mark.slow
def test_aiperf_profile_succeeds_and_reports_latencies(base_url, tmp_path):
    """aiperf against chat, the endpoint its users profile first (completions is driven by the openai
    SDK and lm-eval above: a second aiperf run, ~1-2 min of its start-up on two cores, proves no more)."""
    requests, endpoint = 8, "chat"
    command = [str(Path(sys.executable).parent / "aiperf"), "profile", "--model", MODEL, "--url", base_url,
               "--endpoint-type", endpoint, "--streaming", "--request-count", str(requests), "--concurrency", "2",
               "--tokenizer", str(ensure_tiny_model()), "--prompt-input-tokens-mean", "20", "--prompt-output-tokens-mean", "8",
               "--output-artifact-dir", str(tmp_path), "--no-auto-plot", "--random-seed", "1",
               # A random model may sample EOS first: an answer with no text, which aiperf counts as an error.
               "--extra-inputs", "ignore_eos:true",
               # One worker and one record processor, no UI, no metrics or GPU scrapes: fewer processes to
               # start on two cores (8 requests need no more; 21-25 s -> 18 s alone, benchmarks/RESULTS.md)
               "--workers-max", "1", "--record-processor-service-count", "1", "--ui-type", "none",
               "--no-server-metrics", "--no-gpu-telemetry"]
    # aiperf 0.13 in HF offline mode reads a local tokenizer path as a hub id and fails; the
    # path is local, so nothing is fetched without it either.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [] and report.get("error_request_count") is None
    assert report["completed_request_count"]["avg"] == requests
    assert report["time_to_first_token"]["count"] == requests and report["time_to_first_token"]["avg"] > 0
    assert report["inter_token_latency"]["avg"] > 0


@pytest.mark.slow
def test_schemathesis_finds_no_failing_check(base_url, tmp_path):
    """Every check of the schema (server errors, undocumented status codes and content types,
    response bodies against their schemas) over generated requests to every operation. It runs
    in a fresh folder: schemathesis keeps a cache of past failures in its working directory."""
    command = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{base_url}/openapi.json", "--checks", "all",
               "--max-examples", "15", "--generation-deterministic", "--request-timeout", "300",
               # the largest valid request (64 prompts x best_of 128) takes about a minute on 2 cores
               "--max-response-time", "300", "--no-color"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:]
