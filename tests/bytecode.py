"""Compiled modules kept between the processes the suite starts.

Where the environment says not to write compiled modules beside the sources (PYTHONDONTWRITEBYTECODE,
as on the shared development machine) and the installed packages came without them (uv installs
none unless asked), every process compiles what it imports from source again: each Ray Serve replica,
Serve's controller and proxy, each subprocess, ray, transformers, pandas, chardet... That is about half
of a replica's CPU seconds of imports (benchmarks/replica_start.py). The suite keeps them instead in a
cache of its own outside the source trees (PYTHONPYCACHEPREFIX), which the children inherit through the
environment; a cache the environment already names is left as it is.
"""

from __future__ import annotations

import os
import sys


def keep_compiled_modules() -> None:
    """This process and every process it starts from now on write and read compiled modules in
    ``~/.cache/pdserve/pycache`` (under XDG_CACHE_HOME when set), unless bytecode is written already."""
    if not sys.dont_write_bytecode or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve", "pycache")
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = cache
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
