"""The serving extensions every dialect's request takes, declared once: ``priority``, ``timeout``
and ``ignore_eos`` (MindIE's, OpenAI's chat and completions, Anthropic's Messages, OpenAI's
Responses). The priority's range and default and the timeout's default are the engine's
(engine/request.py, engine/config.py)."""

from typing import Annotated

from pydantic import Field, StrictBool, StrictInt

from engine.config import EngineConfig
from engine.request import PRIORITY_MAX, PRIORITY_MIN

# A request's timeout when it gives none (the engine's deadline for such requests), and the largest
# it may give: seconds, queueing and generation together.
TIMEOUT_S, MAX_TIMEOUT_S = int(EngineConfig.default_timeout_s), 3600

Priority = Annotated[StrictInt, Field(PRIORITY_MAX, ge=PRIORITY_MIN, le=PRIORITY_MAX,
                                      description=f"{PRIORITY_MIN} is served first")]
# vLLM's OpenAI server sends 0 for "no priority": accepted on OpenAI's routes, served as the default.
VllmPriority = Annotated[StrictInt, Field(PRIORITY_MAX, ge=0, le=PRIORITY_MAX,
                                          description=f"{PRIORITY_MIN} is served first, {PRIORITY_MAX} last; "
                                                      f"0 (vLLM's default) is {PRIORITY_MAX}")]
Timeout = Annotated[StrictInt, Field(TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S,
                                     description="seconds, queueing and generation together")]
IgnoreEos = Annotated[StrictBool, Field(False)]
