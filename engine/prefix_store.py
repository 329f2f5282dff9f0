"""The rules of the app's prefix store: full KV blocks that one P replica computed, kept for every
P replica to pull instead of computing them (issue 54 item 2; docs/serving.md, "The prefix store").

Model-free and transport-free: an entry's ``handle`` is whatever the caller keeps the block's bytes
in (deployments/replicas/prefix_store.py keeps a Ray ObjectRef), the store only decides which
handles are served, which are dropped and when.

- Keys are the prefix cache's own content keys (engine/block_manager.py's ``chain_hash``): each
  block's key chains over its parent's, and the namespace holds the model, dtype, a p-tuning
  table's digest and a LoRA adapter's digest, so a block is found only by a prompt whose whole
  prefix, model, adapter and table are the same.
- Publishing is two steps, as the P -> D hand-off's fail-closed rule asks: ``begin_publish``
  reserves the keys (pending), ``complete_publish`` gives each its handle. A pending block is
  never served: ``longest_chain`` stops before it and ``pull`` refuses it; a publication that is
  abandoned (``abort_publish``) or never completes is dropped like an evicted block.
- Bounded in bytes; past the bound the least recently used blocks go first (a lookup that finds
  a block, or a pull of it, makes it the newest). A block evicted while a pull of it is in flight
  is no longer found, but its handle stays until its last pull ends (``end_pull``): the puller
  is reading those bytes. So the memory held is at most the bound plus the bytes of blocks that
  pulls in flight read (``kept_for_pulls``).
- Counters (``counters``): blocks published, lookups that found a block (hits) and blocks found,
  pulls and blocks pulled, blocks evicted, and the bytes and blocks held now.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
import itertools
from typing import Any


class StoreRefused(LookupError):
    """A pull asked for a block the store does not serve: absent, evicted, or still being published."""


@dataclass
class _Entry:
    nbytes: int
    handle: Any = None  # None while pending
    pulls: int = 0  # pulls in flight that read this block

    @property
    def ready(self) -> bool:
        return self.handle is not None


@dataclass
class Pull:
    """One pull in flight: the handles of the blocks asked for, in chain order; ``end_pull`` it."""

    pull_id: int
    keys: list[bytes]
    handles: list[Any]
    _entries: list[_Entry] = field(default_factory=list, repr=False)


class PrefixStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # indexed blocks, least recently used first
        self._evicted_pulled: list[_Entry] = []  # evicted while pulled: kept until their pulls end
        self._pulls: dict[int, Pull] = {}
        self._pull_ids = itertools.count()
        self.nbytes = 0  # the indexed entries' bytes (pending or ready): what the bound bounds
        self.kept_for_pulls = 0  # bytes of evicted entries that pulls in flight still read
        self.published = self.lookups = self.hits = self.hit_blocks = 0
        self.pulls = self.pulled_blocks = self.evictions = 0

    # ---- publishing --------------------------------------------------------------------

    def begin_publish(self, keys: list[bytes], block_nbytes: int) -> list[bytes]:
        """Reserve ``keys`` (each a block of ``block_nbytes``) as pending; returns those reserved
        (a key already stored or pending is not published twice). Evicts to stay in bounds; a
        block bigger than the whole store is not reserved."""
        if block_nbytes > self.capacity_bytes:
            return []
        reserved = []
        for key in keys:
            if key in self._entries:
                continue
            self._entries[key] = _Entry(block_nbytes)
            self.nbytes += block_nbytes
            reserved.append(key)
        self._evict_to_fit(keep=set(reserved))
        return [key for key in reserved if key in self._entries]

    def complete_publish(self, handles: dict[bytes, Any]) -> int:
        """Each pending key's bytes are in place at ``handles[key]``: from now on it is served.
        Keys no longer pending (evicted, aborted meanwhile) are ignored; returns the blocks published."""
        done = 0
        for key, handle in handles.items():
            entry = self._entries.get(key)
            if entry is None or entry.ready or handle is None:
                continue
            entry.handle = handle
            done += 1
        self.published += done
        return done

    def abort_publish(self, keys: list[bytes]) -> None:
        """The publication of ``keys`` failed: drop those still pending."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and not entry.ready:
                del self._entries[key]
                self.nbytes -= entry.nbytes

    # ---- reading -----------------------------------------------------------------------

    def longest_chain(self, keys: list[bytes]) -> int:
        """How many leading blocks of ``keys`` (a prompt's chained keys) are served; those become
        the newest. Counted as a lookup, and a hit when at least one is."""
        found = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                break
            self._entries.move_to_end(key)
            found += 1
        self.lookups += 1
        self.hits += found > 0
        self.hit_blocks += found
        return found

    def pull(self, keys: list[bytes]) -> Pull:
        """Start reading ``keys``' blocks: their handles, held until ``end_pull``. Refused whole
        (StoreRefused) if any is not served now: absent, evicted or still pending."""
        entries = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                raise StoreRefused(f"block {key.hex()} is {'being published' if entry else 'not in the store'}")
            entries.append(entry)
        for key, entry in zip(keys, entries):
            entry.pulls += 1
            self._entries.move_to_end(key)
        pull = Pull(next(self._pull_ids), list(keys), [entry.handle for entry in entries], entries)
        self._pulls[pull.pull_id] = pull
        self.pulls += 1
        self.pulled_blocks += len(keys)
        return pull

    def end_pull(self, pull_id: int) -> None:
        """A pull ended (read or failed): its blocks may go; those evicted meanwhile go now."""
        pull = self._pulls.pop(pull_id, None)
        if pull is None:
            return
        for entry in pull._entries:
            entry.pulls -= 1
        gone = [entry for entry in self._evicted_pulled if entry.pulls == 0]
        self._evicted_pulled = [entry for entry in self._evicted_pulled if entry.pulls]
        self.kept_for_pulls -= sum(entry.nbytes for entry in gone)

    # ---- state -------------------------------------------------------------------------

    def served(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def handles_held(self) -> list[Any]:
        """Every handle the store still keeps (served, or evicted while a pull reads it)."""
        kept = [e.handle for e in self._entries.values() if e.ready]
        return kept + [entry.handle for entry in self._evicted_pulled]

    def counters(self) -> dict[str, int]:
        return {"published": self.published, "lookups": self.lookups, "hits": self.hits,
                "hit_blocks": self.hit_blocks, "pulls": self.pulls, "pulled_blocks": self.pulled_blocks,
                "evictions": self.evictions, "bytes": self.nbytes, "blocks": len(self._entries),
                "pulls_in_flight": len(self._pulls), "kept_for_pulls": self.kept_for_pulls}

    def _evict_to_fit(self, keep: set[bytes]) -> None:
        """Drop least recently used blocks until the bytes fit, ``keep`` last of all."""
        for key in [k for k in self._entries if k not in keep] + [k for k in self._entries if k in keep]:
            if self.nbytes <= self.capacity_bytes:
                return
            entry = self._entries.pop(key)
            self.evictions += 1
            self.nbytes -= entry.nbytes
            if entry.pulls:  # its bytes stay until the pulls reading it end
                self._evicted_pulled.append(entry)
                self.kept_for_pulls += entry.nbytes
