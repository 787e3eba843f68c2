"""The package's architecture, read from its source (DESIGN.md, "Rooms" and "Rules the code keeps").

The import graph is built with `ast`, without importing anything: an edge a -> b for every `import b` /
`from b import x` in a's module-level code (`from pkg import mod` names the submodule; relative imports
resolved), `if TYPE_CHECKING:` blocks included (a type-only import is still a dependency a reader follows).
Imports inside functions are left out of the graph: a lazy import is how a module defers a heavier room to
first use. The room rules (train/ and rollout/ apart, no torch.distributed in the model) count them too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybridengine"

MAX_LINES = 600
"""A module longer than this is no longer read in one sitting (STYLE.md habit 14): split it by concept."""

TP_MODULE = "hybridengine.model.tensor_parallel"
"""TP applied from outside: the one module of model/ that holds collectives (model/__init__.py)."""


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name: its .py files and compiled extensions (`_C.*.so`)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    for ext in [*package.rglob("*.so"), *package.rglob("*.pyd")]:
        modules.setdefault(module_name(ext.with_name(ext.name.split(".")[0] + ".py"), package), ext)
    return modules


class _Imports(ast.NodeVisitor):
    """The absolute dotted names a module imports, with line numbers (`from a import b` gives `a.b`)."""

    def __init__(self, package: str, in_functions: bool):
        self.package, self.in_functions = package, in_functions
        self.names: list[tuple[str, int]] = []

    def visit_FunctionDef(self, node):
        if self.in_functions:
            self.generic_visit(node)

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_Import(self, node):
        self.names += [(a.name, node.lineno) for a in node.names]

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        self.names += [(f"{base}.{a.name}", node.lineno) for a in node.names]


def imported_names(path: Path, name: str, *, in_functions: bool) -> list[tuple[str, int]]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    visitor = _Imports(package, in_functions)
    visitor.visit(ast.parse(path.read_text(), filename=str(path)))
    return visitor.names


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module an imported name lives in (its longest dotted prefix that is one), else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path, *, in_functions: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (module level, or everywhere with `in_functions`)."""
    modules = package_modules(package)
    graph = {}
    for name, path in modules.items():
        if path.suffix != ".py":
            graph[name] = set()
            continue
        targets = {resolve(n, modules) for n, _ in imported_names(path, name, in_functions=in_functions)}
        graph[name] = targets - {None, name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search; a grey node met again closes one)."""
    colour = dict.fromkeys(graph, "white")
    path: list[str] = []

    def visit(node):
        colour[node] = "grey"
        path.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == "grey":
                return path[path.index(nxt):] + [nxt]
            if colour[nxt] == "white" and (cycle := visit(nxt)):
                return cycle
        path.pop()
        colour[node] = "black"
        return None

    for node in sorted(graph):
        if colour[node] == "white" and (cycle := visit(node)):
            return cycle
    return None


def in_room(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


# -- the checker itself, on a package written here ---------------------------------------------------------


def test_graph_reads_module_level_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nfrom pkg.sub import b\nif TYPE_CHECKING:\n"
                              "    from pkg.sub.c import C\n")
    (pkg / "sub" / "b.py").write_text("from . import c\nfrom ..a import f\n")
    (pkg / "sub" / "c.py").write_text("import torch.distributed as dist\n\ndef lazy():\n    from pkg import a\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.sub": set(), "pkg.a": {"pkg.sub.b", "pkg.sub.c"},
                     "pkg.sub.b": {"pkg.sub.c", "pkg.a"}, "pkg.sub.c": set()}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    assert import_graph(pkg, in_functions=True)["pkg.sub.c"] == {"pkg.a"}
    assert ("torch.distributed", 1) in imported_names(pkg / "sub" / "c.py", "pkg.sub.c", in_functions=False)
    assert find_cycle({"x": {"y"}, "y": set()}) is None


# -- the package ---------------------------------------------------------------------------------------------


def test_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert {"hybridengine.config", "hybridengine.engine", "hybridengine._C"} <= graph.keys()
    assert "hybridengine.config" in graph["hybridengine.engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_config_imports_no_implementation_module():
    # EngineConfig's option values live in hybridengine.options, which imports nothing of the package, so the
    # config can be imported without the rooms that implement the options.
    graph = import_graph(PACKAGE, in_functions=True)
    for dep in graph["hybridengine.config"]:
        assert not graph[dep], f"hybridengine.config imports {dep}, which imports {sorted(graph[dep])}"


def test_train_and_rollout_do_not_import_each_other():
    # engine.py is the one room that knows both halves; what both need lives outside either.
    graph = import_graph(PACKAGE, in_functions=True)
    for room, other in [("hybridengine.train", "hybridengine.rollout"), ("hybridengine.rollout", "hybridengine.train")]:
        for module in sorted(m for m in graph if in_room(m, room)):
            bad = sorted(d for d in graph[module] if in_room(d, other))
            assert not bad, f"{module} imports {bad}: {room} and {other} must not import each other"


def test_model_never_imports_torch_distributed():
    # The model is single-device; sharding and TP are applied from outside (TP_MODULE). Nor does anything the
    # model imports reach torch.distributed.
    modules = package_modules(PACKAGE)
    graph = import_graph(PACKAGE, in_functions=True)
    model = {m for m in modules if in_room(m, "hybridengine.model")} - {TP_MODULE}
    assert "hybridengine.model.decoder" in model
    reached, todo = set(), list(model)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert TP_MODULE not in reached, "the model imports its TP application"
    for module in sorted(m for m in reached if modules[m].suffix == ".py"):
        path = modules[module]
        for name, line in imported_names(path, module, in_functions=True):
            assert not in_room(name, "torch.distributed"), f"{module} ({path.name}:{line}) imports {name}"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                pytest.fail(f"{module} ({path.name}:{node.lineno}) uses torch.distributed")


def test_no_module_over_max_lines():
    long = {p.relative_to(PACKAGE.parent).as_posix(): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
