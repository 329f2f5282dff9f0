"""Which pytest-xdist worker runs a test module (``make test`` runs ``pytest -n 2``).

Every module is one unit of work, so its module-scoped engines are built once. The served modules
(those that start Serve on the suite's shared Ray: by one of tests/serving.py's ``STARTS_SERVE``
names in their source) are all one unit, "served": one worker runs them in the collection's
order, sharing the kept apps of one Ray. The modules that start a Ray of their own (marked
``own_ray``: a cluster of several nodes, a GCS on Redis, a TLS proxy, a 2-CPU placement, `make
serve`) are a second unit, "own_ray", run in order by the other worker first, beside the served
unit; that worker then runs the model-free and in-process modules. Their Rays never meet the
shared one (each is started with ``address="local"``; none reads
/tmp/ray/session_latest). Decided from the modules' source, so a new module is placed by what
it starts, not by a list. (xdist's own ``--dist loadgroup`` groups by renaming the tests' ids,
which pytest 9 no longer lets it do: this scheduler groups by module instead.)"""

from __future__ import annotations

import functools
from pathlib import Path
import re

from tests.serving import STARTS_SERVE

SERVED, OWN_RAY = "served", "own_ray"
_SERVED_SOURCE = re.compile(r"\b(" + "|".join(re.escape(name) for name in STARTS_SERVE) + r")\b")
_OWN_RAY_SOURCE = re.compile(r"mark\.own_ray\b")


@functools.cache
def unit(module: Path) -> str | None:
    """OWN_RAY, SERVED, or None for a module that is a unit of its own."""
    source = module.read_text()
    if _OWN_RAY_SOURCE.search(source):
        return OWN_RAY
    return SERVED if _SERVED_SOURCE.search(source) else None


def make_scheduler(config, log):
    """xdist's scope scheduler with the scopes "served" and "own_ray" (``unit``). Scopes go out
    largest first, so the served unit starts at once on one worker; the own_ray unit goes next, to
    the other worker (both are long: started together, neither waits at the end for the other);
    a worker gets another unit only when at most two tests of its own are left."""
    from xdist.scheduler import LoadScopeScheduling

    class ServedTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return unit(config.rootpath / module) or module

        def _assign_work_unit(self, node) -> None:
            if OWN_RAY in self.workqueue and SERVED not in self.workqueue and SERVED not in self.assigned_work[node]:
                self.workqueue.move_to_end(OWN_RAY, last=False)
            super()._assign_work_unit(node)

    return ServedTogether(config, log)
