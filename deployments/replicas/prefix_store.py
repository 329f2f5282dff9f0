"""The app's prefix store on Ray (issue 54 item 2; docs/serving.md, "The prefix store"): full KV
blocks that one P replica computed, which every P replica pulls instead of computing them.

- ``PrefixStoreServer`` (a deployment, one replica, no CPU reserved, as the LoRA store) applies
  the store's rules (engine/prefix_store.py) and owns each block's bytes as an object of Ray's
  object store (``ray.put`` in the store's replica: the blocks outlive the P that computed them).
  A P on the store's node reads a block through shared memory, one on another node gets it moved
  by the object store. A block is served only once its ``ray.put`` has returned (publication's
  second step), so no pull ever reads a block half written.
- ``PrefixStoreClient`` is a P replica's side. Before a prompt runs (``pull``): the prompt's
  content keys (LLMEngine.prefix_keys), how many leading blocks the replica's own pool holds, the
  store's longest chain; if the store holds more, the blocks after the pool's are pulled, checked as
  the P -> D hand-off checks KV (engine/kv_transfer.py: model, dtype, layers, heads, head size, and
  each block's shape; any mismatch and nothing is imported) and written into the pool
  (LLMEngine.import_prefix) ahead of the request. After P's prefill (``publish``), off the request's
  path: the full blocks of its exported KV that the store did not hold are sent to the store.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
import logging

import numpy as np
import ray
from ray import serve

from engine.async_engine import AsyncEngine
from engine.kv_transfer import KVMeta, KVMismatchError, KVPayload, check_compatible
from engine.lora_adapter import LoraAdapter
from engine.prefix_store import PrefixStore
from engine.request import GenerationRequest

logger = logging.getLogger(__name__)

PULL_HOLD_S = 60.0  # how long pulled blocks are held for a request that does not come (its add failed)


# Every P's look-ups, pulls and publications at once: none waits in Serve's queue. Each method is
# async with no await inside: they run one at a time on the replica's event loop (PrefixStore is not
# thread-safe, and Serve may run plain methods on threads).
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
class PrefixStoreServer:
    def __init__(self, capacity_bytes: int) -> None:
        self.store = PrefixStore(capacity_bytes)
        self.metas: dict[bytes, KVMeta] = {}  # a served block's KV layout (its publisher's), by key

    async def longest_chain(self, keys: list[bytes]) -> int:
        """How many leading blocks of ``keys`` are served now."""
        return self.store.longest_chain(keys)

    async def publish(self, keys: list[bytes], meta: KVMeta, data: np.ndarray) -> int:
        """Keep ``keys``' blocks: ``data`` [L, 2, len(keys) * B, Hkv, D], ``meta`` its layout (its
        num_tokens: B, the block size). Returns the blocks published (those not held already)."""
        size = meta.num_tokens
        reserved = set(self.store.begin_publish(keys, data[:, :, :size].nbytes))
        handles = {}
        try:
            for i, key in enumerate(keys):
                if key in reserved:
                    handles[key] = [ray.put(np.ascontiguousarray(data[:, :, i * size:(i + 1) * size]))]
        except BaseException:
            self.store.abort_publish(list(reserved))
            raise
        for key in handles:
            self.metas[key] = meta
        published = self.store.complete_publish(handles)
        self._forget_dropped()
        return published

    async def pull(self, keys: list[bytes]) -> tuple[int, list[list], list[KVMeta]] | None:
        """Start a pull of ``keys``' blocks: (its id, each block's ObjectRef in a list, so that Ray
        passes it on unresolved, each block's layout); None if any is not served now."""
        try:
            pull = self.store.pull(keys)
        except LookupError:
            return None
        return pull.pull_id, pull.handles, [self.metas[key] for key in keys]

    async def end_pull(self, pull_id: int) -> None:
        self.store.end_pull(pull_id)
        self._forget_dropped()

    async def counters(self) -> dict[str, int]:
        """The store's counters (PrefixStore.counters), for /metrics."""
        return self.store.counters()

    def _forget_dropped(self) -> None:
        """Drop the layouts of blocks no longer served (their ObjectRefs went with the store's entries)."""
        if len(self.metas) > self.store.counters()["blocks"]:
            self.metas = {key: meta for key, meta in self.metas.items() if self.store.served(key)}


class PrefixStoreClient:
    """A P replica's side of the store (module docstring). ``store``: the app's PrefixStoreServer handle."""

    def __init__(self, store, engine: AsyncEngine) -> None:
        self.store = store
        self.engine = engine
        self.block_size = engine.engine.config.block_size
        self._tasks: set[asyncio.Task] = set()  # publications and pull ends in flight (kept from the collector)

    async def pull(self, request: GenerationRequest, lora: LoraAdapter | None) -> tuple[list[bytes], int]:
        """Import the leading blocks of ``request``'s prompt the store holds beyond this replica's
        pool, ahead of the request (call it just before adding the request). Returns the prompt's
        keys and the blocks the store held (what ``publish`` need not send again). A store that
        fails or does not answer costs the request nothing but the time asked: it computes its prompt."""
        keys = self.engine.engine.prefix_keys(request, lora)
        try:
            return keys, await self._pull(request, keys)
        except Exception as error:  # not a cancellation (a BaseException): the request is going
            logger.warning("prefix store: pull failed, the prompt is computed: %s", error)
            return keys, 0

    async def _pull(self, request: GenerationRequest, keys: list[bytes]) -> int:
        inner = self.engine.engine
        reusable = keys[:(len(request.context_token_ids) - 1) // self.block_size]  # the last token is computed
        if not reusable or request.params.prompt_logprobs is not None or request.params.return_context_logits:
            return 0  # a scored prompt takes no prefix hits (Sequence.scores_prompt)
        local = len(inner.blocks.chain_blocks(reusable))  # a guess, read off the engine thread: checked there
        stored = await self.store.longest_chain.remote(keys)
        if min(stored, len(reusable)) <= local:
            return stored
        wanted = reusable[local:stored]
        answer = await self.store.pull.remote(wanted)
        if answer is None:  # evicted since the look-up
            return 0
        pull_id, refs, metas = answer
        try:
            blocks = await asyncio.gather(*(ref for [ref] in refs))
            self._check(metas, blocks)
            data = np.concatenate(blocks, axis=2)  # [L, 2, len(wanted) * B, Hkv, D]
        finally:
            self._detach(self.store.end_pull.remote(pull_id))
        self.engine.import_prefix(request.request_id, reusable[:stored], local, data, PULL_HOLD_S)
        return stored

    def publish(self, keys: list[bytes], stored: int, kv: KVPayload | None) -> None:
        """Send the full blocks of P's exported ``kv`` (tokens [start, num_tokens)) that the store did
        not hold (its first ``stored`` blocks) to the store, without waiting for it."""
        if kv is None:
            return
        size, start = self.block_size, kv.meta.start
        first, end = max(stored, -(-start // size)), min(kv.meta.num_tokens // size, len(keys))
        if first >= end:
            return
        data = kv.data[:, :, first * size - start:end * size - start]
        self._detach(self.store.publish.remote(keys[first:end], replace(kv.meta, num_tokens=size, start=0), data))

    def _check(self, metas: list[KVMeta], blocks: list[np.ndarray]) -> None:
        """Each block's layout is this engine's and its array has a block's shape (fail closed)."""
        expected = self.engine.engine.runner.kv_meta(self.block_size)
        shape = (expected.num_layers, 2, self.block_size, expected.num_kv_heads, expected.head_dim)
        for meta, block in zip(metas, blocks):
            check_compatible(meta, expected, self.block_size)
            if block.shape != shape:
                raise KVMismatchError(f"kv.shape: got {block.shape}, a block here is {shape}")

    def _detach(self, response) -> None:
        """Await ``response`` (a store call) in the background, logging a failure."""
        async def awaited() -> None:
            try:
                await response
            except Exception as error:
                logger.warning("prefix store call failed: %s", error)

        task = asyncio.get_running_loop().create_task(awaited())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
