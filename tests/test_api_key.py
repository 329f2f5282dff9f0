"""The API key: with one set, every model route answers 401 in its own dialect's shape without it
and serves with it (the openai and anthropic SDKs, httpx for /infer_token and /tokenize);
/health and /metrics stay open. The check itself (dialects/auth.py) without a server first."""

import anthropic
import httpx
import openai
import pytest

from deployments.app import colocated_app
from deployments.config import AppArgs
from dialects.auth import check_api_key, is_open, route_path
from dialects.errors import APIError
from tests.serving import deploy, serve_session

KEY = "sk-test-4f1c"
MODEL = "tiny-llama"


def refused(api_key, headers, x_api_key=False) -> bool:
    try:
        check_api_key(api_key, headers, x_api_key)
        return False
    except APIError as error:
        assert error.status == 401 and error.code == "invalid_api_key"
        return True


def test_the_check():
    assert not refused(None, {})  # no key set: everything is served
    assert not refused(KEY, {"authorization": f"Bearer {KEY}"}) and not refused(KEY, {"authorization": f"bearer {KEY}"})
    assert refused(KEY, {}) and refused(KEY, {"authorization": "Bearer wrong"}) and refused(KEY, {"authorization": KEY})
    assert refused(KEY, {"x-api-key": KEY})  # Anthropic's header only on Anthropic's routes
    assert not refused(KEY, {"x-api-key": KEY}, x_api_key=True)
    assert route_path({"path": "/pd/health", "root_path": "/pd"}) == "/health" and is_open("/health")
    assert not is_open("/v1/models") and not is_open("/tokenize")


def test_the_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert AppArgs().api_key is None
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert AppArgs().api_key.get_secret_value() == "from-env"
    assert AppArgs(api_key="given").api_key.get_secret_value() == "given"
    assert "from-env" not in repr(AppArgs())  # never printed with the arguments


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        deploy({"co": colocated_app({"torch_threads": 1, "max_iter_times": 16, "embeddings": False, "api_key": KEY})})
        yield f"{url}/co"


@pytest.mark.slow
def test_model_routes_need_the_key_in_each_dialect(base_url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with pytest.raises(openai.AuthenticationError) as error:
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).chat.completions.create(**chat)
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    served = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0).chat.completions.create(**chat)
    assert served.choices[0].message.content is not None

    message = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(**message)
    assert error.value.status_code == 401 and error.value.body["error"]["type"] == "authentication_error"
    answer = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0).messages.create(**message)
    assert answer.type == "message"  # the SDK sends x-api-key

    for path, body in (("/infer_token", {"input_id": [1, 5, 9], "parameters": {"max_new_tokens": 2}}),
                       ("/tokenize", {"prompt": "Hi"}), ("/v1/models", None)):
        call = (lambda **kw: httpx.get(f"{base_url}{path}", timeout=60, **kw)) if body is None else \
            (lambda **kw: httpx.post(f"{base_url}{path}", json=body, timeout=60, **kw))
        without = call()
        assert without.status_code == 401 and without.json()["error"]["code"] == "invalid_api_key", path
        if path == "/infer_token":  # MindIE's err_msg beside it, as its other errors
            assert without.json()["details"]["err_msg"] == without.json()["error"]["message"]
        assert without.headers["www-authenticate"] == "Bearer"
        assert call(headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path


@pytest.mark.slow
def test_operations_stay_open(base_url):
    assert httpx.get(f"{base_url}/metrics", timeout=60).status_code == 200
    assert httpx.get(f"{base_url}/health", timeout=60).status_code in (200, 503)  # open: never a 401
    assert httpx.get(f"{base_url}/openapi.json", timeout=60).status_code == 200


@pytest.mark.slow
def test_the_page_is_open_but_a_trace_needs_the_key(base_url):
    """The page at / asks for the key itself (tests/test_web_page.py drives it); what it reads needs it."""
    for page in (base_url, f"{base_url}/"):  # the bare prefix redirects to the page, without the key
        served = httpx.get(page, timeout=60, follow_redirects=True)
        assert served.status_code == 200 and "text/html" in served.headers["content-type"], page
        assert "<html" in served.text.lower() and "/v1/chat/completions" in served.text, page  # the page itself
    refused = httpx.get(f"{base_url}/traces/chatcmpl-none", timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    keyed = httpx.get(f"{base_url}/traces/chatcmpl-none", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert keyed.status_code == 404  # past the key: no such trace
