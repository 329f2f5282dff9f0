"""Decode migration with token replay, and prefill retry: the ingress's half of the failure contract
(docs/serving.md), as policy; the request flow (deployments/ingress/request_flow.py) applies it.

A replica that fails while it serves a request (it died, it cannot be reached, the KV it needed is
lost: ``failures.replica_failed``) does not end the request. The ingress starts it again on a live
replica, where Ray Serve routes it:

- nothing has reached the client yet: the request is sent again as it was (prefill retry);
- tokens have: each unfinished choice goes on as a request of its own, its prompt followed by the
  tokens already sent (``GenerationRequest.resumed_output_ids``), with the seed it ran with. The
  engine counts those tokens as output, so the seeded noise (keyed by output position), penalties,
  stop conditions, a grammar and max_new_tokens go on where they were: no token lost, none sent
  twice. In PD it goes through P again (D's KV died with D; P's prefix cache holds the prompt).

A replica that Serve drains (scale-down, redeploy) does not fail its requests: it moves them
(``moved_leg``). Each running choice goes on on another D from its KV, tokens so far and sampler
state (engine/running_export.py), through the KV hand-off P's KV takes, by reference (the KV
connector's ``export`` and ``adopt``): nothing is computed again.
The leg is the resumed request token replay would send, so a move that fails (no D takes it, its
KV fetch fails) falls back to token replay with nothing else to change.

The request keeps its priority and its deadline (absolute: a migration does not reset it). After
``max_migrations`` the failure ends the request (a clean 503, deployments/ingress/engine_client.py
``client_error``); so does a replacement that does not answer before the deadline
(``failures.LateReplacement``): never a hang. A failure once the deadline has passed is not
migrated: the request ends with its timeout (deployments/ingress/request_flow.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deployments.failures import replica_failed
from engine.outputs import PrefillResult, RequestOutput
from engine.request import GenerationRequest
from engine.running_export import MovedChoice
from sampling.params import choice_seed


@dataclass
class ChoiceSoFar:
    """What the client has received of one choice."""

    index: int
    seed: int | None  # the seed it runs with, once an output has said it
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the text of token_ids the client has
    logprob: float = 0.0  # the cumulative logprob of token_ids
    started: bool = False  # a token of it reached the client
    finished: bool = False

    def record(self, output: RequestOutput) -> None:
        # A beam search's reply from P carries no token: the request can still be sent again whole.
        self.started = self.started or bool(output.new_token_ids) or output.finished
        self.finished, self.seed = output.finished, output.seed
        self.token_ids += output.new_token_ids
        self.text += output.new_text
        self.logprob += sum(lp.logprob for lp in output.logprobs)


def resumes(error: Exception, migrations: int, max_migrations: int) -> bool:
    """Whether a request that failed with ``error`` after ``migrations`` migrations goes on elsewhere."""
    return replica_failed(error) and migrations < max_migrations


def resume_legs(request: GenerationRequest, so_far: list[ChoiceSoFar], migration: int
                ) -> list[tuple[GenerationRequest, int | None]]:
    """The requests that carry ``request`` on after its ``migration``-th failure, each with the
    choice it carries (None: all of them): itself again when the client has nothing of it, else
    one per unfinished choice, resumed after the tokens it has."""
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


def moved_leg(request: GenerationRequest, choice: MovedChoice, move: int) -> tuple[GenerationRequest, PrefillResult]:
    """The request that carries ``choice`` of ``request`` on after its ``move``-th move, and the
    hand-off its D starts from: the resumed request of token replay (its tokens but the last as
    resumed output, its seed), whose first token is the last one the client has, and whose KV's
    metadata comes with the hand-off (the choice is its only one, index 0); its bytes too unless
    they went by reference (``choice.kv``)."""
    params = replace(request.params, seed=choice.seed, prompt_logprobs=None, return_context_logits=False)
    leg = replace(request, request_id=f"{request.request_id}.v{move}.{choice.index}", params=params, n=1,
                  resumed_output_ids=choice.output_ids[:-1], resumed_logprob=choice.cumulative_logprob)
    handoff = replace(choice.handoff, request_id=leg.request_id,
                      choices=[replace(c, index=0) for c in choice.handoff.choices])
    return leg, handoff
