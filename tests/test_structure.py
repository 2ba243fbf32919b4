"""The code's shape: no import cycles in jaxmtp/, no file over 400 lines there, and the
host-side modules import no JAX (the scheduler, allocator and prefix cache are plain
Python, so their unit tests need no model and no device)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "jaxmtp"
HOST_ONLY = (
    "scheduler", "allocator", "prefix_cache", "sequence", "sampling_params", "engine_config", "outputs", "intake",
    "structured_outputs", "quantization",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Modules of jaxmtp a file imports at module level or inside functions (both can
    cycle at run time), TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text())
    found = set()

    def visit(node, type_checking=False):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("jaxmtp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxmtp"):
            # `from jaxmtp import model` imports the submodule; the package's __init__ has
            # started importing already, so it is no edge of its own
            if node.module != "jaxmtp":
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in files and m != name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph as a path that ends where it starts, or []."""
    done: set[str] = set()

    def walk(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = walk(nxt, path + [nxt])
                if found:
                    return found
        done.add(node)
        return []

    for node in sorted(graph):
        if node not in done:
            found = walk(node, [node])
            if found:
                return found
    return []


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_sees_a_planted_cycle(tmp_path):
    """Imports inside functions count, and the walker finds a cycle through them."""
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from jaxmtp.b import x\n")
    b.write_text("def f():\n    import jaxmtp.c\n")
    c.write_text("import jaxmtp.a\n")
    graph = {f"jaxmtp.{p.stem}": {m for m in imports_of(p) if m.count(".") == 1} for p in (a, b, c)}
    assert find_cycle(graph) == ["jaxmtp.a", "jaxmtp.b", "jaxmtp.c", "jaxmtp.a"]
    assert find_cycle({"jaxmtp.a": {"jaxmtp.b"}, "jaxmtp.b": set()}) == []


def test_no_file_in_the_package_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_host_side_modules_import_no_jax():
    for name in HOST_ONLY:
        source = (PACKAGE / f"{name}.py").read_text()
        tree = ast.parse(source)
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        jaxmtp_deps = {m for m in modules if m.startswith("jaxmtp.")}
        assert not any(m.split(".")[0] == "jax" for m in modules), name
        assert all(m.split(".")[1] in HOST_ONLY for m in jaxmtp_deps), (name, jaxmtp_deps)
