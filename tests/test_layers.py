"""The house's layering, read from the import graph of ``titan_core``, ``tasks`` and ``flows``.

Every import counts, the ones inside functions (deferred, lazy) included: a lazy import is still
a dependency. From the bottom up (docs/architecture.md):

    errors, logging, storage < config < models, distributed, data
      < checkpoint, components, stop_request < build, trainer, resolve
      < train, comm_mode, evaluate, convert, estimate, launch < pipeline < tasks < flows < cli

A module imports only its own layer or lower ones, never another module's ``_private`` name,
and no two modules import each other through any chain. ``flows/`` modules each define a flow.
The ``if __name__ == "__main__":`` block of a module is an entry point, not part of the module:
``python -m titan_core.config.manager`` (torchtitan's door) may start the CLI from there.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("titan_core", "tasks", "flows")

# Module-name prefixes by layer, bottom first; the longest matching prefix decides.
LAYERS: list[tuple[str, ...]] = [
    (
        "titan_core",
        "titan_core.errors",
        "titan_core.logging",
        "titan_core.storage",
        "titan_core.testing",  # servers that tests and bench/ share; the engine never imports it
    ),
    ("titan_core.config",),
    ("titan_core.models", "titan_core.distributed", "titan_core.data"),
    ("titan_core.checkpoint", "titan_core.components", "titan_core.stop_request"),
    ("titan_core.build", "titan_core.trainer", "titan_core.resolve"),
    (
        "titan_core.train",  # the torchrun entry point: a real run, or a COMM_MODE simulation
        "titan_core.evaluate",
        "titan_core.convert",
        "titan_core.estimate",
        "titan_core.launch",
        "titan_core.comm_mode",
    ),
    ("titan_core.pipeline",),
    ("tasks",),
    ("flows",),
    ("titan_core.cli",),
]
_PIPELINE_STRINGS = re.compile(r"^(flows|tasks)(\.[\w.]+)?(:\w+)?$")


@dataclass
class Module:
    """What one source file imports: module names (at import time or deferred), the
    ``_private`` names it takes from other modules, and pipeline-layer module paths named in
    strings (``importlib`` targets)."""

    name: str
    path: Path
    at_import: set[str] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)
    private: set[str] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)

    @property
    def imports(self) -> set[str]:
        return self.at_import | self.deferred


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"


def _read(path: Path) -> Module:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    module = Module(name, path)
    aliases: dict[str, str] = {}  # local name -> module it is bound to (``import a.b as m``)

    def absolute(node: ast.ImportFrom) -> str:
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        return base

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_main_block(child):
                continue
            later = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                later = True
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
                aliases.update({a.asname or a.name: a.name for a in child.names})
            elif isinstance(child, ast.ImportFrom):
                base = absolute(child)
                targets = [base] + [f"{base}.{a.name}" for a in child.names]
                for a in child.names:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        module.private.add(f"{base}.{a.name}")
            elif isinstance(child, ast.Constant) and _PIPELINE_STRINGS.match(str(child.value)):
                module.strings.add(str(child.value))
            elif (
                isinstance(child, ast.Attribute)
                and isinstance(child.value, ast.Name)
                and child.attr.startswith("_")
                and not child.attr.startswith("__")
                and child.value.id in aliases
            ):
                module.private.add(f"{aliases[child.value.id]}.{child.attr}")
            (module.deferred if later else module.at_import).update(targets)
            visit(child, later)

    visit(ast.parse(path.read_text(), str(path)), False)
    return module


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    """Every module of the three packages, its imports narrowed to modules of the three."""
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {_module_name(p): _read(p) for p in paths}
    for m in modules.values():
        # ``from pkg import name`` imports pkg, and pkg.name only when that is a module
        m.at_import = {t for t in m.at_import if t in modules and t != m.name}
        m.deferred = {t for t in m.deferred if t in modules and t != m.name} - m.at_import
    assert len(modules) > 100, "the graph should cover the three packages"
    return modules


def layer(name: str) -> int:
    """The layer of module ``name`` (the longest matching prefix of ``LAYERS``)."""
    best, level = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level >= 0, f"{name}: in no layer; add it to LAYERS and docs/architecture.md"
    return level


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle in ``edges`` (empty when there is none)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state and (found := walk(node)):
            return found
    return []


def _package_of(name: str, modules: dict[str, Module]) -> bool:
    """Whether ``name`` is a package (``__init__``): its submodules import it implicitly."""
    return modules[name].path.name == "__init__.py"


def test_no_import_cycle_deferred_imports_included(graph: dict[str, Module]) -> None:
    # A package's __init__ re-exporting its submodules is no cycle with them: importing the
    # submodule runs the __init__ first either way. Every other edge counts.
    edges = {
        name: {t for t in m.imports if not (_package_of(t, graph) and name.startswith(t + "."))}
        for name, m in graph.items()
    }
    cycle = _cycle(edges)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_from_a_higher_layer(graph: dict[str, Module]) -> None:
    upward = sorted(
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
        for name, m in graph.items()
        for target in m.imports
        if layer(target) > layer(name)
    )
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_module_takes_another_modules_private_names(graph: dict[str, Module]) -> None:
    taken = sorted(
        f"{name} takes {target}"
        for name, m in graph.items()
        for target in m.private
        if target.rpartition(".")[0] != name and target.split(".")[0] in PACKAGES
    )
    assert not taken, "private names used outside their module:\n" + "\n".join(taken)


def test_engine_never_names_the_pipeline_layers(graph: dict[str, Module]) -> None:
    """Not even through ``importlib`` strings: titan_core below the CLI knows no flow or task."""
    naming = {
        name: sorted(m.strings)
        for name, m in graph.items()
        if m.strings and name.startswith("titan_core") and layer(name) < layer("titan_core.cli")
    }
    assert not naming, f"titan_core modules naming flows/tasks: {naming}"


def test_the_engine_never_imports_the_testing_servers(graph: dict[str, Module]) -> None:
    """``titan_core.testing`` serves tests and benchmarks; a run never starts a test server."""
    importers = sorted(
        name
        for name, m in graph.items()
        if not name.startswith("titan_core.testing")
        and any(i == "titan_core.testing" or i.startswith("titan_core.testing.") for i in m.imports)
    )
    assert not importers, f"modules importing titan_core.testing: {importers}"


def test_a_family_is_imported_only_by_itself(graph: dict[str, Module]) -> None:
    """The registry names the built-in families as strings; nothing else imports one."""
    families = {p.parent.name for p in (ROOT / "titan_core/models").glob("*/__init__.py")}
    families -= {"common"}
    assert {"llama3", "qwen3", "qwen3_moe"} <= families
    for name, m in graph.items():
        for target in m.imports:
            parts = target.split(".")
            if parts[:2] == ["titan_core", "models"] and len(parts) > 2 and parts[2] in families:
                assert name.startswith(".".join(parts[:3])), f"{name} imports {target}"


def test_distributed_knows_no_model(graph: dict[str, Module]) -> None:
    """``distributed/`` holds model-agnostic helpers: a model's parallelize passes in what they
    need (its MoE layers, its expert modules), so no ``distributed`` module imports a model."""
    naming = sorted(
        f"{name} imports {target}"
        for name, m in graph.items()
        if f"{name}.".startswith("titan_core.distributed.")  # the package and its modules
        for target in m.imports
        if f"{target}.".startswith("titan_core.models.")
    )
    assert not naming, "distributed/ importing models/:\n" + "\n".join(naming)


@pytest.mark.parametrize("path", sorted((ROOT / "flows").glob("*.py")), ids=lambda p: p.name)
def test_every_flows_module_defines_a_flow(path: Path) -> None:
    if path.name == "__init__.py":
        assert not path.read_text().strip() or ast.get_docstring(ast.parse(path.read_text()))
        return
    tree = ast.parse(path.read_text())
    flows = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(ast.unparse(d).startswith(("flow", "prefect.flow")) for d in node.decorator_list)
    ]
    assert flows, f"flows/{path.name} defines no @flow: move it to where it belongs"


def test_engine_commands_import_neither_prefect_nor_mlflow() -> None:
    """``titan train``/``config``/``convert``/``eval``/``estimate``/``launch``/``data`` load
    fast on a GPU box with a handful of wheels: their import path has no Prefect or MLflow."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import titan_core.cli, titan_core.cli.train, titan_core.cli.config, "
        "titan_core.cli.convert, titan_core.cli.evaluate, titan_core.cli.estimate, "
        "titan_core.cli.launch, titan_core.cli.data, titan_core.train\n"
        "print(sorted(m for m in ('prefect', 'mlflow') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_architecture_doc_examples_run() -> None:
    """docs/architecture.md's Python examples run as shown, and every layer it lists is one of
    ``LAYERS`` (the doc and this test describe the same house)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/architecture.md", "exec"), {})
    rows = re.findall(r"^\| (\d) \| (.+?) \|", doc, flags=re.M)
    assert [int(n) for n, _ in rows] == list(range(len(LAYERS)))
    for n, names in rows:
        for name in re.findall(r"`([\w.]+)`", names):
            full = (
                name if name.startswith(("titan_core", "tasks", "flows")) else f"titan_core.{name}"
            )
            assert layer(full) == int(n), f"docs/architecture.md puts {name} in layer {n}"
