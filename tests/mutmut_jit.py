"""`make mutants`'s "triton" part (docs/testing.md): mutation testing of Triton kernels, which mutmut cannot do.

mutmut 3 skips decorated functions, and its trampolines (every mutant in one file, picked at call time)
could not reach a ``@triton.jit`` kernel anyway: Triton reads the kernel's source, not the function
object. So each mutant here is a whole copy of the source file with one change, made by mutmut's own
operators (the same mutants mutmut would make, the jit kernels included), and the selected tests run
against it under Triton's interpreter (TRITON_INTERPRET=1: the kernels' code on CPU tensors) in a
process forked from one that has imported torch and triton, stopping at the first failure.

Run in a copy of the tree with its part's config as setup.cfg (the Makefile's `mutants` target):
``python tests/mutmut_jit.py run [GLOB...]`` writes ``mutants/jit-results.json`` (name -> killed, survived,
timeout), ``report`` prints the counts and the survivors, ``show NAME`` prints a mutant as a diff.
Keys read from setup.cfg's [mutmut]: ``jit_sources`` (one line a file: its path, then the tests that
its mutants run, fastest first), ``pytest_add_cli_args`` (as mutmut reads it), ``max_children``,
``jit_sample_every`` (N: the sample is every Nth mutant of each kernel, its 1st, N+1st...; 1 by default).
The sample runs first, so a run its bound stops has checked the sample whole before the rest; the
report counts the sample apart. Only the ``@triton.jit`` kernels are mutated: their launchers are host
code that mutmut itself can run.
"""

from __future__ import annotations

import configparser
import difflib
import fnmatch
import json
import math
import os
from pathlib import Path
import resource
import shutil
import signal
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # read by triton at its import, below in run()

RESULTS = Path("mutants/jit-results.json")
COPIED = ("engine", "sampling", "deployments", "dialects", "configs", "tests", "benchmarks")


def config() -> dict:
    parser = configparser.ConfigParser()
    parser.read("setup.cfg")
    lines = lambda key: [x for x in parser.get("mutmut", key, fallback="").split("\n") if x]  # noqa: E731
    return {"sources": {line.split()[0]: line.split()[1:] for line in lines("jit_sources")},
            "args": lines("pytest_add_cli_args"), "children": int(parser.get("mutmut", "max_children", fallback="2")),
            "sample_every": int(parser.get("mutmut", "jit_sample_every", fallback="1"))}


def in_sample(name: str, every: int) -> bool:
    """Whether the mutant ``<module>.<kernel>__jit_<n>`` is in the sample: n = 1, every + 1, 2 * every + 1..."""
    return (int(name.rsplit("_", 1)[1]) - 1) % every == 0


def _is_kernel(node) -> bool:
    import libcst as cst
    return isinstance(node, cst.FunctionDef) and bool(node.decorators) and all(
        cst.Module([]).code_for_node(d.decorator) == "triton.jit" for d in node.decorators)


def mutants(path: str) -> dict[str, str]:
    """name -> the whole file with one mutation, for every mutation mutmut's operators make inside a
    ``@triton.jit`` kernel of ``path``; kept in mutants/ (a libcst pass a mutant: minutes for a file)."""
    cache = Path(f"mutants/jit-mutants-{path.replace('/', '.')}.json")
    if cache.exists():
        return json.loads(cache.read_text())
    from mutmut.mutation import file_mutation

    class KernelsToo(file_mutation.MutationVisitor):
        def _skip_node_and_children(self, node):  # a kernel is mutated; its decorator is not
            return False if _is_kernel(node) else super()._skip_node_and_children(node)

    source = Path(path).read_text()
    saved, file_mutation.MutationVisitor = file_mutation.MutationVisitor, KernelsToo
    try:
        module, found, _, _ = file_mutation.create_mutations(path, source)
    finally:
        file_mutation.MutationVisitor = saved
    module_name = path.removesuffix(".py").replace("/", ".")
    counts: dict[str, int] = {}
    result = {}
    for mutation in found:
        if not _is_kernel(mutation.contained_by_top_level_function):
            continue
        function = mutation.contained_by_top_level_function.name.value
        counts[function] = counts.get(function, 0) + 1
        code = module.deep_replace(mutation.original_node, mutation.mutated_node).code
        if code != source:
            result[f"{module_name}.{function}__jit_{counts[function]}"] = code
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


def _start(worker: Path, path: str, code: str, args: list[str], cpu_s: int | None = None) -> int:
    """A child process in ``worker`` (a copy of the tree) with ``code`` as ``path``: pytest's exit code;
    past ``cpu_s`` seconds of CPU it is killed (SIGXCPU)."""
    (worker / path).write_text(code)
    pid = os.fork()
    if pid == 0:
        try:
            if cpu_s is not None:
                resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            os.chdir(worker)
            sys.path.insert(0, str(worker))
            sys.dont_write_bytecode = True  # two mutants of one size written in one second: no stale .pyc
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            import pytest
            os._exit(int(pytest.main(args)))
        except BaseException:
            os._exit(99)
    return pid


def run(*patterns: str) -> None:
    """Every mutant not run yet (or those named by ``patterns``, globs, run again)."""
    cfg = config()
    args = {path: ["-x", "-q", *cfg["args"], *tests] for path, tests in cfg["sources"].items()}
    import pytest  # noqa: F401  (imported once here, inherited by every child)
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import triton  # noqa: F401
    from importlib.metadata import entry_points
    for plugin in entry_points(group="pytest11"):  # the installed plugins (dash, hypothesis, langsmith...): seconds
        try:                                       # of imports a child would pay each; none imports this tree
            plugin.load()
        except Exception:
            pass

    workers = [Path(f"mutants/w{i}").resolve() for i in range(cfg["children"])]
    for worker in workers:
        shutil.rmtree(worker, ignore_errors=True)
        for name in COPIED:
            if Path(name).exists():
                shutil.copytree(name, worker / name, ignore=shutil.ignore_patterns("__pycache__"))
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    clean = {}
    for path in cfg["sources"]:
        # Twice: the first run also builds what the tests build once (an engine's C++ kernels, into the
        # part's empty extensions cache: minutes), which no mutant's run pays; the second is timed.
        for _ in range(2):
            _, status, usage = os.wait4(_start(workers[0], path, Path(path).read_text(), args[path]), 0)
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(f"the selected tests fail on the unmutated {path}: fix them first")
            clean[path] = usage.ru_utime + usage.ru_stime  # CPU seconds: what a loaded machine does not stretch
    todo = [(path, name, code) for path in cfg["sources"] for name, code in mutants(path).items()
            if (any(fnmatch.fnmatch(name, p) for p in patterns) if patterns else name not in results)]
    todo.sort(key=lambda item: not in_sample(item[1], cfg["sample_every"]))  # the sample first (a stable sort)
    print(f"{len(todo)} mutants to run; the clean runs took {', '.join(f'{t:.0f} s' for t in clean.values())} of CPU",
          flush=True)
    # A mutant's bound: 3 x the clean run's CPU time + 30 s of CPU (a mutant that loops forever), and a wall
    # clock bound 10 times that for a child that waits without computing.
    cpu_bound = {path: math.ceil(3 * t + 30) for path, t in clean.items()}
    running: dict[int, tuple] = {}  # pid -> (worker, path, name, wall deadline)
    free = list(workers)

    def stop(signum, frame):  # the part's bound (timeout's SIGTERM): no child outlives the run
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        sys.exit(f"stopped by signal {signum}; {len(todo) + len(running)} mutants not checked")
    signal.signal(signal.SIGTERM, stop)
    while todo or running:
        while todo and free:
            path, name, code = todo.pop(0)
            worker = free.pop()
            running[_start(worker, path, code, args[path], cpu_bound[path])] = (
                worker, path, name, time.monotonic() + 10 * cpu_bound[path])
        time.sleep(0.2)
        for pid, (worker, path, name, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() < deadline:
                continue
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            exit_code = os.waitstatus_to_exitcode(status) if done else None
            verdict = ("timeout" if exit_code in (None, -signal.SIGXCPU, -signal.SIGKILL)
                       else "survived" if exit_code == 0 else "killed")
            results[name] = verdict
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True))
            print(f"{name}: {verdict}", flush=True)
            (worker / path).write_text(Path(path).read_text())
            del running[pid]
            free.append(worker)


def report() -> None:
    cfg = config()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    names = [name for path in cfg["sources"] for name in mutants(path)]
    verdicts = [results.get(name, "not checked") for name in names]
    print(json.dumps(_counts(verdicts)))
    if cfg["sample_every"] > 1:
        sample = [v for name, v in zip(names, verdicts) if in_sample(name, cfg["sample_every"])]
        print(f"sample (every {cfg['sample_every']}th mutant of each kernel):", json.dumps(_counts(sample)))
    for name, verdict in zip(names, verdicts):
        if verdict == "survived":
            print(f"    {name}: survived")


def _counts(verdicts: list[str]) -> dict:
    """The verdicts counted, and the score: killed / (killed + survived + timeout)."""
    counts = {v: verdicts.count(v) for v in ("killed", "survived", "timeout", "not checked")}
    reached = counts["killed"] + counts["survived"] + counts["timeout"]
    return {**counts, "total": len(verdicts), "score": round(counts["killed"] / reached, 3) if reached else None}


def show(name: str) -> None:
    for path in config()["sources"]:
        code = mutants(path).get(name)
        if code is not None:
            sys.stdout.writelines(difflib.unified_diff(Path(path).read_text().splitlines(True),
                                                       code.splitlines(True), path, name))
            return
    sys.exit(f"no mutant {name}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["run"]
    {"run": run, "report": report, "show": show}[command](*rest)
