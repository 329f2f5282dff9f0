"""The page at GET / in a real headless browser (Debian's chromium, driven by selenium; `make test`
installs both): a message typed on the page streams its answer, which equals the same request's
answer from the API, and the phase rows drawn under it are the phases the ingress's trace recorded
(GET /traces/{id}), with their lengths. One PD app, with an API key: the page says it needs one
until it is typed; a long message goes through P, the KV hand-off and D (every phase drawn), a
short one stays on D (pd_local_prefill_tokens), its hand-off and D's queue drawn as absent."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
import os
from pathlib import Path
import tempfile

import httpx
import pytest
from ray import serve

from deployments.app import pd_app
from tests.serving import serve_session

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "page-test-key"
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}
PHASES = ["queue_ingress", "queue_prefill", "prefill", "kv_transfer", "queue_decode", "decode"]
LOCAL_PREFILL_TOKENS = 32  # prompts up to this long are computed on D, without P
SHORT = "Hi!"
LONG = ("Tell me about the sea: its waves, its tides, the wind over the harbour at night and the boats that "
        "come home before the storm.")
MAX_TOKENS = 12
ANSWER_WAIT_S = 120  # a bound on the wait for the page's answer, not a target
# Where the PD test saves its screenshot when asked; docs/web-page.png is of the real model (docs/operations.md).
SCREENSHOT = os.environ.get("PDSERVE_WEB_SCREENSHOT")


@pytest.fixture(scope="module")
def base_url():
    with serve_session() as url:
        # float32: the page's answer and the API's are compared token for token
        serve.run(pd_app({"torch_threads": 1, "max_iter_times": 64, "embeddings": False, "dtype": "float32",
                          "api_key": KEY, "pd_local_prefill_tokens": LOCAL_PREFILL_TOKENS}),
                  name="pd", route_prefix="/pd")
        yield url


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not CHROMEDRIVER.is_file():
        pytest.fail(f"{CHROMEDRIVER} is missing: `make test` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    with tempfile.TemporaryDirectory() as profile:
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--window-size=1000,900", f"--user-data-dir={profile}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
        try:
            yield driver
        finally:
            driver.quit()


def wait_for(driver, condition):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, ANSWER_WAIT_S, poll_frequency=0.2).until(lambda d: condition(d))


def ask_on_page(driver, message: str) -> dict:
    """Type the key and ``message`` (greedy, MAX_TOKENS) on the page and wait until it has answered:
    the answer shown, the response id, what it says of where the request ran, and each phase row in
    order: its state, its bars, its length."""
    from selenium.webdriver.common.by import By

    find = driver.find_element
    find(By.ID, "key").send_keys(KEY)
    find(By.ID, "prompt").send_keys(message)
    for field, value in (("max-tokens", MAX_TOKENS), ("temperature", 0)):
        find(By.ID, field).clear()
        find(By.ID, field).send_keys(str(value))
    find(By.ID, "send").click()
    state = wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state")
                     in ("done", "error") and d.find_element(By.TAG_NAME, "body").get_attribute("data-state"))
    assert state == "done", find(By.ID, "status").text
    rows = driver.find_elements(By.CSS_SELECTOR, "#rows .phase")
    return {"answer": find(By.ID, "answer").get_property("textContent"), "id": find(By.ID, "response-id").text,
            "where": find(By.ID, "where").text,
            "rows": [(row.get_attribute("data-phase"), row.get_attribute("data-state"),
                      len(row.find_elements(By.CLASS_NAME, "bar")), row.find_element(By.CLASS_NAME, "ms").text)
                     for row in rows]}


def api_answer(url: str, message: str) -> str:
    """The same request through the API, unstreamed."""
    model = httpx.get(f"{url}/pd/v1/models", headers=AUTHORIZED, timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    response = httpx.post(f"{url}/pd/v1/chat/completions", json=body, headers=AUTHORIZED, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def prompt_tokens(url: str, message: str) -> int:
    body = {"messages": [{"role": "user", "content": message}]}
    return httpx.post(f"{url}/pd/tokenize", json=body, headers=AUTHORIZED, timeout=30).json()["count"]


def recorded_phases(url: str, response_id: str) -> dict[str, str]:
    """The phases GET /traces/{id} recorded for the request, each with its length as the page writes it."""
    response = httpx.get(f"{url}/pd/traces/{response_id}", headers=AUTHORIZED, timeout=30)
    assert response.status_code == 200, response.text
    (request,) = response.json()["requests"]
    return {phase["name"]: milliseconds(phase["end"] - phase["start"]) for phase in request["phases"]}


def milliseconds(seconds: float) -> str:
    """As the page's JavaScript writes it: (seconds * 1000).toFixed(1), whose ties go up."""
    return f"{Decimal(seconds * 1000).quantize(Decimal('0.1'), ROUND_HALF_UP)} ms"


def expected_rows(recorded: dict[str, str]) -> list[tuple]:
    """One row per phase, in order: a recorded one drawn (one bar, its length), any other absent."""
    return [(name, "drawn", 1, recorded[name]) if name in recorded else (name, "absent", 0, "absent")
            for name in PHASES]


def test_the_page_asks_for_the_key_then_streams_through_p_and_d(base_url, browser):
    from selenium.webdriver.common.by import By

    browser.get(f"{base_url}/pd")  # the route prefix itself: every call goes below it
    assert browser.find_element(By.ID, "docs-link").get_attribute("href") == f"{base_url}/pd/docs"
    assert browser.find_element(By.ID, "metrics-link").get_attribute("href") == f"{base_url}/pd/metrics"
    assert "needs an API key" in wait_for(browser, lambda d: d.find_element(By.ID, "status").text)
    assert httpx.get(f"{base_url}/pd/traces/none", timeout=30).status_code == 401  # traces need the key too

    assert prompt_tokens(base_url, LONG) > 2 * LOCAL_PREFILL_TOKENS  # P computes it, whatever D caches
    shown = ask_on_page(browser, LONG)
    if SCREENSHOT:
        browser.save_screenshot(SCREENSHOT)
    assert shown["answer"] and shown["answer"] == api_answer(base_url, LONG)
    recorded = recorded_phases(base_url, shown["id"])
    assert list(recorded) == PHASES  # through P, the hand-off and D: every phase
    assert shown["rows"] == expected_rows(recorded)
    assert shown["where"].startswith("PD app: P computed the prompt")


def test_a_short_prompt_stays_on_d_and_its_handoff_is_drawn_absent(base_url, browser):
    browser.get(f"{base_url}/pd/")
    assert prompt_tokens(base_url, SHORT) <= LOCAL_PREFILL_TOKENS
    shown = ask_on_page(browser, SHORT)
    assert shown["answer"] and shown["answer"] == api_answer(base_url, SHORT)
    recorded = recorded_phases(base_url, shown["id"])
    assert "kv_transfer" not in recorded and "queue_decode" not in recorded and "prefill" in recorded
    assert shown["rows"] == expected_rows(recorded)
    assert shown["where"].startswith("PD app, no hand-off")
