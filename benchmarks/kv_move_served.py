"""D scaled down 2 -> 1 while ``--streams`` streams decode, served: issue 54 item 4's served figure.

Starts a Ray of its own (loopback) and the PD app (deployments/app.py ``pd_app``: 1 ingress, 1 P,
2 D) of ``--model``, batch-invariant (each request's tokens independent of the batch it runs in, so
the undisturbed run is the reference), every prompt through P (``pd_local_prefill_tokens`` 0). Sends
``--streams`` streamed greedy /v1/completions at once (``--prompt`` prompt tokens of their own,
``--output`` tokens each, EOS ignored): first undisturbed (the reference texts and TPOT), then again,
and once every stream has ``--move-after`` tokens, redeploys the app with one D, in place (the
deployments' code version fixed, as tests/test_faults.py's scale-down does: ``versioned``). Serve
drains one D; it hands each running request (KV, tokens so far, sampler state) to the other.

Prints one JSON object per run, and the drained run's figures against the issue's targets:
streams completed / lost (ended short, no error) / errored; texts identical to the reference; the
streams moved (their trace's KV transfer is the move's: more bytes than their prompt's), choices
moved / failed (``pdserve_kv_moves``) and token replays (``pdserve_request_migrations_total``); KV
bytes moved against the resident KV (the drained D's ``blocks_used``, read directly every
``POLL_S`` until it hands its requests over, times the bytes of a block); prompt tokens computed
after the trigger by P and by each D (0 expected); the largest inter-token gap and the median TPOT
of the moved streams and of the unmoved ones (client-side, per SSE event).

    flock /tmp/pdserve-heavy.lock timeout 900 python benchmarks/kv_move_served.py \
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--streams 32] [--prompt 128] [--output 160]
        [--move-after 32] [--json PATH]

The moved KV goes by reference (docs/serving.md, "Live KV moves off a draining D"), so the moves
work at Ray Serve's default replica gRPC message limit (4 MiB): no setting needed. Before (issue 54
session 6) they went by value and needed ``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH`` raised.

Bounded: every stream by ``STREAM_TIMEOUT_S``, the drain by ``DRAIN_TIMEOUT_S``; Ray and every
replica end with the script, on SIGTERM too (ray.init's handler exits; the session's ``finally``
shuts its Ray down).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
import json
from pathlib import Path
import pickle
import random
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from benchmarks.cli import arguments, bench_parser, write_json  # noqa: E402
from deployments.app import pd_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from tests.serving import deploy, migrations, pd_metric, replicas, serve_session, versioned, wait_until, work_done  # noqa: E402

APP = "kvmove"
STREAM_TIMEOUT_S = 600  # one stream, start to end
DRAIN_TIMEOUT_S = 120  # the trigger to the drained D holding no request
POLL_S = 0.05  # how often the D replicas' engine stats are read while the drain runs
RAY_CPUS = 8  # logical: 1 ingress + 1 P + 2 D at one each, room to spare


def the_app(model: str, decode_replicas: int):
    """The PD app with ``decode_replicas`` D replicas, at one code version (a redeploy with fewer D
    is a scale-down in place, not a new app)."""
    return versioned(pd_app(app_args(model), decode_options={"num_replicas": decode_replicas}), APP)


def app_args(model: str) -> dict:
    return {"model": model, "torch_threads": 1, "embeddings": False, "batch_invariant": True,
            "pd_local_prefill_tokens": 0, "pd_decode_prefix_reuse": False}


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    index: int
    completion_id: str = ""
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each event with text
    tokens: int = 0  # completion_tokens of the usage chunk
    finish: str | None = None
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.error and self.finish == "length"

    def gaps(self) -> list[float]:
        """Seconds between consecutive events with text (an event may carry several tokens)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.tokens < 2 or len(self.arrivals) < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (self.tokens - 1)


async def one_stream(client: httpx.AsyncClient, model: str, prompt: list[int], output: int, record: Stream) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = json.dumps(event["error"])[:200]
                    return
                record.completion_id = event.get("id", record.completion_id)
                if event.get("usage"):
                    record.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice["text"]:
                        record.arrivals.append(time.monotonic())
                        record.text += choice["text"]
                    record.finish = choice["finish_reason"] or record.finish
    except (httpx.HTTPError, OSError) as error:
        record.error = f"{type(error).__name__}: {error}"


async def run_streams(url: str, model: str, prompts: list[list[int]], output: int,
                      on_progress=None) -> list[Stream]:
    """Every prompt streamed at once; ``on_progress(streams)``, if given, runs beside them (its
    result is awaited before returning)."""
    streams = [Stream(i) for i in range(len(prompts))]
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=STREAM_TIMEOUT_S, limits=limits) as client:
        sending = [asyncio.wait_for(one_stream(client, model, p, output, s), STREAM_TIMEOUT_S)
                   for p, s in zip(prompts, streams)]
        beside = [on_progress(streams)] if on_progress else []
        results = await asyncio.gather(*sending, *beside, return_exceptions=True)
    for stream, result in zip(streams, results):
        if isinstance(result, BaseException):
            stream.error = stream.error or f"{type(result).__name__}: {result}"
    for result in results[len(streams):]:
        if isinstance(result, BaseException):
            raise result
    return streams


def replica_stats(actor):
    """The engine stats of one replica actor, by the handle kept from before its drain (the drained
    replica's name leaves Serve's names; tests/serving.py's ``call_replica`` looks it up by name)."""
    from ray.serve._private.common import RequestMetadata

    call_id = uuid.uuid4().hex
    metadata = RequestMetadata(request_id=call_id, internal_request_id=call_id, call_method="stats", app_name=APP)
    return ray.get(actor.handle_request.remote(pickle.dumps(metadata)), timeout=30)


class DrainWatch:
    """Both D replicas' engine stats read every ``POLL_S`` from the trigger on, until Serve has named
    the drained one and it holds no request, or it has ended (or ``DRAIN_TIMEOUT_S``): readings
    (seconds since ``start``, blocks_used, requests, prompt_tokens_computed) per replica name."""

    def __init__(self, actors: dict, start: float) -> None:
        self.actors, self.start = actors, start
        self.readings: dict[str, list[tuple[float, int, int, int]]] = {name: [] for name in actors}
        self.drained: str | None = None
        self.named_out_at: float | None = None  # when the drained D left Serve's names
        self.thread = threading.Thread(target=self._run, name="drain-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            ended = set()
            for name, actor in self.actors.items():
                try:
                    stats = replica_stats(actor)
                except Exception:  # noqa: BLE001 - the replica has ended
                    ended.add(name)
                    continue
                self.readings[name].append((time.monotonic() - self.start, stats.blocks_used, stats.requests,
                                            stats.prompt_tokens_computed))
            if self.drained is None and len(left := replicas("DecodeServer", APP) & set(self.actors)) == 1:
                (self.drained,) = set(self.actors) - left
                self.named_out_at = time.monotonic() - self.start
            if self.drained is not None and (self.drained in ended or self.handed_over()):
                return
            time.sleep(POLL_S)

    def handed_over(self) -> bool:
        readings = self.readings[self.drained]
        return any(r[2] for r in readings) and readings[-1][2] == 0


def resident_before_move(readings: list[tuple[float, int, int, int]]) -> tuple[float, int, int] | None:
    """The drained D's last reading (``DrainWatch.readings``) before its first request left:
    (seconds, blocks_used, requests); None if it held none when first read."""
    if not readings or not readings[0][2]:
        return None
    return [r for r in readings if r[2] == readings[0][2]][-1][:3]


def moved_streams(traces: dict[int, dict], prompt: int) -> tuple[dict[int, int], float | None]:
    """Which streams moved, and the KV bytes per token. A stream's trace keeps its last KV transfer:
    P's (the prompt's KV) unless a move's followed it (the prompt's and the tokens' so far), so a
    stream moved iff its trace's KV bytes exceed ``prompt`` tokens' worth. Returns {stream: KV bytes
    of its move} for the moved, and the bytes of one token's KV (None: no trace had KV bytes)."""
    sizes = {i: t["kv_bytes"] for i, t in traces.items() if t.get("kv_bytes")}
    if not sizes:
        return {}, None
    per_token = min(sizes.values()) / prompt
    return {i: size for i, size in sizes.items() if size > prompt * per_token}, per_token


def timing(streams: list[Stream], since: float | None = None) -> dict:
    """The largest inter-token gap and the median TPOT of ``streams`` (ms); with ``since`` (a
    time.monotonic()), when the largest gap began, in seconds after it."""
    gaps = [(b - a, a) for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    tpots = [t for s in streams if (t := s.tpot()) is not None]
    result = {"streams": len(streams), "largest_gap_ms": round(max(gaps)[0] * 1e3, 1) if gaps else None,
              "median_tpot_ms": round(statistics.median(tpots) * 1e3, 1) if tpots else None}
    if gaps and since is not None:
        result["largest_gap_began_s"] = round(max(gaps)[1] - since, 3)
    return result


def phase_ms(traces: list[dict], name: str) -> dict:
    """The median and largest duration of phase ``name`` over ``traces`` (ms)."""
    spans = [(p["end"] - p["start"]) * 1e3 for t in traces for p in t["phases"] if p["name"] == name]
    return {"median": round(statistics.median(spans), 1), "max": round(max(spans), 1)} if spans else {}


def outcome(streams: list[Stream], reference: list[Stream] | None, output: int) -> dict:
    """Streams completed (every one of ``output`` tokens), errored, lost (ended short without an
    error); with ``reference`` (the same requests undisturbed), the completed ones with its text."""
    completed = [s for s in streams if s.completed and s.tokens == output]
    errored = [s for s in streams if s.error]
    result = {"completed": len(completed), "errored": len(errored), "lost": len(streams) - len(completed) - len(errored),
              "errors": sorted({s.error for s in errored})[:3]}
    if reference is not None:
        result["identical"] = sum(s.text == r.text for s, r in zip(streams, reference) if s in completed)
    return result


def counters(url: str) -> dict:
    return {"moved_choices": pd_metric(url, "pdserve_kv_moves", 'event="choices"'),
            "moved_bytes": pd_metric(url, "pdserve_kv_moves", 'event="bytes"'),
            "moves_failed": pd_metric(url, "pdserve_kv_moves", 'event="failed"'),
            "migrations": migrations(url), "p_computed": work_done("PrefillServer", APP)["prompt_tokens_computed"]}


def scale_down(url: str, one_d, trigger: float, state: dict) -> None:
    """At ``trigger``: the counters and each D's stats, the watch started, then the app redeployed
    with one D (``one_d``), not waiting for it. Off the client's loop: each call blocks."""
    names = replicas("DecodeServer", APP)
    state["before"] = counters(url)
    actors = {name: ray.get_actor(name, namespace="serve") for name in names}
    state["d_before"] = {name: replica_stats(actor) for name, actor in actors.items()}
    state["watch"] = DrainWatch(actors, trigger)
    serve.run_many([serve.RunTarget(one_d, name=APP, route_prefix="/")], wait_for_ingress_deployment_creation=False,
                   wait_for_applications_running=False)
    state["redeploy_returned_s"] = time.monotonic() - trigger


async def drained_run(url: str, args, model: str, prompts: list[list[int]], state: dict) -> list[Stream]:
    """The streams, and the scale-down once each has ``--move-after`` events (``scale_down``)."""
    one_d = the_app(args.model, 1)  # built before: building reads the model's files

    async def when_all_decode(streams: list[Stream]) -> None:
        start = time.monotonic()
        while min(len(s.arrivals) for s in streams) < args.move_after:
            if any(s.error or s.finish for s in streams) or time.monotonic() - start > STREAM_TIMEOUT_S:
                raise RuntimeError("a stream ended before every stream had --move-after tokens: raise --output")
            await asyncio.sleep(0.02)
        state["trigger"] = trigger = time.monotonic()
        state["tokens_at_trigger"] = sorted(len(s.arrivals) for s in streams)
        await asyncio.to_thread(scale_down, url, one_d, trigger, state)

    return await run_streams(url, model, prompts, args.output, when_all_decode)


def traces_of(url: str, streams: list[Stream]) -> dict[int, dict]:
    found = {}
    for s in streams:
        response = httpx.get(f"{url}/traces/{s.completion_id}", timeout=30)
        if response.status_code == 200:
            found[s.index] = response.json()["requests"][0]
    return found


def report(url: str, args, reference: list[Stream], streams: list[Stream], state: dict) -> dict:
    watch: DrainWatch = state["watch"]
    watch.thread.join(DRAIN_TIMEOUT_S)
    after = counters(url)
    before = state["before"]
    traces = traces_of(url, streams)
    moved, per_token = moved_streams(traces, args.prompt)
    block_bytes = per_token * AppArgs.model_validate(app_args(args.model)).block_size if per_token else None
    moved_bytes = after["moved_bytes"] - before["moved_bytes"]
    kv = {"moved_bytes": moved_bytes, "moved_bytes_by_trace": sum(moved.values()), "block_bytes": block_bytes}
    if (resident := resident_before_move(watch.readings.get(watch.drained, []))) and block_bytes:
        at, blocks, requests = resident
        kv["resident"] = {"seconds_after_trigger": round(at, 3), "blocks_used": blocks, "requests": requests,
                          "bytes": blocks * block_bytes,
                          "difference_blocks_per_request": round((blocks * block_bytes - moved_bytes)
                                                                 / block_bytes / max(requests, 1), 3)}
    d_computed = {}  # the kept D read now, the drained one as last read (it has ended)
    for name, stats in state["d_before"].items():
        readings = watch.readings[name]
        now = replica_stats(watch.actors[name]) if name != watch.drained else None
        last = now.prompt_tokens_computed if now else readings[-1][3] if readings else stats.prompt_tokens_computed
        d_computed["drained" if name == watch.drained else f"kept {name[-8:]}"] = last - stats.prompt_tokens_computed
    recomputed = {"prefill": after["p_computed"] - before["p_computed"], "decode": d_computed,
                  "token_replays": after["migrations"] - before["migrations"]}
    trigger = state["trigger"]
    moved_timing = timing([s for s in streams if s.index in moved], trigger)
    run_tpot = timing(streams)["median_tpot_ms"]
    return {"outcome": outcome(streams, reference, args.output),
            "streams_moved": len(moved), "choices_moved": after["moved_choices"] - before["moved_choices"],
            "moves_failed": after["moves_failed"] - before["moves_failed"], "kv": kv, "recomputed": recomputed,
            "moved": moved_timing, "unmoved": timing([s for s in streams if s.index not in moved], trigger),
            "moved_kv_fetch_ms": phase_ms([traces[i] for i in moved], "kv_transfer"),
            "undisturbed": timing(reference),
            "largest_moved_gap_over_median_tpot": moved_timing["largest_gap_ms"] and run_tpot and
            round(moved_timing["largest_gap_ms"] / run_tpot, 2),
            "tokens_at_trigger": [state["tokens_at_trigger"][0], state["tokens_at_trigger"][-1]],
            "drain": {"redeploy_returned_s": round(state["redeploy_returned_s"], 3),
                      "left_serve_names_s": watch.named_out_at and round(watch.named_out_at, 3),
                      "handed_over_s": watch.drained and watch.handed_over() and
                      round(watch.readings[watch.drained][-1][0], 3)}}


def targets(result: dict, streams: int) -> dict[str, bool]:
    """Issue 54's served targets for a drained run's ``report``, each met or not."""
    done, kv, again = result["outcome"], result["kv"], result["recomputed"]
    resident = kv.get("resident")
    ratio = result["largest_moved_gap_over_median_tpot"]
    return {"0 lost, 0 errors": done["completed"] == streams,
            "tokens identical": done.get("identical") == streams,
            "bytes moved = resident KV +- 1 block per request": bool(resident) and
            abs(resident["difference_blocks_per_request"]) <= 1,
            "no prefill recomputed": again["prefill"] == 0 and not any(again["decode"].values()) and
            again["token_replays"] == 0,
            "largest gap <= 10x median TPOT": ratio is not None and ratio <= 10}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=160)
    parser.add_argument("--move-after", type=int, default=32)
    args = parser.parse_args()
    if Path(args.model).exists():  # the replicas' working directory is not this one
        args.model = str(Path(args.model).resolve())
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(5, 885) for _ in range(args.prompt - 1)] for _ in range(args.streams)]
    with serve_session(num_cpus=RAY_CPUS) as base:
        deploy({APP: the_app(args.model, 2)}, {APP: "/"})
        assert wait_until(lambda: httpx.get(f"{base}/health", timeout=30).status_code == 200, 300, 1)
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        assert len(replicas("DecodeServer", APP)) == 2
        reference = asyncio.run(run_streams(base, model, prompts, args.output))
        undisturbed = outcome(reference, None, args.output)
        print(json.dumps({"run": "undisturbed", **undisturbed, **timing(reference)}), flush=True)
        assert undisturbed["completed"] == args.streams, undisturbed
        state: dict = {}
        streams = asyncio.run(drained_run(base, args, model, prompts, state))
        result = report(base, args, reference, streams, state)
        result["targets"] = targets(result, args.streams)
        print(json.dumps({"run": "D 2 -> 1", **result}), flush=True)
    write_json(args.json, {"arguments": arguments(args), "undisturbed": undisturbed, "drained": result})


if __name__ == "__main__":
    main()
