"""The rooms' arrows point down. The dialect room never imports Ray or the Serve room, and reaches
the engine only through its request data: walk the imports of every dialects/ module, following
the project's own modules transitively. Inside engine/, each module imports only from its own floor
or the floors below it (docs/architecture.md, "Floors")."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("dialects", "engine", "sampling", "deployments", "tools", "benchmarks")
FORBIDDEN = ("ray", "deployments")
# engine/'s floors, bottom first; a module is on the floor of its longest listed prefix. An engine
# module listed nowhere is on the step loop's floor (where a new part of the engine lands).
ENGINE_FLOORS = (
    ("data", ("engine.config", "engine.kv_transfer", "engine.outputs", "engine.model_info", "engine.lora_adapter")),
    ("execution", ("engine.execution", "engine.kv_tier")),  # the tier: storage the runner copies into
    ("request", ("engine.request", "engine.detokenizer")),
    ("blocks", ("engine.block_manager", "engine.prefix_holds", "engine.prefix_store")),
    ("scheduler", ("engine.scheduler",)),
    ("step loop", ("engine.llm_engine", "engine.decoding", "engine.validation", "engine.output_processor",
                   "engine.offline")),
    ("front", ("engine.async_engine", "engine.cli")),
)
STEP_LOOP = 5
ENGINE_DATA = ENGINE_FLOORS[0][1] + ("engine.request",)  # what a dialect may reach of the engine


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


def test_dialects_reach_the_engine_only_through_its_request_data():
    for module in sorted((ROOT / "dialects").glob("*.py")):
        bad = {name: by for name, by in import_closure(module).items()
               if name.split(".")[0] == "engine" and not name.startswith(tuple(f"{d}." for d in ENGINE_DATA))
               and name not in ENGINE_DATA}
        assert not bad, f"{module.relative_to(ROOT)} reaches {bad} (module: imported by)"


def floor(module: str) -> int:
    """The index in ENGINE_FLOORS of engine module ``module`` (or of an attribute's module)."""
    best, where = -1, STEP_LOOP
    for index, (_, prefixes) in enumerate(ENGINE_FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    return where


def upward_imports(path: Path, module: str) -> dict[str, str]:
    """The engine modules ``path`` (module ``module``) imports from a floor above its own: name -> floor."""
    own = floor(module)
    return {name: ENGINE_FLOORS[floor(name)][0] for name in imported_names(path)
            if name.split(".")[0] == "engine" and floor(name) > own}


def test_engine_imports_point_only_downward():
    files = sorted((ROOT / "engine").rglob("*.py"))
    assert any(f.parent.name == "execution" for f in files) and len(files) >= 20
    for path in files:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        bad = upward_imports(path, module)
        assert not bad, f"{module} (floor {ENGINE_FLOORS[floor(module)][0]!r}) imports from above: {bad}"


def test_the_floor_check_sees_an_upward_import(tmp_path):
    """The check can fail: model execution importing the scheduler, even for a type only, is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.scheduler import X\n")
    assert upward_imports(probe, "engine.execution.model_runner") == {"engine.scheduler": "scheduler",
                                                                      "engine.scheduler.X": "scheduler"}
    assert upward_imports(probe, "engine.llm_engine") == {}


# The modules of deployments/ that may import dialects/ (docs/architecture.md, "The rooms"): the
# binding of routes to dialects, the engine client (the dialects' seam implemented, and the one
# mapping of the serving system's failures to what a client is told), and the Batch API's runner
# (its line format; to go when the runner receives it from the binding).
MAX_DEPLOYMENTS_TO_DIALECTS = 3


def modules_importing(folder: Path, target: str) -> list[str]:
    """The modules under ``folder`` (paths relative to it) whose own imports, at any depth of their
    body, name the package ``target``."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*.py")
                  if any(name.split(".")[0] == target for name in imported_names(path)))


def test_deployments_reach_dialects_through_at_most_three_modules():
    reaching = modules_importing(ROOT / "deployments", "dialects")
    assert reaching, "the walk saw no import of dialects/: the ingress binds its routes there"
    assert len(reaching) <= MAX_DEPLOYMENTS_TO_DIALECTS, \
        f"{len(reaching)} modules of deployments/ import dialects/: {reaching}"


def test_no_dialect_module_imports_ray_directly():
    assert modules_importing(ROOT / "dialects", "ray") == []


def test_the_count_sees_every_module_that_imports_a_room(tmp_path):
    """The count can fail: a module importing a dialect inside a function counts."""
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "a.py").write_text("def f():\n    from dialects.errors import APIError\n")
    (tmp_path / "b.py").write_text("import json\n")
    assert modules_importing(tmp_path, "dialects") == ["inner/a.py"]
