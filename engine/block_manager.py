"""The KV block accounts: which blocks are held, by how many sequences, and which hold what.

Pure bookkeeping, no tensors: the model runner owns the memory, this class owns the ledger.

Content addressing (prefix caching, as vLLM v1 and nano-vllm do it): a *full* block's key is
a hash chained over the previous block's key, the block's token ids and the sequence's KV
namespace (model, dtype, a p-tuning table, a LoRA adapter). Two sequences whose first k
blocks have the same keys hold the same KV there, so the second one takes the first one's
blocks instead of computing them. A block is in one of three states:

- held: ``ref_count > 0``; shared by every sequence whose table lists it;
- cached: ``ref_count == 0`` but keyed; reusable by a prefix hit until evicted. These are kept
  in least-recently-freed order and evicted first-in-first-out when the free list is empty;
- free: no key, on the free list.

Only full blocks are keyed, and a sequence never writes into a full block it computed, so a
shared block is written only in one case: the last, partial block of a prompt after a fork
(n choices, beams). ``allocate`` copies it first (copy-on-write) and returns the copy for the
model runner to make.

``can_allocate``/``allocate`` are the paired check and commit that the scheduler calls before a
sequence gets more tokens of KV; ``computed_prefix`` is the look-up it makes before admitting one.

With a second tier (engine/kv_tier.py), an evicted block that a look-up found at least once is
spilled there first (content computed once and never asked for again is not worth the copy: a
workload without reuse pays nothing), and a look-up that ends in the pool goes on in the tier: a
block found there is copied back into a new pool block, keyed and cached like any other. Both
copies are only decided here (``take_tier_moves``): the model runner makes them, in order, before
the next forward writes into any block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
import hashlib

import numpy as np

from engine.kv_tier import KVTier, TierMove
from engine.request import Sequence


@dataclass
class BlockCounts:
    """Where every block of the pool is: held + cached + free == total."""

    total: int
    held: int  # referenced by at least one sequence
    cached: int  # nobody holds it, its content is keyed: reusable until evicted
    free: int  # nobody holds it, no content

    @property
    def usage(self) -> float:
        """Fraction of the pool held (vLLM's kv_cache_usage: cached blocks count as free)."""
        return self.held / self.total


def chain_hash(parent: bytes, token_ids: list[int], namespace: bytes) -> bytes:
    """The key of a full block: parent's key, the block's tokens, the KV namespace.
    blake2b, not Python's hash: the same key in every process (a router can compute it)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(namespace)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: KVTier | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0 and keyed, oldest first
        self.prefix_queries = 0  # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of those, tokens found
        # Keys given up so far (a block evicted or reset): a block left unkeyed because another held
        # its key may take it only after one (``cache_full_blocks``).
        self.keys_dropped = 0
        self.tier = tier if enable_prefix_caching else None
        self._tier_moves: list[TierMove] = []  # decided, not yet made by the runner
        # Per block: a look-up found its content since it was taken; only such a block spills when evicted.
        self._found = [False] * num_blocks

    # ---- counts ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones, and cached ones by eviction."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by some sequence."""
        return self.num_blocks - self.num_free

    def counts(self) -> BlockCounts:
        return BlockCounts(self.num_blocks, self.num_used, len(self._cached), len(self._free))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix look-up ----------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of ``seq``'s first ``num_blocks`` full blocks (memoised on the sequence)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else b"", seq.token_ids[i * bs:(i + 1) * bs],
                                     seq.kv_namespace))
        return hashes[:num_blocks]

    def computed_prefix(self, seq: Sequence, max_tokens: int | None = None) -> list[int]:
        """The cached blocks holding ``seq``'s leading full blocks, for a sequence that holds none
        yet. Never the block of its last token: that token is computed, to give the logits."""
        if not self.enable_prefix_caching:
            return []
        limit = seq.num_tokens - 1 if max_tokens is None else min(max_tokens, seq.num_tokens - 1)
        return self.chain_blocks(self.block_hashes(seq, limit // self.block_size))

    def chain_blocks(self, keys: list[bytes]) -> list[int]:
        """The blocks holding the leading ``keys`` that this pool has keyed, or its second tier
        holds (copied back into new pool blocks: engine/kv_tier.py); also a prefix store's look-up
        of its own pool (deployments/replicas/prefix_store.py)."""
        blocks, tier = [], self.tier
        for key in keys:
            block = self._by_key.get(key)
            if block is not None and tier is not None:
                self._hold(block)  # not evicted for a later block's copy-back
                self._found[block] = True
            elif block is None and tier is not None:
                block = self._copy_back(key)
            if block is None:
                break
            blocks.append(block)
        if tier is not None:
            self.release(reversed(blocks))
        return blocks

    def adopt(self, keys: list[bytes]) -> list[int]:
        """Blocks for KV brought from elsewhere (the prefix store) under ``keys``, one each, taken
        from the pool (evicting cached ones) and keyed, held once: the caller writes their KV, then
        ``release``s them. Stops at a key this pool holds already or when no block is left."""
        blocks = []
        for key in keys:
            if key in self._by_key or not self.num_free:
                break
            block = self._take()
            self.block_key[block] = key
            self._by_key[key] = block
            blocks.append(block)
        return blocks

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's look-up (not the tries of one still waiting)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation: check, then commit ------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int, computed: list[int] = ()) -> int:
        """Blocks the pool must give so that ``seq`` (after taking ``computed``) covers
        ``num_tokens`` tokens: new blocks, a copy-on-write copy, and cached hits it revives."""
        new = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(computed))
        revived = sum(1 for b in computed if self.ref_count[b] == 0)
        return new + revived + (1 if self._shared_tail(seq) is not None else 0)

    def covers(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq``'s blocks already hold ``num_tokens`` tokens with a tail of its own, so that
        ``allocate(seq, num_tokens)`` has nothing to do (most decode steps: one check, no allocation)."""
        table = seq.block_table
        if -(-num_tokens // self.block_size) > len(table):
            return False
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return not offset or index >= len(table) or self.ref_count[table[index]] <= 1

    def covered(self, tables: np.ndarray, lengths: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        """``covers`` for a batch of rows: block tables [R, W] (``lengths`` [R] of each in use), each
        row's computed tokens ``num_tokens - 1`` growing to ``num_tokens`` [R]; [R] bool."""
        computed = num_tokens - 1
        index, offset = np.divmod(computed, self.block_size)
        tails = tables[np.arange(len(tables)), np.minimum(index, tables.shape[1] - 1)].tolist()
        shared = np.fromiter(map(self.ref_count.__getitem__, tails), dtype=np.int64, count=len(tails)) > 1
        return (-(-num_tokens // self.block_size) <= lengths) & ((offset == 0) | (index >= lengths) | ~shared)

    def can_allocate(self, seq: Sequence, num_tokens: int, computed: list[int] = ()) -> bool:
        return self.blocks_needed(seq, num_tokens, computed) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int, computed: list[int] = ()) -> list[tuple[int, int]]:
        """Commit: ``seq`` takes the ``computed`` prefix blocks, a private copy of a shared
        partial tail, and new blocks until it covers ``num_tokens`` tokens. Returns the block
        copies (src, dst) the runner must make before the forward writes."""
        for block in computed:
            self._hold(block)
            seq.block_table.append(block)
        copies = []
        tail = self._shared_tail(seq)
        if tail is not None:
            src = seq.block_table[tail]
            dst = self._take()
            self.ref_count[src] -= 1  # still held by a sibling: never reaches 0 here
            seq.block_table[tail] = dst
            copies.append((src, dst))
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares the blocks that hold its computed tokens (a prefix of the parent's)."""
        shared = parent.block_table[: self.blocks_for(child.num_computed_tokens)]
        for block in shared:
            self.ref_count[block] += 1
        child.block_table = list(shared)
        child.num_keyed_blocks = min(parent.num_keyed_blocks, len(shared))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks that ``seq``'s computed tokens have filled, so later requests find them.
        A key already owned by another block stays with that one; this block stays unkeyed."""
        if not self.enable_prefix_caching:
            return
        # Accepted drafts are computed a moment before they are appended: key only blocks of known tokens.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        first = seq.num_keyed_blocks
        if num_full <= first:  # most decode steps: no block filled since the last
            return
        # Blocks left unkeyed at the last look (their keys other blocks') stay so until a block
        # fills or some key is given up: until then another look would change nothing.
        if seq.keys_looked_at == (num_full, self.keys_dropped):
            return
        hashes = self.block_hashes(seq, num_full)
        for i in range(first, num_full):
            block, key = seq.block_table[i], hashes[i]
            if self.block_key[block] is None and key not in self._by_key:
                self.block_key[block] = key
                self._by_key[key] = block
            # A held block stays keyed (it is evicted only when nobody holds it): the leading
            # keyed blocks need no second look. One left unkeyed (its key is another block's) is
            # looked at again next time, as that block may be evicted meanwhile.
            if first == i and self.block_key[block] is not None:
                first += 1
        seq.num_keyed_blocks = first
        seq.keys_looked_at = (num_full, self.keys_dropped)

    def cache_filled_blocks(self, seqs: list[Sequence]) -> None:
        """``cache_full_blocks`` for each of ``seqs`` whose computed tokens reach past its keyed blocks."""
        if not self.enable_prefix_caching:
            return
        size, dropped = self.block_size, self.keys_dropped
        for seq in seqs:
            num_full = min(seq.num_computed_tokens, seq.num_tokens) // size
            if num_full > seq.num_keyed_blocks and seq.keys_looked_at != (num_full, dropped):
                self.cache_full_blocks(seq)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks. Keyed ones stay cached, the tail's blocks ahead of
        the prompt's in eviction order (a prefix is worth more than the end of one request)."""
        self.release(reversed(seq.block_table))
        seq.block_table = []
        seq.num_keyed_blocks = 0
        seq.keys_looked_at = None

    def hold(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (cached ones are revived): none is evicted
        until ``release``. For a prefix held for a request that has not arrived (engine/prefix_holds.py)."""
        for block in blocks:
            self._hold(block)

    def release(self, blocks) -> None:
        """Drop one reference to each of ``blocks``, in order: a keyed block nobody holds is cached
        (evicted in that order), an unkeyed one is free."""
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_key[block] is not None:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def take_tier_moves(self) -> list[TierMove]:
        """The copies between the pool and the tier decided since the last call, in order: the
        runner makes them before its next forward."""
        moves, self._tier_moves = self._tier_moves, []
        return moves

    def reset_prefix_cache(self) -> int:
        """Forget every cached, unheld block's content (e.g. after new weights), and the tier's;
        blocks dropped from the pool."""
        if self.tier is not None:
            self.tier.clear()
        dropped = len(self._cached)
        while self._cached:
            self._free.append(self._unkey(self._cached.popitem(last=False)[0]))
        return dropped

    # ---- slots -------------------------------------------------------------------------

    def slot(self, seq: Sequence, position: int) -> int:
        """The pool slot holding token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- internals ---------------------------------------------------------------------

    def _shared_tail(self, seq: Sequence) -> int | None:
        """Index in ``seq``'s table of the partial block its next token is written to, when
        another sequence holds it too (after a fork); else None."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        if offset and index < len(seq.block_table) and self.ref_count[seq.block_table[index]] > 1:
            return index
        return None

    def _hold(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self._cached[block]
        self.ref_count[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block = self._cached.popitem(last=False)[0]
            if self.tier is not None and self._found[block]:
                self._spill(block)
            self._unkey(block)
        self.ref_count[block] = 1
        self._found[block] = False
        return block

    def _spill(self, block: int) -> None:
        """Decide the copy of an evicted, reused block's KV into the tier (none if the tier has it)."""
        key = self.block_key[block]
        slot = self.tier.reserve(key)
        if slot is not None:
            self._tier_moves.append(TierMove(True, block, slot, key))

    def _copy_back(self, key: bytes) -> int | None:
        """A new pool block, held and keyed ``key``, that the tier's entry is copied into; None if
        the tier lacks it or the pool has no block to give."""
        slot = self.tier.lookup(key) if self.num_free else None
        if slot is None:
            return None
        block = self._take()
        self._found[block] = True
        self.block_key[block] = key
        self._by_key[key] = block
        self._tier_moves.append(TierMove(False, block, slot, key))
        return block

    def _unkey(self, block: int) -> int:
        del self._by_key[self.block_key[block]]
        self.keys_dropped += 1
        self.block_key[block] = None
        return block
