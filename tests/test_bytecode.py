"""The suite's cache of compiled modules (tests/bytecode.py): where the environment says not to write
them, the suite's processes and their children keep them outside the source trees."""

import os
from pathlib import Path
import subprocess
import sys

REPO = Path(__file__).resolve().parents[1]
# A process as the suite starts one: the cache turned on, then a module of its own imported, and a
# child that imports another (a Ray worker inherits the environment the same way).
SCRIPT = """
import subprocess, sys
from tests.bytecode import keep_compiled_modules
keep_compiled_modules()
import first_module
subprocess.run([sys.executable, "-c", "import second_module"], check=True)
"""


def run(tmp_path: Path, **env: str) -> Path:
    sources = tmp_path / "sources"
    sources.mkdir()
    for name in ("first_module", "second_module"):
        (sources / f"{name}.py").write_text("VALUE = 1\n")
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPYCACHEPREFIX"}
    environment.update(PYTHONPATH=f"{REPO}{os.pathsep}{sources}", XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    subprocess.run([sys.executable, "-c", SCRIPT], env=environment, check=True, cwd=tmp_path)
    return sources


def test_modules_compiled_where_not_to_be_written_go_to_the_cache_for_children_too(tmp_path):
    sources = run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    cached = {p.name.split(".")[0] for p in (tmp_path / "cache" / "pdserve" / "pycache").rglob("*.pyc")
              if str(sources).lstrip(os.sep) in str(p)}
    assert cached == {"first_module", "second_module"}
    assert not (sources / "__pycache__").exists()  # nothing beside the sources


def test_a_cache_the_environment_names_is_left_as_it_is(tmp_path):
    theirs = tmp_path / "theirs"
    run(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(theirs))
    assert not (tmp_path / "cache").exists()
    assert not {p.name.split(".")[0] for p in theirs.rglob("*.pyc")} & {"first_module", "second_module"}
