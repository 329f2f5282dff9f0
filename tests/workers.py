"""Which pytest-xdist worker runs a test module (``make test`` runs ``pytest -n 2``).

Every module is one unit of work, so its module-scoped engines are built once. The served modules
(those that start Ray + Serve: by one of tests/serving.py's ``STARTS_SERVE`` names in their source,
or marked ``own_ray``) are all one unit, "served": one worker runs them in the collection's order
(own_ray last), sharing the kept apps of one Ray, while the other worker runs the model-free and
in-process modules beside them. Decided from the modules' source, so a new module is placed by
what it starts, not by a list. (xdist's own ``--dist loadgroup`` groups by renaming the tests'
ids, which pytest 9 no longer lets it do: this scheduler groups by module instead.)"""

from __future__ import annotations

import functools
from pathlib import Path
import re

from tests.serving import STARTS_SERVE

SERVED = "served"
_SERVED_SOURCE = re.compile(r"\b(" + "|".join(re.escape(name) for name in STARTS_SERVE) + r")\b|mark\.own_ray\b")


@functools.cache
def is_served(module: Path) -> bool:
    return _SERVED_SOURCE.search(module.read_text()) is not None


def make_scheduler(config, log):
    """xdist's scope scheduler with a module's scope "served" for the served modules. Scopes go out
    largest first, so the served unit starts at once on one worker; a worker gets another unit
    only when at most two tests of its own are left."""
    from xdist.scheduler import LoadScopeScheduling

    class ServedTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SERVED if is_served(config.rootpath / module) else module

    return ServedTogether(config, log)
