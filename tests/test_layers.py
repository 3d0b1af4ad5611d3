"""Imports run downward only: every folder of `elastic/` (and `actors/`) sits on a layer, a module
imports its own folder and the layers below, and there is no circle between folders or between
modules. The modules are read with `ast`, not imported; an import inside a function, or under
`TYPE_CHECKING`, counts like any other. docs/architecture.md draws the same layers.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom first. A unit is a folder of elastic/, a module at its top (elastic/__init__.py is
# "__init__"), or actors/. A module may import its own unit and the units of lower layers,
# never a sibling on its own layer.
LAYERS = [
    ["errors"],
    ["config", "faults"],  # with errors, the vocabulary every layer speaks
    ["controller", "data", "comm"],
    ["checkpoint"],
    ["journal", "techniques", "parallel"],
    ["worker"],
    ["actors"],
    ["trainer", "testing", "s3_server"],
    ["__init__"],  # the names users import as elastic.X
    ["demo"],
    ["cli"],
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}
PURE = {"controller"}  # tested with a fake worker group
IMPURE = {"ray", "torch", "actors"}  # what a pure folder never imports
VOCABULARY = {"errors", "config", "faults"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of elastic/ and actors/."""
    found = {}
    for top in ("elastic", "actors"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def unit(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "actors":
        return "actors"
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """The modules of this repository that `module` imports, and the top-level names of all it imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours, tops = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                tops.add(alias.name.split(".")[0])
                name = alias.name
                while name and name not in MODULES:
                    name = name.rpartition(".")[0]
                if name:
                    ours.add(name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            tops.add(base.split(".")[0])
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:  # a submodule: from elastic.data import order
                    ours.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    ours.add(base)
    ours.discard(module)
    return ours, tops


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}
EDGES = {module: ours for module, (ours, _) in IMPORTS.items()}


def _find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph`, as the path that closes it, or None."""
    state: dict[str, str] = {}  # "open" while on the path being walked, then "done"
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for following in sorted(graph.get(node, ())):
            if state.get(following) == "open":
                return path[path.index(following):] + [following]
            if following not in state and (circle := walk(following)):
                return circle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (circle := walk(node)):
            return circle
    return None


def test_every_folder_has_a_layer():
    units = {unit(module) for module in MODULES}
    assert units == set(LAYER_OF), (f"units without a layer: {sorted(units - set(LAYER_OF))}; "
                                    f"layers naming no unit: {sorted(set(LAYER_OF) - units)}")
    assert sum(len(units) for units in LAYERS) == len(LAYER_OF), "a unit is on two layers"


def test_imports_run_downward_to_lower_layers_or_inside_a_folder():
    upward = [f"{module} ({unit(module)}, layer {LAYER_OF[unit(module)]}) imports {target} "
              f"({unit(target)}, layer {LAYER_OF[unit(target)]})"
              for module, targets in sorted(EDGES.items()) for target in sorted(targets)
              if unit(target) != unit(module) and LAYER_OF[unit(target)] >= LAYER_OF[unit(module)]]
    assert not upward, "\n".join(upward)


def test_the_controller_and_data_import_only_themselves_and_the_vocabulary():
    for folder in ("controller", "data"):
        reached = {unit(target) for module, targets in EDGES.items() if unit(module) == folder for target in targets}
        assert reached <= {folder} | VOCABULARY, f"elastic/{folder}/ imports {sorted(reached - {folder} - VOCABULARY)}"


def test_the_controller_imports_neither_ray_nor_torch():
    for module, (_, tops) in sorted(IMPORTS.items()):
        if unit(module) in PURE:
            assert not tops & IMPURE, f"{module} imports {sorted(tops & IMPURE)}"


def test_no_circle_between_folders():
    graph: dict[str, set[str]] = {}
    for module, targets in EDGES.items():
        graph.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    assert _find_circle(graph) is None, " -> ".join(_find_circle(graph))


def test_no_circle_between_modules():
    assert _find_circle(EDGES) is None, " -> ".join(_find_circle(EDGES))


def test_the_reader_sees_the_imports_it_must_judge():
    # A reader that missed imports would pass every test above.
    assert "elastic.worker.step" in EDGES["elastic.worker.context"]  # from elastic.worker.step import ...
    assert "elastic.data.order" in EDGES["elastic.worker.step"]  # from elastic.data import order as data_math
    assert "elastic.trainer" in EDGES["elastic"]  # inside __getattr__
    assert "elastic.parallel.prepared" in EDGES["elastic.worker.probe"]  # under TYPE_CHECKING
    assert "elastic.parallel.pipelined_replica" in EDGES["elastic.worker.model_kinds"]  # inside a function
    assert "elastic" in EDGES["elastic.demo.train"]  # import elastic
