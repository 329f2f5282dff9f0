import os
from pathlib import Path
import sys

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.models import ARCHITECTURES, make_random_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model directory per supported architecture."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_random_model(root / arch, arch) for arch in ARCHITECTURES}
