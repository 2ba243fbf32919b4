"""The code's shape, as the folders draw it (docs/architecture.md):

- engine/ (the host side) imports no JAX, and from worker/ and models/ only the named
  contracts below; every engine module but the loop's (llm_engine) loads no JAX at all,
  so the scheduler, allocator and prefix cache are tested with no model and no device;
- models/ imports nothing from engine/, server/ or loading/;
- loading/ imports nothing from worker/, engine/ or server/ (placement is handed in);
- kernels/ imports nothing from jaxmtp outside jaxmtp.kernels;
- no import cycles, and no file of jaxmtp/ or kernels/ over 400 lines.

Each rule is a function over {module name: file}, so each is also run on a planted
violation and must report it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "jaxmtp"
KERNELS = ROOT / "kernels"
MAX_LINES = 400
JAX_MODULES = ("jax", "jaxlib", "flax", "optax", "orbax")
# what the host side may take from the layers below it: type-only imports (under
# TYPE_CHECKING) are free, and these names are the rest
ENGINE_CONTRACTS = {
    "jaxmtp.worker.distributed": {"start_runner"},  # the engine's one way to a runner
    "jaxmtp.models.config": {"ATTENTION_BACKENDS", "MODEL_DTYPES", "ModelConfig"},
    "jaxmtp.models.registry": {"load_config", "generation_defaults"},
}
ENGINE_LOOP = "jaxmtp.engine.llm_engine"  # builds the runner, so JAX loads beneath it


def module_files() -> dict[str, Path]:
    """jaxmtp's modules by name; kernels/ under the name it installs as (jaxmtp.kernels)."""
    files = {}
    for root, prefix in ((PACKAGE, ("jaxmtp",)), (KERNELS, ("jaxmtp", "kernels"))):
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(path: Path, module_level_only: bool = False) -> dict[str, set[str]]:
    """Every module a file imports, with the names it takes from each (empty for a plain
    `import m`): at module level and inside functions (both can cycle at run time), or
    module level only (what importing the file loads); TYPE_CHECKING blocks left out.
    `from jaxmtp import model` is recorded as an import of jaxmtp.model."""
    found: dict[str, set[str]] = {}

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and module_level_only:
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set())
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = {alias.name for alias in node.names}
            if node.module in ("jaxmtp", "jaxmtp.engine", "jaxmtp.worker", "jaxmtp.models", "jaxmtp.loading"):
                # the package's __init__ has started importing already: the submodules are the edges
                for name in names:
                    found.setdefault(f"{node.module}.{name}", set())
            else:
                found.setdefault(node.module, set()).update(names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph(files: dict[str, Path], module_level_only: bool = False) -> dict[str, set[str]]:
    return {name: {m for m in imports_of(path, module_level_only) if m in files and m != name}
            for name, path in files.items()}


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


def in_folder(module: str, folder: str) -> bool:
    return module == f"jaxmtp.{folder}" or module.startswith(f"jaxmtp.{folder}.")


def imports_jax(imports: dict[str, set[str]]) -> bool:
    return any(m.split(".")[0] in JAX_MODULES for m in imports)


# ----- the rules: each returns its violations as lines ------------------------------------


def engine_violations(files: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in files.items():
        if not in_folder(name, "engine"):
            continue
        imports = imports_of(path)
        if imports_jax(imports):
            bad.append(f"{name} imports JAX")
        for module, names in imports.items():
            if not module.startswith("jaxmtp.") or in_folder(module, "engine") or in_folder(module, "loading"):
                continue
            extra = names - ENGINE_CONTRACTS.get(module, set()) if names else {module}
            if extra:
                bad.append(f"{name} takes {sorted(extra)} from {module}, which are no named contract")
    # what importing each host module loads, JAX nowhere in it (the loop's excepted)
    graph = import_graph(files, module_level_only=True)
    loads_jax = {name for name, path in files.items() if imports_jax(imports_of(path, module_level_only=True))}
    for name in (n for n in files if in_folder(n, "engine") and n != ENGINE_LOOP):
        seen, todo = set(), [name]
        while todo:
            module = todo.pop()
            if module in loads_jax:
                bad.append(f"importing {name} loads JAX (through {module})")
                break
            seen.add(module)
            todo += [m for m in graph[module] if m not in seen]
    return bad


def forbidden_imports(files: dict[str, Path], folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{name} imports {module}" for name, path in files.items() if in_folder(name, folder)
            for module in imports_of(path) if any(in_folder(module, f) for f in forbidden)]


def kernel_violations(files: dict[str, Path]) -> list[str]:
    return [f"{name} imports {module}" for name, path in files.items() if in_folder(name, "kernels")
            for module in imports_of(path) if module.split(".")[0] == "jaxmtp" and not in_folder(module, "kernels")]


def long_files(files: dict[str, Path]) -> list[str]:
    return [f"{path.relative_to(path.parents[1])}: {n} lines" for path in files.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]


RULES = {
    "engine": engine_violations,
    "models": lambda files: forbidden_imports(files, "models", ("engine", "server", "loading")),
    "loading": lambda files: forbidden_imports(files, "loading", ("worker", "engine", "server")),
    "kernels": kernel_violations,
    "cycles": lambda files: [" -> ".join(cycle)] if (cycle := find_cycle(import_graph(files))) else [],
    "length": long_files,
}


def test_the_package_keeps_every_rule():
    files = module_files()
    assert {"jaxmtp.engine.scheduler", "jaxmtp.worker.runner", "jaxmtp.models.model", "jaxmtp.loading.loader",
            "jaxmtp.kernels.reference"} <= set(files)
    broken = {rule: found for rule, check in RULES.items() if (found := check(files))}
    assert not broken, broken


# ----- planted violations: each rule sees its own ------------------------------------------

PLANTED = {
    "engine": {"engine/scheduler.py": "import jax.numpy as jnp\n"},
    "engine_contract": {"engine/scheduler.py": "from jaxmtp.worker.runner import ModelRunner\n"},
    "engine_loads_jax": {"engine/scheduler.py": "from jaxmtp.engine.helper import f\n",
                         "engine/helper.py": "from jaxmtp.worker.cache import KVCache\n",
                         "worker/cache.py": "import jax\n"},
    "models": {"models/model.py": "def f():\n    from jaxmtp.loading.loader import load_params\n"},
    "loading": {"loading/loader.py": "from jaxmtp.worker.sharding import make_mesh\n"},
    "kernels": {"kernels/reference.py": "from jaxmtp.models.config import ModelConfig\n"},
    "cycles": {"worker/a.py": "from jaxmtp.worker.b import x\n", "worker/b.py": "def f():\n    import jaxmtp.worker.c\n",
               "worker/c.py": "from jaxmtp.worker import a\n"},
    "length": {"worker/long.py": "x = 1\n" * (MAX_LINES + 1)},
}


def planted_files(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    files = {}
    for relative, text in sources.items():
        path = tmp_path / "jaxmtp" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        files["jaxmtp." + relative.removesuffix(".py").replace("/", ".")] = path
    return files


def test_each_rule_reports_a_planted_violation(tmp_path):
    for case, sources in PLANTED.items():
        rule = case.split("_")[0]
        found = RULES[rule](planted_files(tmp_path / case, sources))
        assert found, f"{rule} missed {case}"
    cycle = RULES["cycles"](planted_files(tmp_path / "again", PLANTED["cycles"]))
    assert cycle == ["jaxmtp.worker.a -> jaxmtp.worker.b -> jaxmtp.worker.c -> jaxmtp.worker.a"]
    allowed = {"engine/llm_engine.py": "from jaxmtp.worker.distributed import start_runner\n"
                                       "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from jaxmtp.worker.step_records import StepResult\n",
               "worker/distributed.py": "import jax\n"}
    assert RULES["engine"](planted_files(tmp_path / "allowed", allowed)) == []
