"""The kill matrix: faults injected under load, each proven, against the failure contract.

Deploys the PD app (fp32 tiny-llama, 1 P, 2 D replicas) on loopback, runs the load once
without faults to get each request's reference text, then once per fault: ``--streams``
concurrent streams (both dialects, priorities 1..5, greedy and seeded), the fault injected
once they run (or, for P's rows, while they start), and for each row: requests sent / completed (the whole text of the
fault-free run) / ended with a clean error / lost (anything else: a hang, a raw error, a wrong
text), migrations, tokens repeated or dropped (a text that is not a prefix of the reference),
KV blocks held on P and D and object-store bytes once the load drained, and seconds from the
fault until a new request succeeds.

    python tools/faults.py [--streams 8] [--tokens 300] [--json PATH] [--only TEXT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
from dataclasses import dataclass
import json
from pathlib import Path
import signal
import sys
import threading
import time
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402
from ray import serve  # noqa: E402

from ray.serve.schema import ServeDeploySchema  # noqa: E402
from tests.serving import (RAY_INTERNALS, migrations, object_store_bytes, processes, serve_session, sigkill,  # noqa: E402
                           stopped, wait_until)

STARTED_EVENTS = 5  # events each stream has read before the fault
APP_ARGS = {"torch_threads": 1, "dtype": "float32", "embeddings": False, "pd_local_prefill_tokens": 0}


def bodies(streams: int, tokens: int) -> list[tuple[str, dict]]:
    """Alternating dialects, priorities 1..5, every other one seeded sampling."""
    out = []
    for i in range(streams):
        sampled = {"temperature": 0.8, "top_k": 40, "seed": 100 + i} if i % 2 else {"temperature": 0}
        if i % 4 < 2:
            out.append(("/v1/completions", {"model": "tiny-llama", "prompt": f"request {i}", "max_tokens": tokens,
                                            "ignore_eos": True, "priority": 1 + i % 5, **sampled}))
        else:
            extra = {"do_sample": True, **sampled} if i % 2 else {"do_sample": False}
            out.append(("/infer_token", {"input_id": [1, 30 + i, 31, 32], "parameters": {
                "max_new_tokens": tokens, "ignore_eos": True, "details": True, "priority": 1 + i % 5, **extra}}))
    return out


class Stream:
    """One streamed request: its text, whether it finished, how it ended."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.url, self.path, self.body = url, path, {**body, "stream": True}
        self.started = threading.Event()
        self.text, self.tokens, self.finished, self.error, self.raw = "", 0, False, None, None
        self.disconnect = False

    def run(self, go_on: threading.Event) -> "Stream":
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=300) as response:
                if response.status_code != 200:
                    self.error = response.read().decode()
                    return self
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if RAY_INTERNALS.search(line):
                        self.raw = line
                    self._read(json.loads(line[6:]))
                    if self.tokens == STARTED_EVENTS and not self.started.is_set():
                        self.started.set()
                        go_on.wait(120)
                        if self.disconnect:
                            return self
        except httpx.HTTPError as error:
            self.raw = f"{type(error).__name__}"
        finally:
            self.started.set()
        return self

    def _read(self, event: dict) -> None:
        if "error" in event:
            self.error = event["error"]["message"]
        elif self.path == "/infer_token":
            self.tokens += event["token"] is not None
            self.text += (event["token"] or {}).get("text") or ""  # the last event's text is null (seeds/000)
            details = event.get("details") or {}
            self.error = details.get("err_msg") if details.get("finish_reason") == "stop_sequence" else None
            self.finished = "generated_text" in event and not self.error
            if self.finished:
                self.text = event["generated_text"]  # the whole text, the last token's included
        else:
            choice = event["choices"][0]
            self.tokens += 1 if choice["text"] or choice["finish_reason"] is None else 0
            self.text += choice["text"]
            self.finished = choice["finish_reason"] is not None


def blocks_held() -> dict[str, int]:
    """KV blocks held, the most any replica reports over a few calls (the handle picks one per call)."""
    held = {}
    for name in ("PrefillServer", "DecodeServer"):
        handle = serve.get_deployment_handle(name, app_name="pd")
        held[name] = max(handle.stats.remote().result().blocks_used for _ in range(8))
    return held


def until_success(url: str, since: float) -> float:
    body = {"input_id": [1, 2, 3], "parameters": {"max_new_tokens": 2}}
    while time.monotonic() - since < 180:
        try:
            if httpx.post(f"{url}/infer_token", json=body, timeout=60).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return float("inf")


def timed_infer_token(url: str, body: dict, timeout_s: float) -> tuple[str, float]:
    """One /infer_token request: its outcome (the HTTP status, "raw" when the body shows Ray's
    internals, or the client's error) and its seconds."""
    start = time.monotonic()
    try:
        response = httpx.post(f"{url}/infer_token", json=body, timeout=timeout_s)
        outcome = "raw" if RAY_INTERNALS.search(response.text) else str(response.status_code)
    except httpx.HTTPError as error:
        outcome = type(error).__name__
    return outcome, time.monotonic() - start


def kill(process: psutil.Process) -> str:
    sigkill(process)
    return f"pid {process.pid} gone"


def kill_decode(_):
    return kill(processes("DecodeServer")[0])


def stop_decode_10s(_):
    (process, *_others) = processes("DecodeServer")
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while process.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.01)
    proof = f"pid {process.pid} {process.status()}"
    time.sleep(10)
    process.send_signal(signal.SIGCONT)
    return proof


def stop_every_decode_15s(streams):
    """Every D replica SIGSTOPped: none answers, so P serves alone (deployments/pd/decode_watch.py): the
    streams waiting on D move to P and new requests are prefilled and decoded there. The proof is
    /health saying "degraded" while they are stopped."""
    url = streams[0].url
    with stopped("DecodeServer"):
        degraded = wait_until(lambda: httpx.get(f"{url}/health", timeout=30).json().get("status") == "degraded",
                              30, 0.2)
        time.sleep(15)
    return f"{len(processes('DecodeServer'))} D stopped; /health {'degraded' if degraded else 'never degraded'}"


def stop_every_prefill_15s(streams):
    """Every P replica SIGSTOPped for 15 s while the streams run and a new request (a prompt no D
    holds) arrives every half second: D serves the new ones alone, prefilling them itself
    (deployments/pd/decode_watch.py's prefill watch). The proof: /health "degraded" while P is stopped, and
    "ok" again once it runs. Reports each new request's outcome and time, the seconds to "degraded"
    after the stop and to "ok" after SIGCONT."""
    url = streams[0].url

    def health() -> str:
        return httpx.get(f"{url}/health", timeout=30).json().get("status", "")

    def new_request(i: int) -> tuple[str, float]:
        return timed_infer_token(url, {"input_id": [1, 60 + i % 800, 61, 62, 63],
                                       "parameters": {"max_new_tokens": 16, "ignore_eos": True}}, 120)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        with stopped("PrefillServer"):
            stopped_at = time.monotonic()
            sent = [pool.submit(new_request, 0)]
            degraded = wait_until(lambda: health() == "degraded", 30, 0.1)
            degraded_after = time.monotonic() - stopped_at
            while time.monotonic() - stopped_at < 15:
                sent.append(pool.submit(new_request, len(sent)))
                time.sleep(0.5)
        resumed_at = time.monotonic()
        pd_again = wait_until(lambda: health() == "ok", 60, 0.1)
        pd_after = time.monotonic() - resumed_at
        answers = [future.result() for future in sent]
    served = [seconds for outcome, seconds in answers if outcome == "200"]
    return (f"{len(processes('PrefillServer'))} P stopped 15 s; /health degraded after {degraded_after:.2f} s"
            f"{'' if degraded else ' (never)'}, ok {pd_after:.2f} s after SIGCONT{'' if pd_again else ' (never)'}; "
            f"new requests meanwhile: {len(served)}/{len(answers)} answered 200, slowest "
            f"{max(seconds for _, seconds in answers):.2f} s, other outcomes "
            f"{sorted({outcome for outcome, _ in answers} - {'200'})}")


def kill_decode_while_requests_arrive(streams):
    """One D SIGKILLed, and a new request sent every half second until Serve runs two D again: none
    may be lost to the dead replica or to its replacement's start."""
    url = streams[0].url
    proof = kill(processes("DecodeServer")[0])
    body = {"input_id": [1, 40, 41, 42], "parameters": {"max_new_tokens": 16, "ignore_eos": True}}
    answers: list[int | str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            response = httpx.post(f"{url}/infer_token", json=body, timeout=120)
            answers.append("raw" if RAY_INTERNALS.search(response.text) else response.status_code)
        except httpx.HTTPError as error:
            answers.append(type(error).__name__)
        if len(processes("DecodeServer")) == 2 and answers[-1] == 200:
            break
        time.sleep(0.5)
    served = answers.count(200)
    return f"{proof}; {len(answers)} new requests until 2 D ran again: {served} served, {len(answers) - served} not"


def disconnect_half(streams):
    for s in streams[::2]:
        s.disconnect = True
    return f"{len(streams[::2])} clients left mid-decode"


def scale_prefill_down(_):
    """P's replicas 2 -> 1 by a config deploy that changes num_replicas alone (as `serve deploy` of
    an edited config does): Serve drains the replica it removes (graceful shutdown) and keeps every
    other process. The proof: the kept processes are the ones that ran before."""
    before = {name: {p.pid for p in processes(name)} for name in ("PrefillServer", "DecodeServer", "Ingress")}
    deploy(prefill_replicas=1)
    after = {name: {p.pid for p in processes(name)} for name in before}
    kept = all(after[name] <= before[name] for name in before) and after["DecodeServer"] == before["DecodeServer"]
    return (f"P replicas {len(before['PrefillServer'])} -> {len(after['PrefillServer'])}; "
            f"{'a scale-down: every other replica kept its process' if kept else 'a roll: replicas were replaced'}")


@dataclass
class Fault:
    """``when``: "running" (every stream has read its first events), "sent" (the streams were
    just sent), or a deployment held still (SIGSTOP) while the streams start, after which P is
    SIGKILLed. ``prepare`` runs before the streams."""

    when: str
    action: Callable | None = None
    prepare: Callable | None = None


FAULTS = {
    "SIGKILL D mid-stream (1 of 2 D)": Fault("running", kill_decode),
    "SIGSTOP D 10 s, then SIGCONT": Fault("running", stop_decode_10s),
    "SIGKILL D mid-stream, new requests until it is back": Fault("running", kill_decode_while_requests_arrive),
    "SIGSTOP every D 15 s (P serves alone), then SIGCONT": Fault("running", stop_every_decode_15s),
    "SIGSTOP every P 15 s (D serves alone), then SIGCONT": Fault("running", stop_every_prefill_15s),
    "clients disconnect mid-decode": Fault("running", disconnect_half),
    "SIGKILL P before its reply": Fault("PrefillServer"),
    "SIGKILL P after its reply, before D's fetch": Fault("DecodeServer"),
    "P scaled down 2 -> 1 during load": Fault("sent", scale_prefill_down, prepare=lambda: deploy(prefill_replicas=2)),
}


def run_row(url: str, name: str, work: list[tuple[str, dict]], references: list[str]) -> dict:
    fault = FAULTS[name]
    if fault.prepare:
        fault.prepare()
    before = migrations(url)
    streams = [Stream(url, path, body) for path, body in work]
    go_on = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        if fault.when in ("running", "sent"):
            futures = [pool.submit(s.run, go_on) for s in streams]
            if fault.when == "running":
                for s in streams:
                    s.started.wait(120)
            else:
                go_on.set()  # the fault comes while the first requests are still on P
            fault_at = time.monotonic()
            proof = fault.action(streams)
            go_on.set()
        else:
            # P held: nothing has replied yet. D held: P has replied to every stream, no D has fetched.
            with stopped(fault.when):
                go_on.set()
                futures = [pool.submit(s.run, go_on) for s in streams]
                if fault.when == "DecodeServer":
                    deadline = time.monotonic() + 120
                    while any(s.tokens == 0 for s in streams) and time.monotonic() < deadline:
                        time.sleep(0.05)
                fault_at = time.monotonic()
                proof = kill(processes("PrefillServer")[0])
        recovery = until_success(url, fault_at)
        concurrent.futures.wait(futures, timeout=300)
    left = [s for s in streams if s.disconnect]
    ran = [(s, ref) for s, ref in zip(streams, references) if not s.disconnect]
    completed = sum(s.finished and s.text == ref and not s.error for s, ref in ran)
    clean = sum(bool(s.error) and not s.raw for s, _ in ran)
    time.sleep(2)  # let the engines take the last aborts before reading their accounts
    return {"fault": name, "proof": proof, "sent": len(streams), "disconnected": len(left), "completed": completed,
            "clean_errors": clean, "lost": len(ran) - completed - clean,
            "migrations": migrations(url) - before,
            "texts_not_a_prefix": sum(not ref.startswith(s.text) for s, ref in zip(streams, references)),
            "raw_errors": sum(bool(s.raw) for s in streams), "blocks_held_after": blocks_held(),
            "object_store_bytes_after": object_store_bytes(), "seconds_to_next_success": round(recovery, 2)}


def deploy(prefill_replicas: int = 1) -> None:
    """The PD app as a Serve config applied to the controller, what `serve deploy` sends it (the
    dashboard's REST API, off in this session, would pass it on): its code version is the config's
    import path and runtime env, so a change of num_replicas alone scales, where ``serve.run`` of a
    Python app gives every deployment a new version and rolls every replica. Returns once the app runs
    P's and D's replicas."""
    config = ServeDeploySchema(applications=[{
        "name": "pd", "route_prefix": "/", "import_path": "deployments.app:build_pd_app", "args": APP_ARGS,
        "deployments": [{"name": "PrefillServer", "num_replicas": prefill_replicas},
                        {"name": "DecodeServer", "num_replicas": 2}]}])
    serve.context._get_global_client().deploy_apps(config)

    def running() -> bool:
        app = serve.status().applications.get("pd")
        return (app is not None and str(app.status).endswith("RUNNING") and len(processes("DecodeServer")) == 2
                and len(processes("PrefillServer")) == prefill_replicas)

    assert wait_until(running, 300, 0.5), f"the PD app did not run {prefill_replicas} P and 2 D within 300 s"


def reference_texts(url: str, work: list[tuple[str, dict]]) -> list[str]:
    texts = []
    for path, body in work:
        answer = httpx.post(url + path, json={**body, "stream": False}, timeout=300).json()
        texts.append(answer["generated_text"] if path == "/infer_token" else answer["choices"][0]["text"])
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", help="run only the rows whose name contains this text (e.g. 'scaled down')")
    args = parser.parse_args()
    work = bodies(args.streams, args.tokens)
    with serve_session() as url:
        deploy()
        references = reference_texts(url, work)
        baseline = {"blocks_held": blocks_held(), "object_store_bytes": object_store_bytes()}
        rows = []
        for name in [n for n in FAULTS if args.only is None or args.only in n]:
            rows.append(run_row(url, name, work, references))
            print(json.dumps(rows[-1]), flush=True)
            until_success(url, time.monotonic())
            while len(processes("DecodeServer")) < 2 or not processes("PrefillServer"):
                time.sleep(0.5)  # Serve replaced what was killed
    result = {"streams": args.streams, "tokens": args.tokens, "baseline": baseline, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(baseline))


if __name__ == "__main__":
    main()
