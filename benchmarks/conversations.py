"""Multi-turn conversations against a running app, the workload prefix reuse is for.

Each conversation has its own long system prompt; each turn's prompt is the turn before's, its
answer (the ids streamed back) and new user tokens, so a turn can only be sent once the one
before has ended. Conversations start at ``rate / turns`` per second (Poisson), so that
``rate`` is the offered load in requests per second, as for the other workloads.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from tools.clients import Result, send
from tools.loadgen import Work, arrival_gaps


async def run_conversations(base_url: str, conversations: int, turns: int, system_len: int, user_len: int,
                            output_len: int, rate: float, seed: int, timeout: int = 600
                            ) -> tuple[list[Result], float]:
    """Every turn's result, and the time from the first request to the last answer."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 800) for _ in range(n)]

    async def conversation(client: httpx.AsyncClient, index: int, system: list[int], users: list[list[int]]
                           ) -> list[Result]:
        history, results = list(system), []
        for turn, user in enumerate(users):
            history += user
            work = Work(index * turns + turn, list(history), "", output_len, priority=5)
            result = await send(client, "infer_token", work, "", timeout)
            results.append(result)
            if not result.ok:
                break
            history += result.token_ids
        return results

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout + 30) as client:
        plans = [(tokens(system_len), [tokens(user_len) for _ in range(turns)]) for _ in range(conversations)]
        gaps = arrival_gaps(rate / turns, 1.0, seed)
        start = time.perf_counter()
        tasks = []
        for i, (system, users) in enumerate(plans):
            tasks.append(asyncio.create_task(conversation(client, i, system, users)))
            await asyncio.sleep(next(gaps))
        results = [r for done in await asyncio.gather(*tasks) for r in done]
    return results, time.perf_counter() - start
