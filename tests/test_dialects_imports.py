"""The dialect room never imports Ray or the Serve room: walk the imports of every dialects/
module, following the project's own modules (dialects, engine, sampling) transitively."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("dialects", "engine", "sampling", "deployments", "benchmarks")
FORBIDDEN = ("ray", "deployments")


def imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names, at any depth of its body (function-level too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_file(name: str) -> Path | None:
    """The project file of module ``name`` (a package's __init__.py), or None outside the project."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def import_closure(start: Path) -> dict[str, str]:
    """Each module reached from ``start`` through project modules, with the file that imports it."""
    reached: dict[str, str] = {}
    pending, seen = [start], set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_names(path):
            reached.setdefault(name, str(path.relative_to(ROOT)))
            if name.split(".")[0] in PROJECT and (found := module_file(name)) is not None:
                pending.append(found)
    return reached


def test_no_dialect_module_imports_ray_or_deployments():
    modules = sorted((ROOT / "dialects").glob("*.py"))
    assert len(modules) >= 8  # the walk saw the room (mindie, openai_*, errors, ...), not an empty folder
    for module in modules:
        bad = {name: by for name, by in import_closure(module).items() if name.split(".")[0] in FORBIDDEN}
        assert not bad, f"{module.relative_to(ROOT)} reaches {bad} (module: imported by)"


def test_the_walk_sees_an_import_of_ray(tmp_path):
    """The check can fail: a file importing Ray inside a function is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ray import serve\n")
    assert "ray" in {name.split(".")[0] for name in imported_names(probe)}
