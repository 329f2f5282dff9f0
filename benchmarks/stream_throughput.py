"""Does the serving path keep up with the engine? Concurrent streams served against the engine in-process.

Sends ``--concurrency`` streamed requests at once (``--input-len`` prompt ids, ``--output-len``
tokens each, sampled as the endpoints' defaults sample (temperature 1, no top-k or top-p), EOS
ignored) to the colocated app (``--app colocated``) or the PD app (``--app pd``: one P and one D,
each with ``--threads`` engine threads; ``--pd-local-prefill-tokens`` as the app's) over HTTP, ``--rounds`` times after one warm-up round, and runs the
same requests through the engine in this process (``LLMEngine.generate``, no asyncio, no Ray, no
HTTP; first, so that no Ray process is left running beside it). Prints output tokens per second of
each and their ratio (served / in-process): the serving path's share of the engine's throughput.
Both run in this one process tree, back to back: compare figures within one run (the machine may
be shared).

Where the served rounds' CPU went: the CPU seconds each process used during the measured rounds
(the engine replicas, the ingress, Serve's proxy and controller, Ray's own daemons, this client),
per second of the rounds (1.00 = one core busy) and per 1,000 output tokens.

    python benchmarks/stream_throughput.py [--app colocated|pd] [--model tiny-llama] [--concurrency 32]
                                           [--endpoint infer_token]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
import sys
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app import colocated_app, pd_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import GenerationRequest  # noqa: E402
from sampling import SamplingParams  # noqa: E402
from tests.serving import serve_session  # noqa: E402
from tools.clients import ENDPOINTS, send  # noqa: E402
from tools.loadgen import workloads  # noqa: E402


async def served_round(url: str, works, endpoint: str, model: str) -> tuple[int, float]:
    """(output tokens, seconds) of every request sent at once."""
    limits = httpx.Limits(max_connections=len(works) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, endpoint, w, model, 240) for w in works))
        elapsed = time.perf_counter() - start
    failed = [r.error or r.status for r in results if not r.ok]
    assert not failed, failed[:3]
    return sum(r.output_tokens for r in results), elapsed


def process_role(process: psutil.Process) -> str | None:
    """What a process on this machine is to the served app, by its Ray process title; None: not ours."""
    if process.pid == os.getpid():
        return "client (this script)"
    try:
        title = " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return None
    for marker, role in (("Ingress", "ingress"), ("LLMServer", "engine replica"), ("PrefillServer", "P replica"),
                         ("DecodeServer", "D replica"), ("ProxyActor", "Serve proxy"),
                         ("ServeController", "Serve controller"), ("raylet", "Ray daemons"),
                         ("gcs_server", "Ray daemons"), ("ray::", "other Ray workers")):
        if marker in title:
            return role
    return None


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of the processes ``process_role`` knows."""
    seconds = {}
    for process in psutil.process_iter():
        role = process_role(process)
        if role is None:
            continue
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds[process.pid] = (role, times.user + times.system)
    return seconds


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds used between the two readings, summed by role."""
    used: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        used[role] = used.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return used


def in_process_round(engine: LLMEngine, works, tag: str) -> tuple[int, float]:
    # The endpoints' defaults: temperature 1, no top-k or top-p (what the served requests run with).
    params = SamplingParams(max_new_tokens=works[0].output_len, ignore_eos=True)
    requests = [GenerationRequest(f"{tag}-{w.index}", w.input_ids, params) for w in works]
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    return sum(len(r.output_token_ids) for r in results.values()), elapsed


def served_app(args, engine_args: dict):
    """The app under test: colocated, or PD with one P and one D, each replica ``--threads`` CPUs."""
    options = {"ray_actor_options": {"num_cpus": args.threads}}
    if args.app == "colocated":
        return colocated_app(engine_args, options)
    local = {} if args.pd_local_prefill_tokens is None else {"pd_local_prefill_tokens": args.pd_local_prefill_tokens}
    return pd_app({**engine_args, **local}, options, options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", default="128")
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--endpoint", default="infer_token", choices=list(ENDPOINTS))
    parser.add_argument("--app", default="colocated", choices=["colocated", "pd"])
    parser.add_argument("--pd-local-prefill-tokens", type=int, default=None,
                        help="PD: prompts up to this many tokens are prefilled on D (default: the app's)")
    args = parser.parse_args()
    rounds = [workloads(args.concurrency, args.input_len, args.output_len, 100 + r, None, (3, 800))
              for r in range(args.rounds + 1)]  # fresh prompts per round: no prefix-cache hits across rounds
    engine_args = {"model": args.model, "dtype": args.dtype, "torch_threads": args.threads, "embeddings": False}
    engine = LLMEngine(AppArgs(**engine_args).engine_config())  # the served engine's configuration
    local = [in_process_round(engine, works, f"r{i}") for i, works in enumerate(rounds)]
    del engine
    with serve_session() as url:
        serve.run(served_app(args, engine_args), name="stream", route_prefix="/")
        served = [asyncio.run(served_round(url, works, args.endpoint, args.model)) for works in rounds[:1]]
        before = cpu_seconds()
        served += [asyncio.run(served_round(url, works, args.endpoint, args.model)) for works in rounds[1:]]
        used = cpu_by_role(before, cpu_seconds())
    served_rate = sum(t for t, _ in served[1:]) / sum(s for _, s in served[1:])
    local_rate = sum(t for t, _ in local[1:]) / sum(s for _, s in local[1:])
    print(f"{args.concurrency} streams x {args.output_len} tokens, {args.rounds} rounds after a warm-up, "
          f"{args.model} {args.dtype}, /{args.endpoint}, {args.app} app, {args.threads} engine thread(s)")
    print(f"served over HTTP + Ray Serve: {served_rate:8.1f} tok/s")
    print(f"engine in-process:            {local_rate:8.1f} tok/s")
    print(f"served / in-process:          {served_rate / local_rate:8.2f}")
    seconds, tokens = sum(s for _, s in served[1:]), sum(t for t, _ in served[1:])
    print("CPU of the measured served rounds, by process: cores busy, CPU ms per 1,000 output tokens")
    for role, cpu in sorted(used.items(), key=lambda item: -item[1]):
        print(f"  {role:<20} {cpu / seconds:5.2f} {1e6 * cpu / tokens:8.0f}")


if __name__ == "__main__":
    main()
