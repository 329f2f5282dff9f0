import gc
import os
from pathlib import Path
import shutil
import sys
import tempfile
import time

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.bytecode import keep_compiled_modules  # noqa: E402

keep_compiled_modules()  # before the imports below: each process the suite starts would compile them again
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every engine the suite starts, in this process or in Ray's workers (they inherit it), is
# batch-invariant wherever it can be: the suite's exact comparisons then hold in whatever dtype
# this CPU's "auto" picks (docs/sampling.md). Without it, the default would leave bf16 engines in
# the fastest mode on a CPU with AMX or AVX512-BF16. Tests of the fastest mode pass batch_invariant=False.
os.environ["PDSERVE_BATCH_INVARIANT"] = "1"
# The Batch API's store (deployments/ingress/batch_store.py) of the apps the suite starts: this session's own
# (removed at its end), unless the environment names one.
OWN_BATCH_DIR = "PDSERVE_BATCH_DIR" not in os.environ
os.environ.setdefault("PDSERVE_BATCH_DIR", os.path.join(tempfile.gettempdir(), f"pdserve-test-batches-{os.getpid()}"))
# Without a GPU, Triton's interpreter runs the CUDA backend's kernels on CPU tensors
# (tests/test_triton_attention.py). Triton reads the setting when it is imported, which
# transformers does below; where CUDA is, the kernels compile and run on it instead.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist two workers share two cores with the served apps' replicas: with torch's default of one
# intra-op thread per core, each worker's threads mostly wait on each other (test_attention_backends alone on
# the loaded box: 69-81 s with two threads, 5.6 s with one; issue 53, session 7). One thread per worker; a
# test about thread counts sets both of its counts. Not OMP_NUM_THREADS: Ray's processes, started from this
# one, would inherit it, and the replicas' threads are their apps' setting.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from tests import memory, workers  # noqa: E402
from tests.models import ARCHITECTURES, llama_head_128, make_random_model  # noqa: E402


def pytest_collection_modifyitems(config, items: list) -> None:
    """Modules that start a Ray of their own (marked ``own_ray``) run after every other: each stops
    the suite's shared Ray (tests/serving.py), and a module after it would start that Ray again and
    deploy the kept applications again (~60 s each time on two cores). Otherwise the order stays.
    Tests marked ``cuda`` need a GPU: without one they are left out, and the run's summary says
    how many and why (pytest_terminal_summary)."""
    items.sort(key=lambda item: item.get_closest_marker("own_ray") is not None)
    if not torch.cuda.is_available():
        left_out = [item for item in items if item.get_closest_marker("cuda") is not None]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.get_closest_marker("cuda") is None]
            config.stash[CUDA_LEFT_OUT] = len(left_out)


CUDA_LEFT_OUT = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, config) -> None:
    left_out = config.stash.get(CUDA_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} tests marked cuda left out: this machine has no CUDA device (they "
                                    "run where one is; the kernels' source ran here under Triton's interpreter)")
    memory.summary(terminalreporter, config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist: each module one unit, the served modules one unit together (tests/workers.py)."""
    return workers.make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A pytest-xdist worker's driver memory, sent with its end (``memory.worker_finished``)."""
    memory.collect_worker(node)


def pytest_sessionfinish(session) -> None:
    memory.worker_finished(session.config)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model directory per supported architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_random_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_head128_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with 128-wide heads (tests/models.py llama_head_128)."""
    return make_random_model(tmp_path_factory.mktemp("models") / "llama-head128", "llama", make_config=llama_head_128)


@pytest.fixture(scope="session", autouse=True)
def shared_ray_stops_at_the_end():
    """The suite's shared Ray + Serve (tests/serving.py) is shut down when the session ends."""
    yield
    from tests.serving import stop_shared_session

    stop_shared_session()
    if OWN_BATCH_DIR:
        shutil.rmtree(os.environ["PDSERVE_BATCH_DIR"], ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def module_garbage_collected(request):
    """A module's engines and models are freed when it ends: an engine is part of reference cycles,
    so only the cyclic collector frees its KV pool and weights, and it may not run for many
    modules. The served modules' replicas need that memory (Ray's monitor kills workers past
    95 % of the machine's). The freed memory is handed back to the system (``memory.trim``), and the
    driver's RSS after that is noted for the run's summary, with the module's wall time (its first
    fixture's setup to its last teardown: what the module costs the worker that runs it)."""
    started = time.monotonic()
    yield
    gc.collect()
    memory.trim()
    memory.module_ended(request.module.__name__, time.monotonic() - started)
