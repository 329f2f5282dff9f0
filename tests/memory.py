"""The pytest driver's memory, in the run's summary: its RSS after each module ends (its engines and
models collected, tests/conftest.py) and its peak; with each module's wall time, the figures that
say where a worker's time goes (pytest's slowest steps name steps, not modules). Issue 53 bounds
the RSS (``RSS_BOUND_BYTES`` at every module boundary): a driver that keeps a module's engines
takes the memory the served modules' replicas need. Under pytest-xdist each worker is a driver; its figures come to the controller with
the worker's end (``config.workeroutput``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

import psutil

RSS_BOUND_BYTES = 2 * 1024**3
GB = 1024**3

_module_ends: list[tuple[str, int, float]] = []  # (module, driver RSS after it ended, its seconds), this process's
_workers: dict[str, dict] = {}  # xdist worker id -> its figures, on the controller


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def trim() -> None:
    """Hand the heap's free pages back to the system. glibc keeps freed memory for reuse, and after
    large tensors are freed its mmap threshold has grown (up to 32 MB), so a module's weights and KV
    pools, once collected, still count in the driver's RSS until this."""
    if hasattr(_LIBC, "malloc_trim"):  # glibc; elsewhere the allocator keeps its own policy
        _LIBC.malloc_trim(0)


def module_ended(module: str, seconds: float) -> None:
    _module_ends.append((module, psutil.Process().memory_info().rss, seconds))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB


def _figures() -> dict:
    return {"modules": list(_module_ends), "peak": peak_rss()}


def worker_finished(config) -> None:
    """On an xdist worker: its figures go to the controller with the worker's end."""
    if hasattr(config, "workeroutput"):
        config.workeroutput["driver_memory"] = _figures()


def collect_worker(node) -> None:
    """On the controller: a worker's figures, as it sent them at its end."""
    figures = getattr(node, "workeroutput", {}).get("driver_memory")
    if figures:
        _workers[node.gateway.id] = figures


def summary(terminalreporter, config) -> None:
    """Each driver's peak RSS and its RSS at every module's end; "over" marks a module past the bound."""
    if hasattr(config, "workeroutput"):
        return  # a worker: the controller writes the summary
    drivers = dict(sorted(_workers.items())) or {"driver": _figures()}
    if not any(figures["modules"] for figures in drivers.values()):
        return  # no module ran (--collect-only)
    terminalreporter.section("driver memory and time (RSS after each module in GB, the module's seconds)")
    for name, figures in drivers.items():
        modules = figures["modules"]
        over = [module for module, rss, _ in modules if rss > RSS_BOUND_BYTES]
        terminalreporter.write_line(f"{name}: peak {figures['peak'] / GB:.2f} GB; {len(over)} module ends over "
                                    f"{RSS_BOUND_BYTES / GB:.0f} GB{': ' + ', '.join(over) if over else ''}; "
                                    f"{sum(seconds for *_, seconds in modules):.0f} s in {len(modules)} modules")
        terminalreporter.write_line("  " + ", ".join(f"{module.removeprefix('tests.')} {rss / GB:.2f} {seconds:.0f}s"
                                                     for module, rss, seconds in modules))
