"""Decode migration with token replay, and prefill retry: the ingress's half of the failure contract
(docs/serving.md).

A replica that fails while it serves a request (it died, it cannot be reached, the KV it needed is
lost: ``failures.replica_failed``) does not end the request. The ingress starts it again on a live
replica, where Ray Serve routes it:

- nothing has reached the client yet: the request is sent again as it was (prefill retry);
- tokens have: each unfinished choice goes on as a request of its own, its prompt followed by the
  tokens already sent (``GenerationRequest.resumed_output_ids``), with the seed it ran with. The
  engine counts those tokens as output, so the seeded noise (keyed by output position), penalties,
  stop conditions, a grammar and max_new_tokens go on where they were: no token lost, none sent
  twice. In PD it goes through P again (D's KV died with D; P's prefix cache holds the prompt).

The request keeps its priority and its deadline (absolute: a migration does not reset it). After
``max_migrations`` the failure ends the request (a clean 503, deployments/failures.py); so does a
replacement that does not answer before the deadline: never a hang.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
import logging
import time
from typing import AsyncIterator, Callable

from deployments.failures import REPLICA_RETRY_AFTER_S, replica_failed, root_cause
from deployments.ingress.streams import indexed
from dialects.errors import APIError
from engine.outputs import RequestOutput
from engine.request import GenerationRequest
from sampling.params import choice_seed

logger = logging.getLogger("ray.serve." + __name__)
Start = Callable[[GenerationRequest], AsyncIterator[RequestOutput]]


@dataclass
class ChoiceSoFar:
    """What the client has received of one choice."""

    index: int
    seed: int | None  # the seed it runs with, once an output has said it
    token_ids: list[int] = field(default_factory=list)
    logprob: float = 0.0  # the cumulative logprob of token_ids
    started: bool = False  # a token of it reached the client
    finished: bool = False

    def record(self, output: RequestOutput) -> None:
        # A beam search's reply from P carries no token: the request can still be sent again whole.
        self.started = self.started or bool(output.new_token_ids) or output.finished
        self.finished, self.seed = output.finished, output.seed
        self.token_ids += output.new_token_ids
        self.logprob += sum(lp.logprob for lp in output.logprobs)


async def migrating(start: Start, request: GenerationRequest, max_migrations: int,
                    on_migrate: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
    """``start(request)``'s outputs, continued on another replica when one fails (at most
    ``max_migrations`` times). Outputs keep the request's id and choice indices."""
    so_far = [ChoiceSoFar(j, None) for j in range(request.n)]
    legs: list[tuple[GenerationRequest, int | None]] = [(request, None)]  # (engine request, the choice it carries)
    migrations = 0
    while True:
        # A replacement must answer before the deadline; the engine enforces it from then on.
        first_within = request.deadline - time.time() if migrations and request.deadline else None
        try:
            async for i, output in _outputs([start(leg) for leg, _ in legs], first_within):
                carried = legs[i][1]
                if carried is not None:
                    output = replace(output, request_id=request.request_id, index=carried)
                so_far[output.index].record(output)
                yield output
            return
        except TimeoutError:
            if not migrations:
                raise
            raise APIError(503, "no replica took over this request before its timeout; retry it",
                           code="replica_unavailable", retry_after=REPLICA_RETRY_AFTER_S) from None
        except Exception as error:
            if not replica_failed(error) or migrations == max_migrations:
                raise
            migrations += 1
            legs = _legs(request, so_far, migrations)
            logger.warning("request %s: a replica failed (%s); migration %d of at most %d, %d choice(s) resumed",
                           request.request_id, type(root_cause(error)).__name__, migrations, max_migrations,
                           len(legs))
            if on_migrate:
                on_migrate()


def _legs(request: GenerationRequest, so_far: list[ChoiceSoFar], migration: int
          ) -> list[tuple[GenerationRequest, int | None]]:
    """The requests that carry ``request`` on: itself again when the client has nothing of it,
    else one per unfinished choice, resumed after the tokens it has."""
    tag = f"{request.request_id}.m{migration}"
    if not any(c.started for c in so_far):
        return [(replace(request, request_id=tag), None)]
    legs = []
    for c in so_far:
        if c.finished:
            continue
        seed = c.seed if c.started else choice_seed(request.params.seed, c.index)
        # The prompt's logprobs and logits reached the ingress with the first tokens: not computed again.
        params = replace(request.params, seed=seed, prompt_logprobs=None, return_context_logits=False)
        legs.append((replace(request, request_id=f"{tag}.{c.index}", params=params, n=1,
                             resumed_output_ids=list(c.token_ids), resumed_logprob=c.logprob), c.index))
    return legs


async def _outputs(streams: list[AsyncIterator[RequestOutput]], first_within: float | None
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as they arrive; the first within ``first_within`` seconds if given
    (TimeoutError otherwise)."""
    outputs = indexed(streams)
    try:
        if first_within is not None:
            try:
                yield await asyncio.wait_for(anext(outputs), max(first_within, 0.0))
            except StopAsyncIteration:
                return
        async for item in outputs:
            yield item
    finally:
        await outputs.aclose()
