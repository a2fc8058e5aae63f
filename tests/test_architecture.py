"""The package layers of docs/architecture.md hold: imports only go down the layers (never up,
never sideways between the worker roles and the router), and no modules import each other in a
circle. Every import counts, also one inside a function: deferring it hides a circle from Python,
not from a reader."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `pdspec bench` and `pdspec train-eagle3` run tooling; nothing else in the layers may import it.
_CLI_RUNS_TOOLING = {("deploy.cli", "tools")}


def _layers() -> list[set[str]]:
    """'proto -> engine -> ... -> deploy' from docs/architecture.md, lowest first; peers joined by '|'."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    line = re.search(r"^Layers, lowest first: (.+)$", text, re.M).group(1)
    return [{name.strip(" `") for name in layer.split("|")} for layer in line.split("→")]


def _tooling() -> set[str]:
    """'tools, bench' from docs/architecture.md: packages outside the layers."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    return {name.strip(" `") for name in re.search(r"^Tooling, outside the layers: (.+)$", text, re.M).group(1).split(",")}


def _modules(packages: set[str]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue  # generated stubs import only each other and protobuf
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours `path` imports (a package's own __init__ when a name is a package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph() -> tuple[dict[str, set[str]], list[set[str]]]:
    """Imports between the layers' modules (and of tooling modules, which no layer may import but
    the CLI's tooling commands)."""
    layers = _layers()
    modules = _modules(set().union(*layers) | _tooling())
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}, layers


def test_the_layer_line_names_every_serving_package():
    layers = _layers()
    assert _tooling() == {"tools", "bench"} and not _tooling() & set().union(*layers)
    assert [layer for layer in layers if "proto" in layer] == [layers[0]]
    assert "deploy" in layers[-1]
    for package in set().union(*layers):
        assert (ROOT / package / "__init__.py").is_file(), package


def test_imports_only_go_down_the_layers():
    graph, layers = _graph()
    rank = {package: i for i, layer in enumerate(layers) for package in layer}
    wrong = [f"{m} imports {d}" for m, deps in graph.items() if m.split(".")[0] in rank for d in deps
             if m.split(".")[0] != d.split(".")[0] and rank.get(d.split(".")[0], len(layers)) >= rank[m.split(".")[0]]
             and (m, d.split(".")[0]) not in _CLI_RUNS_TOOLING]
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    graph, _ = _graph()
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)
