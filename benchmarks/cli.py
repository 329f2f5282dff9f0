"""The command line every benchmark shares: its module docstring as the help, ``--json PATH``
for its results, written as indented JSON (``write_json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: ``doc`` as its description, and ``--json PATH``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results to this file as JSON")
    return parser


def arguments(args: argparse.Namespace) -> dict[str, str]:
    """The run's arguments as strings, to be written beside its results."""
    return {key: str(value) for key, value in vars(args).items()}


def write_json(path: Path | None, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (nothing without a path); values JSON lacks as strings."""
    if path is not None:
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
