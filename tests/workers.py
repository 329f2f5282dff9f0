"""Which pytest-xdist worker runs a test module (``make test`` runs ``pytest -n 2``).

Every module is one unit of work, so its module-scoped engines are built once. The served modules
(those that start Serve on the suite's shared Ray: by one of tests/serving.py's ``STARTS_SERVE``
names in their source) are all one unit, "served": one worker runs them in the collection's
order, sharing the kept apps of one Ray. The modules that start a Ray of their own (marked
``own_ray``: a cluster of several nodes, a GCS on Redis, a TLS proxy, a 2-CPU placement, `make
serve`) are a second unit, "own_ray", run in order by the other worker first, beside the served
unit; that worker then runs the model-free and in-process modules, and last the served modules
marked ``beside_served``, a third unit, "beside_served", in a shared Ray of that worker's own: they
deploy only apps of their own (no kept app: it would be deployed twice) and put no load of their
own clients on the machine (no load generators, no faults timed against a deadline), so the served
worker's last ~10 minutes, which it ran alone, have them beside it. The Rays never meet (each is
started with ``address="local"``; none reads /tmp/ray/session_latest). Decided from the modules'
source, so a new module is placed by what it starts (and its mark), not by a list. (xdist's own
``--dist loadgroup`` groups by renaming the tests' ids, which pytest 9 no longer lets it do: this
scheduler groups by module instead.)"""

from __future__ import annotations

import functools
from pathlib import Path
import re

from tests.serving import STARTS_SERVE

SERVED, OWN_RAY, BESIDE_SERVED = "served", "own_ray", "beside_served"
_SERVED_SOURCE = re.compile(r"\b(" + "|".join(re.escape(name) for name in STARTS_SERVE) + r")\b")
_OWN_RAY_SOURCE = re.compile(r"mark\.own_ray\b")
_BESIDE_SERVED_SOURCE = re.compile(r"mark\.beside_served\b")


@functools.cache
def unit(module: Path) -> str | None:
    """OWN_RAY, BESIDE_SERVED, SERVED, or None for a module that is a unit of its own."""
    source = module.read_text()
    if _OWN_RAY_SOURCE.search(source):
        return OWN_RAY
    if _BESIDE_SERVED_SOURCE.search(source):
        return BESIDE_SERVED
    return SERVED if _SERVED_SOURCE.search(source) else None


def make_scheduler(config, log):
    """xdist's scope scheduler with the scopes "served", "own_ray" and "beside_served" (``unit``).
    Scopes go out largest first, so the served unit starts at once on one worker; the own_ray unit
    goes next, to the other worker (both are long: started together, neither waits at the end for
    the other); the beside_served unit goes last, to whichever worker frees first (the other one:
    its Ray then lives only while it runs); a worker gets another unit only when at most two tests
    of its own are left."""
    from xdist.scheduler import LoadScopeScheduling

    class ServedTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return unit(config.rootpath / module) or module

        def _assign_work_unit(self, node) -> None:
            if OWN_RAY in self.workqueue and SERVED not in self.workqueue and SERVED not in self.assigned_work[node]:
                self.workqueue.move_to_end(OWN_RAY, last=False)
            elif BESIDE_SERVED in self.workqueue and len(self.workqueue) > 1:
                self.workqueue.move_to_end(BESIDE_SERVED)
            super()._assign_work_unit(node)

    return ServedTogether(config, log)
