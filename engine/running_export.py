"""A running request handed to another engine mid-decode: its KV, its tokens so far and its
sampler's state, so that the other engine goes on without computing anything again (a D replica
that Serve drains moves its requests: deployments/replicas/servers.py, docs/serving.md).

The hand-off is P's (engine/outputs.py ``PrefillResult``), so the receiving engine takes it as it
takes P's: DECODE mode, blocks allocated before the bytes arrive, fail-closed. A choice that has
generated ``o_1 .. o_k`` holds KV for its prompt and ``o_1 .. o_{k-1}`` (``o_k`` was sampled last
and is the next step's input): it goes on as a resumed request (``resumed_output_ids`` =
``o_1 .. o_{k-1}``, counted as output: the seeded noise's step, penalties, stop conditions, a
grammar and max_new_tokens go on where they were, as in token-replay migration) whose first token
is ``o_k``, already streamed to the client, with the KV of its context. So the tokens that follow
are the ones the undisturbed run would have made.

The KV leaves the engine by value (``export_choice``); a server that sends the ``Moved`` to another
process first puts each choice's bytes where the receiver can take them over and keeps only the
handle (``Moved.by_reference``: deployments/replicas/servers.py, with its KV connector's ``export``),
so that what travels with the ``Moved`` is small whatever the context's length.

Only a choice running a plain decode moves: not one waiting or receiving its KV, not a request
whose other choices have not forked yet, not a beam search (its beams share one state across
sequences). Those stay where they are (the caller asks again later).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from engine.kv_transfer import KVPayload
from engine.outputs import ChoiceStart, PrefillResult
from engine.request import Mode, Sequence, SequenceStatus


@dataclass
class MovedChoice:
    """One choice of a request that left this engine mid-decode: what another engine needs to go on."""

    index: int  # the choice's index in its request
    seed: int  # the seed it samples with
    output_ids: list[int]  # every token it generated so far, the last one (the next input) included
    cumulative_logprob: float  # of output_ids
    # The hand-off: ``choices`` [the last token], the KV of the prompt and output_ids[:-1]; kv.data
    # [L, 2, prompt + len(output_ids) - 1, Hkv, D], None once the bytes went by reference (``kv``).
    handoff: PrefillResult
    nbytes: int  # of the KV bytes, wherever they are
    kv: Any = None  # the transport's handle to the bytes once they left by reference (Moved.by_reference)


@dataclass
class Moved:
    """A request's last item on its stream when its engine handed it elsewhere: one MovedChoice
    per choice still running (choices that ended before the move ended on the stream as usual)."""

    request_id: str
    choices: list[MovedChoice]
    replica: str = ""  # the replica it left, set by the server that sends it on

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.choices)

    def by_reference(self, export: Callable[[np.ndarray], Any]) -> None:
        """Each choice's KV bytes handed to ``export`` (a KV connector's: it puts them where the
        receiver can take them over and answers their handle); the choice keeps the handle, not the bytes."""
        for choice in self.choices:
            kv = choice.handoff.kv
            choice.kv = export(kv.data)
            choice.handoff = replace(choice.handoff, kv=KVPayload(kv.meta, None))


def movable(seqs: list[Sequence], searching: bool) -> bool:
    """Whether a request's sequences can move now: each one decoding with every token but its
    last computed, no choice left to fork, no beam search, not PREFILL (it hands over anyway)."""
    return bool(seqs) and not searching and all(
        seq.status is SequenceStatus.RUNNING and seq.mode is not Mode.PREFILL and not seq.pending_choices
        and seq.num_output_tokens >= 1 and seq.num_computed_tokens == seq.num_tokens - 1 for seq in seqs)


def export_choice(seq: Sequence, runner) -> MovedChoice:
    """``seq``'s state and the KV of every token but its last, copied out of the pool ([L, 2, T, Hkv, D]).
    ``runner``: the engine's ModelRunner (its ``export_kv`` and ``kv_meta``). Frees nothing."""
    context = seq.num_tokens - 1
    kv = KVPayload(runner.kv_meta(context), runner.export_kv(seq, 0, context))
    last = seq.token_ids[-1]
    handoff = PrefillResult(seq.request_id, [ChoiceStart(seq.index, last, None, seq.seed)], kv, 0.0)
    return MovedChoice(seq.index, seq.seed, list(seq.output_ids), seq.cumulative_logprob, handoff, kv.nbytes)
