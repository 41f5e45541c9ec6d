"""The layer map holds: imports point down only, and docs/architecture.md names every module.

Static checks over the source (AST), so they run in milliseconds and fail on the line that
breaks a rule: a module below the engine that imports the engine or the server, a cache module
that imports the engine, a kernel that imports tierkv, or a module the architecture doc forgot.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _imports(path: Path) -> list[str]:
    """Absolute module names `path` imports (relative imports resolved against its package)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    if package and package[0] == "kernels":
        package = ("tierkv", *package)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                out.append(f"{base}.{node.module}" if node.module else base)
                out += [f"{base}.{a.name}" for a in node.names]  # `from . import engine`
            else:
                out.append(node.module or "")
    return out


def _layer(module: str) -> int | None:
    """Height of a tierkv module in the layer map: server 3, engine 2, integrations 2, the rest 1."""
    if not module.startswith("tierkv"):
        return None
    if module.startswith("tierkv.server"):
        return 3
    if module.startswith(("tierkv.engine", "tierkv.integrations")):
        return 2
    return 1


SOURCES = sorted([*ROOT.glob("tierkv/**/*.py"), *ROOT.glob("integrations/**/*.py")])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    here = ".".join(("tierkv", *parts) if parts[0] == "integrations" else parts)
    if here in ("tierkv.__init__", "tierkv"):
        return  # the package's lazy top level names public classes of every layer on purpose
    mine = _layer(here)
    for imported in _imports(path):
        theirs = _layer(imported)
        assert theirs is None or theirs <= mine, f"{here} imports {imported}, a layer above it"


def test_kernels_import_nothing_from_tierkv():
    for path in (ROOT / "kernels").glob("*.py"):
        assert not [m for m in _imports(path) if m == "tierkv" or m.startswith("tierkv.")
                    and not m.startswith("tierkv.kernels")], path.name


def test_the_architecture_doc_names_every_module():
    layer_map = DOC.split("```")[1]  # the first code block
    words = set(layer_map.replace(",", " ").replace("(", " ").replace(")", " ").split())
    missing = []
    for path in sorted(ROOT.glob("tierkv/**/*.py")):
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py":
            continue
        # named by its path or file name anywhere, or by its bare name in the layer map (the
        # tiers/, engine/ and server/ rows list their files that way)
        if str(rel) not in DOC and path.name not in DOC and path.stem not in words:
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md does not mention {missing}"


def test_the_architecture_doc_names_only_files_that_exist():
    named = {w.strip("`(),.:") for w in DOC.split() if w.strip("`(),.:").endswith(".py") and "/" in w}
    gone = [n for n in named if not any((ROOT / base / n).exists() for base in ("", "tierkv", "tierkv/engine",
                                                                                "tierkv/server", "tierkv/tiers"))]
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


def _module_graph() -> dict[str, set[str]]:
    """tierkv module -> the tierkv modules it imports anywhere in its body (package __init__s left
    out: a package names its submodules on purpose)."""
    modules = {}
    for path in SOURCES:
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] != "__init__":
            modules[".".join(("tierkv", *parts) if parts[0] == "integrations" else parts)] = path
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_module_imports_one_that_imports_it_back():
    # Deferred imports count too: a factory that imports the stores which import its file is a
    # circle even when it works at runtime, and it is how layers start to lean on each other.
    graph = _module_graph()
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            walk(nxt, path + [node])
        done.add(node)

    for name in sorted(graph):
        walk(name, [])
