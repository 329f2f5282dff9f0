"""The engines' output channels (deployments/replicas/output_channels.py): one stream per replica
to each ingress carrying every request's outputs.

The sender's rules on an asyncio loop of their own (a step's outputs of several requests in one
item; an abort or a reader that leaves ends the requests and closes their engine streams, and a
reader that leaves closes the channel too; a channel no reader opened is dropped; an idle channel
ends); the receiver's, against a sender in the same loop (requests share one reader; the accepting
call is the caller's: one answered past its bound fails the stream and the request is aborted once
taken; a replica stopped across a stall: tests/test_channel_stall.py); and the served apps: concurrent streams,
colocated and PD (D's channel), share one channel and get the tokens the engine makes in process,
a client that leaves frees everything, the channel closes once idle, and a D killed mid-stream
moves every request on its channel, which completes."""

import asyncio

import httpx
import pytest

from deployments.failures import ChannelFailed, replica_failed
from deployments.replicas.liveness import Accepted, Heartbeat
from deployments.replicas.output_channels import ChannelReceiver, ChannelSender, Ended
from engine.llm_engine import LLMEngine
from engine.config import EngineConfig
from engine.request import GenerationRequest
from sampling import SamplingParams
from tests.serving import (assert_nothing_held, call_replica, deploy, migrations, processes, replicas,
                           serve_session, sigkill, wait_until)


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


def test_a_reader_that_leaves_ends_the_channels_requests_and_the_channel():
    """The ingress left the channel (it found it stalled, the replica alive) after the replica had
    taken one more request on it: the ingress never reads that channel again (its later requests
    name a new one, tests/test_channel_stall.py), so the replica ends the request, closing its
    engine stream, and forgets the channel at once."""
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        old = sender.read("ch", heartbeat_s=0.01)
        assert await anext(old) is None  # attached
        sender.start("ch", "late", streams.open("late"))
        await old.aclose()  # its ingress's reader left
        return list(streams.closed), sender.open_channels()

    assert run(scenario()) == (["late"], 0)


class Loopback:
    """An engine deployment's handle whose calls reach one replica's ChannelSender in this loop
    (what Serve carries between processes; options are Serve's concern and ignored)."""

    REPLICA = "r1"

    def __init__(self, sender: ChannelSender, streams: FakeStreams) -> None:
        self.sender, self.streams = sender, streams
        self.submit, self.channel, self.abort = Method(self._submit), Method(self._channel), Method(self._abort)

    def options(self, **_):
        return self

    async def _submit(self, request: GenerationRequest, channel: str) -> Accepted:
        self.sender.start(channel, request.request_id, self.streams.open(request.request_id))
        return Accepted(self.REPLICA)

    def _channel(self, channel: str, pinned: str):
        return Call(self._items(channel))

    async def _items(self, channel: str):
        yield Accepted(self.REPLICA)
        async for item in self.sender.read(channel, heartbeat_s=0.05):
            yield Heartbeat() if item is None else item

    def _abort(self, channel: str, request_id: str, pinned: str) -> None:
        self.sender.abort(channel, request_id)


class Method:
    def __init__(self, call) -> None:
        self.remote = call


class Call:
    """A streaming call's items, cancellable (what cancel_on_exit reads)."""

    def __init__(self, items) -> None:
        self.items = items

    def __aiter__(self):
        return self.items

    def cancel(self) -> None:
        asyncio.ensure_future(self.items.aclose())


def request_of(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3], SamplingParams(max_new_tokens=4))


def test_a_receivers_requests_share_one_reader_and_each_gets_its_outputs_in_order():
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        receiver = ChannelReceiver(Loopback(sender, streams), stall_timeout_s=5)

        async def read(request_id: str) -> list:
            return [item async for batch in receiver.stream(request_of(request_id)) for item in batch]
        readers = [asyncio.create_task(read(request_id)) for request_id in ("a", "b")]
        while len(streams.queues) < 2:  # both accepted
            await asyncio.sleep(0.01)
        for request_id, batch in (("a", ["a1"]), ("b", ["b1"]), ("a", ["a2"]), ("a", None), ("b", ["b2"]),
                                  ("b", None)):
            await streams.queues[request_id].put(batch)
            await asyncio.sleep(0.01)
        return [await r for r in readers], sender.open_channels(), list(streams.closed)

    outputs, channels, closed = run(scenario())
    assert outputs == [["a1", "a2"], ["b1", "b2"]]
    assert channels == 1 and closed == []  # one channel carried both; each ended by itself


def test_an_answer_past_the_callers_bound_fails_the_stream_and_the_request_is_aborted_once_taken():
    """D's KV lease: the accepting call and the bound on its answer are the caller's; a replica
    that takes the request after the bound is told to abort it (its blocks freed)."""
    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        loopback = Loopback(sender, streams)
        receiver = ChannelReceiver(loopback, stall_timeout_s=5)
        go = asyncio.Event()

        async def late(request: GenerationRequest, channel: str) -> Accepted:
            await go.wait()  # a stopped replica, resumed after the bound
            return await loopback.submit.remote(request, channel)

        stream = receiver.stream(request_of("k"), lambda channel: late(request_of("k"), channel),
                                 lambda answer: asyncio.wait_for(answer, 0.05))
        with pytest.raises(TimeoutError):
            await anext(stream)
        go.set()
        while not streams.closed:
            await asyncio.sleep(0.01)
        return list(streams.closed), list(streams.queues)

    closed, started = run(scenario())
    assert started == ["k"] and closed == ["k"]  # taken after the bound, then aborted



def test_a_channel_call_that_fails_in_transport_fails_its_requests_as_a_replica_failure():
    """An error of the channel's call itself (here what gRPC raises for an item past Serve's replica
    message limit) is no request's own error: each request on the channel fails as a replica failure,
    which migration moves (deployments/failures.py), never as that error (a 500)."""
    class TransportError(Exception):  # not a Ray error: what grpc.aio raises, RESOURCE_EXHAUSTED
        pass

    async def scenario():
        streams = FakeStreams()
        sender = ChannelSender(streams.close)
        loopback = Loopback(sender, streams)

        async def items_then_failure(channel: str):
            async for item in loopback._items(channel):
                if isinstance(item, dict):
                    raise TransportError("received message larger than max")
                yield item
        loopback.channel = Method(lambda channel, pinned: Call(items_then_failure(channel)))
        receiver = ChannelReceiver(loopback, stall_timeout_s=5)
        stream = receiver.stream(request_of("m"))
        first = asyncio.ensure_future(anext(stream))
        while "m" not in streams.queues:
            await asyncio.sleep(0.01)
        await streams.queues["m"].put(["m1"])
        with pytest.raises(Exception) as failure:
            await first
        return failure.value

    error = run(scenario())
    assert isinstance(error, ChannelFailed) and "TransportError" in str(error)
    assert replica_failed(error)

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
                     first: asyncio.Event | None = None, after: int = 1) -> list[int]:
    """A greedy /infer_token stream's token ids; ``first`` is set once ``after`` tokens came."""
    body = {"input_id": prompt, "stream": True,
            "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True, "do_sample": False}}
    ids = []
    async with client.stream("POST", "/infer_token", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"token"' in line:
                ids.append(httpx.Response(200, content=line[6:]).json()["token"]["id"])
                if first is not None and len(ids) >= after:
                    first.set()
    return ids


def in_process(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The tokens the engine makes in this process for each greedy prompt (float32, batch-invariant)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", batch_invariant=True))
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    outputs = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [outputs[f"r{i}"].output_token_ids for i in range(len(prompts))]


def streamed_with_channels(url: str, prompts: list[list[int]], replica) -> tuple[list[list[int]], list[int]]:
    """Every prompt's greedy stream at once: their tokens, and the channels open on ``replica()``
    read while they run and once after (a channel outlives its last request by CHANNEL_LINGER_S)."""
    channels_seen = []

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            streams = [asyncio.create_task(stream_ids(client, p, MAX_TOKENS)) for p in prompts]
            while not all(s.done() for s in streams):
                channels_seen.append(await asyncio.to_thread(call_replica, replica(), "open_channels"))
                await asyncio.sleep(0.05)
            channels_seen.append(await asyncio.to_thread(call_replica, replica(), "open_channels"))
            return [s.result() for s in streams]

    return asyncio.run(scenario()), channels_seen


@pytest.mark.slow
def test_concurrent_streams_share_one_channel_and_get_the_engines_tokens(app_url):
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(8)]
    got, channels_seen = streamed_with_channels(app_url, prompts, engine_replica)
    assert got == in_process(prompts, MAX_TOKENS)
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


# ---- served, PD: D's outputs on D's channel ----------------------------------------------------

PD_PROMPTS = [list(range(5 + i, 30 + 3 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def pd_url(app_url):
    """A PD app (one P, one D, every prompt through P) beside the colocated one, float32."""
    from deployments.app import pd_app

    deploy({"pdchannels": pd_app({"torch_threads": 1, "dtype": "float32", "embeddings": False,
                                  "max_iter_times": 512, "pd_local_prefill_tokens": 0})})
    return app_url.removesuffix("/channels") + "/pdchannels"


def decode_replica() -> str:
    (name,) = replicas("DecodeServer", "pdchannels")
    return name


@pytest.mark.slow
def test_pd_streams_share_one_decode_channel_and_get_the_engines_tokens(pd_url):
    moves = migrations(pd_url)
    got, channels_seen = streamed_with_channels(pd_url, PD_PROMPTS, decode_replica)
    assert got == in_process(PD_PROMPTS, MAX_TOKENS)
    assert max(channels_seen) == 1  # six streams, one ingress, one D: one channel
    assert migrations(pd_url) == moves
    assert wait_until(lambda: call_replica(decode_replica(), "open_channels") == 0, 30)  # idle: it closed
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pdchannels")


@pytest.mark.slow
def test_a_decode_replica_killed_mid_stream_moves_every_request_on_its_channel_and_each_completes(pd_url):
    """Every stream decodes on the one D (its channel carries them all) when D is SIGKILLed: each
    request fails with the channel and moves (to P alone while no D answers, or to D once Serve has
    replaced it), and completes with the tokens the engine makes in process."""
    long_tokens = 400  # the streams are still decoding when D dies

    async def scenario():
        async with httpx.AsyncClient(base_url=pd_url, timeout=300) as client:
            decoding = [asyncio.Event() for _ in PD_PROMPTS]
            streams = [asyncio.create_task(stream_ids(client, p, long_tokens, started, after=3))
                       for p, started in zip(PD_PROMPTS, decoding)]
            for started in decoding:  # each has had tokens from D
                await started.wait()
            (decode,) = processes("DecodeServer", "pdchannels")
            await asyncio.to_thread(sigkill, decode)
            return [await s for s in streams]

    from ray import serve

    def replaced() -> bool:
        states = serve.status().applications["pdchannels"].deployments["DecodeServer"].replica_states
        return killed not in (names := replicas("DecodeServer", "pdchannels")) and len(names) == 1 == \
            states.get("RUNNING", 0)

    killed, moves = decode_replica(), migrations(pd_url)
    assert asyncio.run(scenario()) == in_process(PD_PROMPTS, long_tokens)
    assert migrations(pd_url) - moves >= len(PD_PROMPTS)  # every request on the channel moved
    assert wait_until(replaced, 300, 0.5)
    assert_nothing_held(["PrefillServer", "DecodeServer"], "pdchannels", 120)
