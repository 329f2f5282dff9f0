"""Where a LoRA adapter lives in the app: one store every replica fetches from, and each
replica's own least-recently-used cache (engine/lora_adapter.py has what an adapter is).

- ``LoraStore`` (a deployment, one replica, no CPU reserved) holds the app's adapters: the named
  ones (AppArgs ``lora_modules``, PEFT directories read at start) and those sent on /infer_token
  in TensorRT-LLM's form, by task id. A task id keeps its adapter until ``max_lora_tasks`` other
  tasks have been used since it last was (the seed's "the oldest LoRA will be evicted", oldest by
  last use); only then, or for an id never given, is a request with the id alone refused as not
  cached. The ingress puts adapters in
  and resolves names and ids to ``LoraRef``s; requests carry only the ref.
- ``LoraCache`` is a P, D or colocated replica's: up to ``max_loras`` adapters, fetched from the
  store on a miss, the least recently used forgotten first (a running request keeps its own
  adapter alive until it ends). So a task id that any replica has seen works on every replica.
"""

from __future__ import annotations

from collections import OrderedDict

from ray import serve
from transformers import AutoConfig

from engine.execution.loader import model_spec, resolve_model_dir
from engine.lora_adapter import LoraAdapter, LoraRef, ModelShape, from_peft


@serve.deployment(ray_actor_options={"num_cpus": 0})
class LoraStore:
    def __init__(self, model: str, modules: dict[str, str], max_rank: int, max_tasks: int) -> None:
        self._shape = ModelShape.of(model_spec(AutoConfig.from_pretrained(resolve_model_dir(model))))
        self.max_tasks = max_tasks
        self.named: dict[str, LoraAdapter] = {}
        for name, directory in modules.items():
            adapter = from_peft(name, directory)
            adapter.check(self._shape, max_rank, f"lora_modules: {name}")
            self.named[name] = adapter
        self.tasks: OrderedDict[int, LoraAdapter] = OrderedDict()  # oldest first
        self._by_ref: dict[LoraRef, LoraAdapter] = {a.ref: a for a in self.named.values()}

    def shape(self) -> ModelShape:
        return self._shape

    def names(self) -> dict[str, LoraRef]:
        """The named adapters, by name."""
        return {name: adapter.ref for name, adapter in self.named.items()}

    def task(self, task_id: int) -> LoraRef | None:
        """The adapter of a task id, None if it is not held; a use makes it the newest."""
        adapter = self.tasks.get(task_id)
        if adapter is None:
            return None
        self.tasks.move_to_end(task_id)
        return adapter.ref

    def put_task(self, task_id: int, adapter: LoraAdapter) -> LoraRef:
        """Hold ``adapter`` for ``task_id`` (replacing what it had), forgetting the oldest past max_lora_tasks.
        The ingress has checked it against the model (with the field named); each engine checks it again."""
        self.tasks[task_id] = adapter
        self.tasks.move_to_end(task_id)
        while len(self.tasks) > self.max_tasks:
            self.tasks.popitem(last=False)
        self._by_ref = {a.ref: a for a in (*self.named.values(), *self.tasks.values())}
        return adapter.ref

    def get(self, ref: LoraRef) -> LoraAdapter | None:
        return self._by_ref.get(ref)


class LoraCache:
    """A replica's adapters, by ref: up to ``max_loras``, least recently used forgotten first."""

    def __init__(self, store, max_loras: int) -> None:
        """``store``: the app's LoraStore handle; None where the app serves no adapters."""
        self.store, self.max_loras = store, max_loras
        self._adapters: OrderedDict[LoraRef, LoraAdapter] = OrderedDict()
        self.fetches = 0  # adapters fetched from the store since start

    async def adapter(self, ref: LoraRef | None) -> LoraAdapter | None:
        """The weights of ``ref``'s adapter (None for none); ValueError if the app no longer holds them."""
        if ref is None:
            return None
        adapter = self._adapters.get(ref)
        if adapter is None:
            adapter = None if self.store is None else await self.store.get.remote(ref)
            if adapter is None:
                raise ValueError(f"lora: adapter {ref.name!r} is no longer held by this app (max_lora_tasks); "
                                 "send its weights again")
            self.fetches += 1
            self._adapters[ref] = adapter
            while len(self._adapters) > self.max_loras:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(ref)
        return adapter
