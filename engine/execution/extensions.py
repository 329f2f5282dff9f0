"""The project's C++ kernels, compiled on first use by torch's JIT builder (ninja, a minute or two
on 2 cores) and kept between runs.

One build per what the compiler's command depends on: the sources' text, the flags and the torch
it builds against (its include and library paths, which name the virtual environment). The
sources are copied into a directory named by their hash, under torch's extension root
(``TORCH_EXTENSIONS_DIR``, else ~/.cache/torch_extensions), and compiled from there. Torch's own
cache keys a build by the extension's name alone and rebuilds when the command changes, so two
checkouts of the project (worktrees, a CI clone beside a working copy) rebuilt each other's kernels
at every start, and a process loading one waited on the other's build lock.

A finished build is imported straight from its directory (a ``built`` mark written after the
build), without torch's build lock: a process killed while it held that lock left it behind, and
every later load waited on it forever. Only the first build takes the lock.

Every kernel is compiled with OpenMP: ATen's ``at::parallel_for`` is a header template whose
``#pragma omp parallel`` an extension built without ``-fopenmp`` ignores, so its loops ran on one
thread. Linked by soname, the extension shares torch's own libgomp (one thread pool, sized by
``torch.set_num_threads``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
import sys

OPENMP = ["-fopenmp"]


def build_extension(name: str, sources: list[Path], cflags: list[str]):
    """The loaded module of ``sources`` compiled with ``cflags`` (built now if it never was)."""
    import torch
    from torch.utils import cpp_extension

    texts = [source.read_bytes() for source in sources]
    # torch's real path (the environment's): the same through a symlinked .venv, as a git worktree has,
    # which would otherwise build every kernel again
    depends = "\0".join([*cflags, *OPENMP, os.path.dirname(os.path.realpath(torch.__file__))])
    digest = hashlib.sha256(b"\0".join(texts) + depends.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    directory = root / "pdserve" / f"{name}-{digest}"
    built = directory / "built"
    if built.exists():
        return _import(name, directory / f"{name}.so")
    directory.mkdir(parents=True, exist_ok=True)
    copies = []
    for source, text in zip(sources, texts):
        copy = directory / source.name
        if not copy.exists() or copy.read_bytes() != text:  # another process may be writing it: same bytes
            partial = directory / f".{source.name}.{os.getpid()}"
            partial.write_bytes(text)
            partial.replace(copy)
        copies.append(str(copy))
    # ninja comes with the project's install, beside this interpreter, not necessarily on PATH.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    module = cpp_extension.load(name=name, sources=copies, extra_cflags=cflags + OPENMP,
                                extra_ldflags=OPENMP, build_directory=str(directory))
    built.touch()
    return module


def _import(name: str, library: Path):
    import torch  # noqa: F401  (the extension links against torch's libraries, loaded by this import)

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
