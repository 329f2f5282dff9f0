"""D scales out under a bounded load (16 streams at once) and back to its minimum after it, with no
request failing."""

import asyncio
import time

import httpx
import pytest
from ray import serve

from deployments.app import pd_app
from tests.serving import AUTOSCALE_S, REPLICA_START_S, deploy, serve_session, sse_events, wait_until

pytestmark = pytest.mark.slow

BURST = 16  # streams at once
TOKENS = 200  # each stream's: short, so that the load ends soon after D has scaled out
# D scales on its own signal (deployments/replicas/autoscaling.py): the requests it runs or queues.
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "metrics_interval_s": 0.5, "look_back_period_s": 1.0,
               "upscale_delay_s": 0.5, "downscale_delay_s": 3.0,
               "policy": {"policy_function": "deployments.replicas.autoscaling:DecodeScaling",
                          "policy_kwargs": {"target_requests": 2}}}


def running_replicas(deployment: str) -> int:
    status = serve.status().applications["pd"].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def test_decode_scales_out_and_back():
    with serve_session() as url:
        # no embedder: nothing here embeds, a replica fewer to start
        app = pd_app({"torch_threads": 1, "pd_local_prefill_tokens": 0, "embeddings": False},
                           decode_options={"autoscaling_config": AUTOSCALING, "ray_actor_options": {"num_cpus": 1}})
        deploy({"pd": app})
        assert running_replicas("DecodeServer") == 1
        peak = 0

        async def one(client, i):
            body = {"input_id": [5 + i % 800, 6, 7], "stream": True,  # ids within tiny-llama's 891
                    "parameters": {"max_new_tokens": TOKENS, "ignore_eos": True, "seed": i + 1}}
            response = await client.post(f"{url}/pd/infer_token", json=body)
            return response.status_code, sse_events(response)

        async def watch(done):
            nonlocal peak
            while not done.is_set():
                peak = max(peak, running_replicas("DecodeServer"))
                await asyncio.sleep(0.25)

        async def load():
            """BURST streams at once, each one that ends followed by a new one, until D has scaled
            out (a new replica takes as long to start as the machine needs, so the load is held
            until then, at most REPLICA_START_S, rather than for a fixed time); then the streams
            running end (docs/testing.md: waves waited for whole held it up to a wave longer)."""
            done = asyncio.Event()
            watcher = asyncio.create_task(watch(done))
            deadline = time.monotonic() + REPLICA_START_S
            results = []
            async with httpx.AsyncClient(timeout=300) as client:
                running, sent = {asyncio.create_task(one(client, i)) for i in range(BURST)}, BURST
                while running:
                    ended, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    results += [task.result() for task in ended]
                    if peak < 2 and time.monotonic() < deadline:
                        running |= {asyncio.create_task(one(client, sent + j)) for j in range(len(ended))}
                        sent += len(ended)
            done.set()
            await watcher
            return results

        results = asyncio.run(load())
        assert all(status == 200 for status, _ in results)
        assert all(events[-1]["details"]["generated_tokens"] == TOKENS for _, events in results)
        assert peak >= 2, "the burst should have scaled D out"
        assert wait_until(lambda: running_replicas("DecodeServer") == 1, timeout_s=AUTOSCALE_S)
