"""The colocated engine's output channels (deployments/replicas/output_channels.py): one stream per replica
to each ingress carrying every request's outputs.

The sender's rules on an asyncio loop of their own (a step's outputs of several requests in one
item; an abort or a reader that leaves ends the requests and closes their engine streams; a channel
no reader opened is dropped; an idle channel ends), and the served app: concurrent streams share one
channel and get the tokens the engine makes in process, a client that leaves frees everything, and
the channel closes once idle."""

import asyncio

import httpx
import pytest

from deployments.replicas.output_channels import ChannelSender, Ended
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.serving import (assert_nothing_held, call_replica, deploy, migrations, replicas, serve_session,
                           wait_until)


class FakeStreams:
    """Engine streams the test feeds by hand, and the ones closed (AsyncEngine.close_stream)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.closed: list[str] = []

    def open(self, request_id: str):
        queue = self.queues[request_id] = asyncio.Queue()

        async def batches():
            while (batch := await queue.get()) is not None:
                yield batch
        return batches()

    def close(self, request_id: str) -> None:
        self.closed.append(request_id)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_a_channel_item_carries_every_request_outputs_since_the_last_in_order():
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        sender.start("ch", "a", streams.open("a"))
        sender.start("ch", "b", streams.open("b"))
        reader = sender.read("ch", heartbeat_s=10)
        for request_id, batch in (("a", ["a1"]), ("b", ["b1"]), ("a", ["a2", "a3"])):
            await streams.queues[request_id].put(batch)
        await asyncio.sleep(0)  # the pumps move them
        await asyncio.sleep(0)
        first = await anext(reader)
        await streams.queues["a"].put(None)  # a's stream ends
        second = await anext(reader)
        await reader.aclose()
        return first, second, list(streams.closed)

    first, second, closed = run(scenario())
    assert first == {"a": ["a1", "a2", "a3"], "b": ["b1"]}
    assert second == {"a": [Ended()]}
    assert closed == ["b"]  # the reader left with b running: b is ended; a had ended by itself


def test_an_engine_error_ends_its_request_on_the_channel_and_nothing_else():
    async def scenario():
        closed = []
        sender = ChannelSender(closed.append)

        async def failing():
            yield ["x1"]
            raise ValueError("boom")
        sender.start("ch", "x", failing())
        reader = sender.read("ch", heartbeat_s=10)
        items = []
        while not any(isinstance(i, Ended) for i in items):
            item = await anext(reader)
            items += item["x"]
        await reader.aclose()
        return items

    items = run(scenario())
    assert items[0] == "x1" and isinstance(items[1].error, ValueError) and str(items[1].error) == "boom"


def test_an_abort_ends_the_request_and_closes_its_engine_stream_even_before_it_ran():
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        sender.start("ch", "a", streams.open("a"))
        sender.abort("ch", "a")  # in the same turn: the pump never ran
        sender.abort("ch", "unknown")  # nothing to do
        await asyncio.sleep(0)
        return list(streams.closed), sender.open_channels()

    closed, channels = run(scenario())
    assert closed == ["a"]
    assert channels == 1  # the channel stays for its reader


def test_a_channel_no_reader_opened_is_dropped_with_its_requests():
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close, orphan_s=0.01)
        sender.start("ch", "a", streams.open("a"))
        await asyncio.sleep(0.1)
        return list(streams.closed), sender.open_channels()

    assert run(scenario()) == (["a"], 0)


def test_an_idle_channel_ends_and_heartbeats_while_a_request_waits():
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close, linger_s=0.05)
        sender.start("ch", "a", streams.open("a"))
        reader = sender.read("ch", heartbeat_s=0.01)
        beats = 0
        while (item := await anext(reader)) is None:  # a runs, nothing to send: heartbeat ticks
            beats += 1
            if beats == 3:
                await streams.queues["a"].put(None)
        rest = [i async for i in reader]  # a ended: the channel ends after its linger
        return beats, item, rest, sender.open_channels(), list(streams.closed)

    beats, item, rest, channels, closed = run(scenario())
    assert beats == 3 and item == {"a": [Ended()]}
    assert rest and all(i is None for i in rest)
    assert channels == 0 and closed == []


def test_a_newer_reader_takes_the_channel_over_and_the_older_one_leaves_its_requests_running():
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        sender.start("ch", "a", streams.open("a"))
        old = sender.read("ch", heartbeat_s=0.01)
        assert await anext(old) is None  # attached, nothing to send yet
        new = sender.read("ch", heartbeat_s=10)
        new_item = asyncio.create_task(anext(new))
        await asyncio.sleep(0)  # the new reader attaches
        await streams.queues["a"].put(["a1"])
        rest_of_old = [i async for i in old]  # the old one sees the takeover and ends
        return rest_of_old, await new_item, list(streams.closed), sender.open_channels()

    rest_of_old, new_item, closed, channels = run(scenario())
    assert all(i is None for i in rest_of_old)
    assert new_item == {"a": ["a1"]}
    assert closed == [] and channels == 1


# ---- served ----------------------------------------------------------------------------------

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def app_url():
    """A colocated app of its own on the shared session, deleted when the module ends."""
    from deployments.app import colocated_app

    with serve_session() as url:
        deploy({"channels": colocated_app({"torch_threads": 1, "dtype": "float32", "embeddings": False,
                                           "max_iter_times": 512})})
        yield f"{url}/channels"


def engine_replica() -> str:
    (name,) = replicas("LLMServer", "channels")
    return name


async def stream_ids(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                     first: asyncio.Event | None = None) -> list[int]:
    """A greedy /infer_token stream's token ids; ``first`` is set at its first token."""
    body = {"input_id": prompt, "stream": True,
            "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True, "do_sample": False}}
    ids = []
    async with client.stream("POST", "/infer_token", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"token"' in line:
                ids.append(httpx.Response(200, content=line[6:]).json()["token"]["id"])
                if first is not None:
                    first.set()
    return ids


@pytest.mark.slow
def test_concurrent_streams_share_one_channel_and_get_the_engines_tokens(app_url):
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(8)]
    reference = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", batch_invariant=True)).generate(
        [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0))
         for i, p in enumerate(prompts)])
    channels_seen = []

    async def scenario():
        async with httpx.AsyncClient(base_url=app_url, timeout=120) as client:
            streams = [asyncio.create_task(stream_ids(client, p, MAX_TOKENS)) for p in prompts]
            while not all(s.done() for s in streams):
                channels_seen.append(await asyncio.to_thread(call_replica, engine_replica(), "open_channels"))
                await asyncio.sleep(0.05)
            # and once more: a channel outlives its last request by CHANNEL_LINGER_S
            channels_seen.append(await asyncio.to_thread(call_replica, engine_replica(), "open_channels"))
            return [s.result() for s in streams]

    got = asyncio.run(scenario())
    assert got == [reference[f"r{i}"].output_token_ids for i in range(len(prompts))]
    assert max(channels_seen) == 1  # eight streams, one ingress: one channel
    assert wait_until(lambda: call_replica(engine_replica(), "open_channels") == 0, 30)  # idle: it closed
    assert_nothing_held(["LLMServer"], "channels")


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_is_aborted_and_the_others_go_on(app_url):
    """The leaving request opens the replica's channel (Serve cancels the calls a request made when
    it is cancelled: the channel must not be one of them), another request shares it, then the
    first client leaves: it is aborted, the other completes where it runs."""
    def aborted() -> int:
        return call_replica(engine_replica(), "stats").finished_by_reason.get("abort", 0)

    async def scenario():
        async with httpx.AsyncClient(base_url=app_url, timeout=120) as client:
            body = {"input_id": list(range(3, 50)), "stream": True,
                    "parameters": {"max_new_tokens": 500, "ignore_eos": True}}
            async with client.stream("POST", "/infer_token", json=body) as response:
                lines = response.aiter_lines()
                while '"token"' not in await anext(lines):
                    pass
                started = asyncio.Event()
                staying = asyncio.create_task(stream_ids(client, list(range(9, 40)), MAX_TOKENS, started))
                await started.wait()
            return await staying

    assert wait_until(lambda: call_replica(engine_replica(), "open_channels") == 0, 30)  # no channel yet
    aborts, moves = aborted(), migrations(app_url)
    assert len(asyncio.run(scenario())) == MAX_TOKENS
    assert migrations(app_url) == moves  # the channel outlived the request that opened it
    assert wait_until(lambda: aborted() == aborts + 1, 60)  # ended by the abort, not after its 500 tokens
    assert_nothing_held(["LLMServer"], "channels")
