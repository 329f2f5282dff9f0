"""D's hold on a request's cached prefix, from telling the ingress how much of the prompt it has
until the request has ended (prefix-aware PD, docs/serving.md "Prefix-aware PD").

The ingress asks D before P works (``LLMEngine.hold_prefix``): D answers with the number of
leading prompt tokens its prefix cache holds, and P computes and sends only the KV after them.
Those blocks must still be there when the request arrives with P's KV, which begins at that
token, and again if the request is preempted and readmitted: the hold keeps one reference to
each of them, so they are never evicted, until the request ends, or until ``until`` if it never
comes (the ingress chose otherwise, or the client left before D was called).
"""

from __future__ import annotations

from typing import Callable

from engine.block_manager import BlockManager


class PrefixHolds:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._held: dict[str, tuple[list[int], float]] = {}  # request id -> (blocks, until: time.time())

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, request_id: str, blocks: list[int], until: float) -> None:
        """Keep ``blocks`` for ``request_id`` (replacing an earlier hold of the same id)."""
        self.drop(request_id)
        self.blocks.hold(blocks)
        self._held[request_id] = (blocks, until)

    def drop(self, request_id: str) -> None:
        """The request ended: its blocks go back to the cache (or stay held by whoever holds them)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.blocks.release(reversed(held[0]))

    def expire(self, now: float, in_engine: Callable[[str], bool]) -> None:
        """Drop the holds past their time whose request is not in the engine."""
        for request_id in [r for r, (_, until) in self._held.items() if until <= now and not in_engine(r)]:
            self.drop(request_id)
