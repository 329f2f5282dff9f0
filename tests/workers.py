"""Which pytest-xdist worker runs a test module (``make test`` runs ``-n 2 --dist loadgroup``).

Every module is one unit of work, so its module-scoped engines are built once. The served modules
(those that start Ray + Serve: by one of tests/serving.py's ``STARTS_SERVE`` names in their source, or
the ``own_ray`` marker) are all in one unit, "served": one worker runs them in the collection's order
(own_ray last), sharing the kept apps of one Ray, while the other worker runs the model-free and
in-process modules beside it. Decided from the modules' source, so a new module is placed by what it
starts, not by a list."""

from __future__ import annotations

import functools
from pathlib import Path
import re

import pytest

from tests.serving import STARTS_SERVE

SERVED = "served"
_STARTS_SERVE = re.compile(r"\b(" + "|".join(re.escape(name) for name in STARTS_SERVE) + r")\b")


@functools.cache
def starts_serve(module: Path) -> bool:
    return _STARTS_SERVE.search(module.read_text()) is not None


def is_served(item) -> bool:
    return item.get_closest_marker("own_ray") is not None or starts_serve(item.path)


def group_by_module(items: list) -> None:
    """Mark each item with its xdist group: "served", or its module's path."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(SERVED if is_served(item) else item.nodeid.split("::")[0]))
