"""The page at GET / in a real headless browser (Debian's chromium, driven by selenium; `make test`
installs both): a message typed on the page streams its answer, and the phase rows drawn under it
are the phases the ingress's trace recorded (GET /traces/{id}), with their lengths. On the kept PD
app of the agent dialects (float32, every prompt through P) every phase is drawn and the answer
equals the same request's through the API; the key typed on the page goes as Bearer. On the kept
colocated OpenAI app the KV hand-off and D's queue are drawn as absent. No app of its own: both
are the suite's kept apps (tests/serving.py)."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
import json
import os
from pathlib import Path
import tempfile

import httpx
import pytest

from dialects.auth import is_open
from tests.serving import agents_app, openai_apps

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "page-test-key"  # typed on the page; these apps need none, and take a request that carries one
PHASES = ["queue_ingress", "queue_prefill", "prefill", "kv_transfer", "queue_decode", "decode"]
MESSAGE = "Tell me about the sea: its waves, its tides and the wind over the harbour at night."
MAX_TOKENS = 12
ANSWER_WAIT_S = 120  # a bound on the wait for the page's answer, not a target
# Where the PD test saves its screenshot when asked; docs/web-page.png is of the real model (docs/operations.md).
SCREENSHOT = os.environ.get("PDSERVE_WEB_SCREENSHOT")


@pytest.fixture(scope="module")
def pd_url() -> str:
    """PD in float32 (the page's answer and the API's are compared token for token), every prompt through P."""
    return agents_app()


@pytest.fixture(scope="module")
def colocated_url() -> str:
    return f"{openai_apps()}/co"


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not CHROMEDRIVER.is_file():
        pytest.fail(f"{CHROMEDRIVER} is missing: `make test` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # the requests the page sends
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


def ask_on_page(driver, url: str) -> dict:
    """Open the page at ``url``, type the key and MESSAGE (greedy, MAX_TOKENS) and wait until it has
    answered: the answer shown, the response id, what it says of where the request ran, each phase
    row in order (its state, its bars, its length) and the chat request's Authorization header."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    driver.get_log("performance")  # what earlier pages sent: read and dropped
    find = driver.find_element
    find(By.ID, "key").send_keys(KEY)
    find(By.ID, "prompt").send_keys(MESSAGE)
    for field, value in (("max-tokens", MAX_TOKENS), ("temperature", 0)):
        find(By.ID, field).clear()
        find(By.ID, field).send_keys(str(value))
    find(By.ID, "send").click()
    state = wait_for(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state")
                     in ("done", "error") and d.find_element(By.TAG_NAME, "body").get_attribute("data-state"))
    assert state == "done", find(By.ID, "status").text
    rows = driver.find_elements(By.CSS_SELECTOR, "#rows .phase")
    sent = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    (chat,) = [m["params"]["request"] for m in sent if m["method"] == "Network.requestWillBeSent"
               and m["params"]["request"]["url"].endswith("/v1/chat/completions")]
    return {"answer": find(By.ID, "answer").get_property("textContent"), "id": find(By.ID, "response-id").text,
            "where": find(By.ID, "where").text, "authorization": chat["headers"].get("Authorization"),
            "rows": [(row.get_attribute("data-phase"), row.get_attribute("data-state"),
                      len(row.find_elements(By.CLASS_NAME, "bar")), row.find_element(By.CLASS_NAME, "ms").text)
                     for row in rows]}


def api_answer(url: str) -> str:
    """The same request through the API, unstreamed."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def recorded_phases(url: str, response_id: str) -> dict[str, str]:
    """The phases GET /traces/{id} recorded for the request, each with its length as the page writes it."""
    response = httpx.get(f"{url}/traces/{response_id}", timeout=30)
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


def test_the_page_is_served_at_the_prefix_with_and_without_its_slash(colocated_url):
    """GET / answers the page itself, and so does the bare route prefix (redirected), without a
    key: auth leaves both open (with a key set, tests/test_api_key.py fetches it the same way)."""
    assert is_open("/") and is_open("")  # "": /co, the route prefix without its slash
    page = (Path(__file__).resolve().parents[1] / "deployments" / "web" / "index.html").read_text()
    for url in (colocated_url, f"{colocated_url}/"):
        served = httpx.get(url, timeout=60, follow_redirects=True)
        assert served.status_code == 200 and served.headers["content-type"].startswith("text/html"), url
        assert served.text == page, url


def test_pd_page_streams_the_answer_and_draws_p_the_handoff_and_d(pd_url, browser):
    from selenium.webdriver.common.by import By

    shown = ask_on_page(browser, pd_url)  # the route prefix itself, without its slash: calls go below it
    if SCREENSHOT:
        browser.save_screenshot(SCREENSHOT)
    assert browser.find_element(By.ID, "docs-link").get_attribute("href") == f"{pd_url}/docs"
    assert browser.find_element(By.ID, "metrics-link").get_attribute("href") == f"{pd_url}/metrics"
    assert shown["authorization"] == f"Bearer {KEY}"
    assert shown["answer"] and shown["answer"] == api_answer(pd_url)
    recorded = recorded_phases(pd_url, shown["id"])
    assert list(recorded) == PHASES  # through P, the hand-off and D: every phase
    assert shown["rows"] == expected_rows(recorded)
    assert shown["where"].startswith("PD app: P computed the prompt")


def test_colocated_page_draws_no_handoff(colocated_url, browser):
    shown = ask_on_page(browser, f"{colocated_url}/")
    assert shown["answer"]  # not compared: this app's dtype is the machine's, where a rerun may differ in bf16
    recorded = recorded_phases(colocated_url, shown["id"])
    assert "kv_transfer" not in recorded and "queue_decode" not in recorded and "prefill" in recorded
    assert shown["rows"] == expected_rows(recorded)
    assert shown["where"].startswith("Colocated app")
