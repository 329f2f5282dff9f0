"""What an engine replica measures of its own pace, for PD's policy and the rate-matched autoscaler.

A replica counts, where it serves its streams (deployments/replicas/servers.py), the tokens it sends and
the time between two batches of one stream; P also counts the prompts it is asked to compute.
From them:

- ``token_ms``: the recent time between two tokens of a stream, averaged over the streams'
  batches of the last ``TOKEN_WINDOW_S`` (a batch holding k steps of a choice counts as k gaps):
  D's time per output token as its clients see it, what a local prefill would delay
  (deployments/pd/disaggregation.py). 0 when no stream sent two batches in the window;
- ``rates(prompt_tokens_computed)``: per second since the previous call, the prompt tokens the
  engine computed, the prompts asked for and the tokens sent. Ray Serve calls
  ``record_autoscaling_stats`` every ``metrics_interval_s`` and averages what it reports over its
  look-back period (deployments/replicas/autoscaling.py).
"""

from __future__ import annotations

from collections import Counter, deque
import time
from typing import Callable

from engine.outputs import RequestOutput

TOKEN_WINDOW_S = 2.0  # how far back token_ms looks


class LoadMeter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tokens_sent = 0  # output tokens sent to callers, since start
        self.prompts = 0  # prompts asked for, since start
        self._gaps: deque[tuple[float, float]] = deque()  # (when, seconds per step) of a stream's batch
        self._last_rates: tuple[float, int, int, int] | None = None  # (when, computed, prompts, sent) at last rates()

    def sent(self, batch: list[RequestOutput], previous: float | None) -> float:
        """A stream sent ``batch``; ``previous``: when it sent its last one (None: this is its
        first, whose wait is the prompt's or the hand-off's, not a step's). Returns now, the
        stream's next ``previous``."""
        now = self.clock()
        self.tokens_sent += sum(len(output.new_token_ids) for output in batch)
        steps = max(Counter(output.index for output in batch).values(), default=0)
        if previous is not None and steps:
            self._gaps.append((now, (now - previous) / steps))
        self._forget(now)
        return now

    def token_ms(self) -> float:
        self._forget(self.clock())
        return 1000 * sum(gap for _, gap in self._gaps) / len(self._gaps) if self._gaps else 0.0

    def _forget(self, now: float) -> None:
        while self._gaps and now - self._gaps[0][0] > TOKEN_WINDOW_S:
            self._gaps.popleft()

    def rates(self, prompt_tokens_computed: int) -> dict[str, float]:
        """Per second since the last call (0 on the first): prompt tokens computed, prompts asked
        for, output tokens sent."""
        now = self.clock()
        last, self._last_rates = self._last_rates, (now, prompt_tokens_computed, self.prompts, self.tokens_sent)
        if last is None or now <= last[0]:
            return {"prompt_tokens_per_s": 0.0, "prompts_per_s": 0.0, "output_tokens_per_s": 0.0}
        elapsed = now - last[0]
        return {"prompt_tokens_per_s": (prompt_tokens_computed - last[1]) / elapsed,
                "prompts_per_s": (self.prompts - last[2]) / elapsed,
                "output_tokens_per_s": (self.tokens_sent - last[3]) / elapsed}
