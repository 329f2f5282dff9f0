"""LoRA adapters over HTTP on a real Ray Serve: named PEFT adapters (lora_modules) on the OpenAI
routes and /infer_token, TensorRT-LLM task ids (weights once, the id after) held by the app's
store and fetched by P and D, the store's eviction, and the refusals."""

import base64

import httpx
import numpy as np
import openai
import pytest

from deployments.app import colocated_app, pd_app
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora_adapter import ModelShape, from_peft, from_trtllm
from engine.request import GenerationRequest
from engine.execution.tiny_model import ensure_tiny_model
from sampling import SamplingParams
from tests.serving import assert_nothing_held, deploy, serve_session
from tests.test_lora import ALL, make_adapter, to_trtllm

PROMPT = [1, 450, 499, 173, 170, 110, 169, 97, 278]
NEW = 12
MAX_TASKS = 2
HIDDEN = 256  # tiny-llama's; its q projection is 256 x 256


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-loras")
    tiny = ensure_tiny_model()
    return {"style": make_adapter(tiny, root / "style", 3, 8, 16, ALL),
            "qv": make_adapter(tiny, root / "qv", 4, 4, 8, ["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def base_url(adapter_dirs):
    with serve_session() as url:
        args = {"torch_threads": 1, "embeddings": False, "pd_local_prefill_tokens": 0,
                "lora_modules": f"style={adapter_dirs['style']}", "max_lora_tasks": MAX_TASKS}
        deploy({"pd": pd_app(args), "co": colocated_app(args)}, together=False)  # memory, as test_real_model
        yield url


@pytest.fixture(scope="module")
def reference(adapter_dirs):
    """The served model and adapters in this process, with the served settings."""
    engine = LLMEngine(EngineConfig(model="tiny-llama"))
    style = from_peft("style", adapter_dirs["style"])
    weights, config = to_trtllm(from_peft("qv", adapter_dirs["qv"]))
    task = from_trtllm("task-11", weights, config, ModelShape.of(engine.loaded.spec))
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    out = engine.generate([GenerationRequest("base", PROMPT, params), GenerationRequest("style", PROMPT, params,
                                                                                       lora=style.ref),
                           GenerationRequest("task", PROMPT, params, lora=task.ref)], [style, task])
    assert len({o.text for o in out.values()}) == 3  # each adapter changes the text
    return {name: o.text for name, o in out.items()}, engine, (weights, config)


def encoded(values: np.ndarray) -> dict:
    return {"shape": list(values.shape), "dtype": "float32",
            "data": base64.b64encode(values.astype("<f4").tobytes()).decode()}


def infer(url: str, app: str, **parameters) -> httpx.Response:
    body = {"input_id": PROMPT, "parameters": {"max_new_tokens": NEW, "do_sample": False, "ignore_eos": True,
                                               **parameters}}
    return httpx.post(f"{url}/{app}/infer_token", json=body, timeout=120)


def test_named_adapter_on_models_chat_and_infer_token(base_url, reference, adapter_dirs):
    texts, engine, _ = reference
    for app in ("pd", "co"):
        client = openai.OpenAI(base_url=f"{base_url}/{app}/v1", api_key="unused", max_retries=0)
        cards = {m.id: m for m in client.models.list()}
        assert cards["style"].model_extra["parent"] == "tiny-llama"
        assert cards["style"].model_extra["root"] == str(adapter_dirs["style"])
        answer = client.completions.create(model="style", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.model == "style" and answer.choices[0].text == texts["style"]
        base = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert base.choices[0].text == texts["base"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        response = infer(base_url, app, lora_name="style")
        assert response.status_code == 200 and response.json()["generated_text"] == texts["style"], response.text


def test_task_weights_once_then_the_id_alone_on_p_and_d(base_url, reference):
    texts, _, (weights, config) = reference
    for app in ("pd", "co"):
        assert infer(base_url, app, lora_task_id=11).status_code == 400  # never given to this app yet
        first = infer(base_url, app, lora_task_id=11, lora_weights=encoded(weights), lora_config=config.tolist())
        assert first.status_code == 200 and first.json()["generated_text"] == texts["task"], first.text
        # The id alone: P and D (or the engine) take the adapter from the app's store, not from the request.
        for _ in range(2):
            again = infer(base_url, app, lora_task_id=11)
            assert again.status_code == 200 and again.json()["generated_text"] == texts["task"], again.text
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pd")  # every replica, each read directly
    assert_nothing_held(["LLMServer"], "co")


def test_the_oldest_task_is_forgotten_past_max_lora_tasks(base_url):
    weights = np.zeros((1, HIDDEN * 2), np.float32)  # a rank-1 q adapter that changes nothing
    for task in (21, 22, 23):
        response = infer(base_url, "pd", lora_task_id=task, lora_weights=encoded(weights), lora_config=[[1, 0, 1]],
                         max_new_tokens=2)
        assert response.status_code == 200, response.text
    forgotten = infer(base_url, "pd", lora_task_id=21, max_new_tokens=2)
    assert forgotten.status_code == 400 and forgotten.json()["error"]["param"] == "parameters.lora_task_id"
    assert "not cached" in forgotten.json()["error"]["message"]
    assert infer(base_url, "pd", lora_task_id=23, max_new_tokens=2).status_code == 200


@pytest.mark.parametrize("parameters, param", [
    ({"lora_name": "nope"}, "parameters.lora_name"),
    ({"lora_name": "style", "lora_task_id": 1}, "parameters.lora_name"),
    ({"lora_task_id": 5, "lora_config": [[1, 0, 1]]}, "parameters.lora_weights"),
    ({"lora_weights": encoded(np.zeros((1, HIDDEN * 2), np.float32)), "lora_config": [[1, 0, 1]]},
     "parameters.lora_task_id"),
    ({"lora_task_id": 5, "lora_weights": encoded(np.zeros((1, HIDDEN * 2), np.float32)), "lora_config": [[9, 0, 1]]},
     "parameters.lora_config"),  # module id 9: cross attention, which the model has not
    ({"lora_task_id": 5, "lora_weights": encoded(np.zeros((1, 10), np.float32)), "lora_config": [[1, 0, 1]]},
     "parameters.lora_weights"),  # too few values for the module
    ({"lora_task_id": 5, "lora_weights": encoded(np.zeros((1, 32 * HIDDEN * 2), np.float32)),
      "lora_config": [[1, 0, 32]]},
     "parameters.lora_weights"),  # rank 32 is over max_lora_rank (16)
    ({"lora_task_id": 5, "lora_weights": encoded(np.zeros((1, HIDDEN * 2), np.float32)), "lora_config": [[1, 7, 1]]},
     "parameters.lora_weights"),  # layer 7 of 4
])
def test_lora_mistakes_name_the_field(base_url, parameters, param):
    response = infer(base_url, "pd", max_new_tokens=2, **parameters)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
