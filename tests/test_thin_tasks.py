"""``tasks/`` holds Prefect tasks only: what they call lives in importable modules outside
Prefect (``titan_core.pipeline``), and they return small typed objects, never ``dict[str, Any]``.

Allowed besides ``@task`` functions: imports (re-exports included), constants, and trivial glue,
i.e. a function of at most three statements handed to a ``@task`` decorator in the same module
(``cache_key_fn``, ``task_run_name``, ``retry_condition_fn``) or the module ``tasks/common.py``'s
retry condition. One module is the exception: ``tasks/runtime.py``, the Prefect runtime glue
tasks and flows share, holds plain functions, every one of which needs Prefect (stage logic
belongs in ``titan_core.pipeline``).

Around it: ``titan_core.pipeline`` never imports Prefect, ``tasks/`` never imports ``flows/``,
and every ``flows/`` module defines a flow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "tasks" / "runtime.py"  # the one Prefect glue module
ALL_TASKS = sorted((ROOT / "tasks").glob("*.py"))
TASKS = [p for p in ALL_TASKS if p != RUNTIME]
GLUE_STATEMENTS = 3
PREFECT = ("prefect", "prefect_dask")


def _is_task(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id == "task"


def _hooks(tree: ast.Module) -> set[str]:
    """Names handed to ``@task(...)`` as keyword arguments in this module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and _is_task(decorator):
                    names |= {
                        k.value.id for k in decorator.keywords if isinstance(k.value, ast.Name)
                    }
    return names


def _statements(fn: ast.FunctionDef) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body)


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
def test_tasks_modules_define_tasks_and_trivial_glue_only(path: Path) -> None:
    tree = ast.parse(path.read_text())
    hooks = _hooks(tree) | ({"retry_transient"} if path.name == "common.py" else set())
    offenders = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            offenders.append(f"class {node.name} (move it to titan_core.pipeline)")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if any(_is_task(d) for d in node.decorator_list):
                continue
            if node.name in hooks and _statements(node) <= GLUE_STATEMENTS:
                continue
            offenders.append(f"def {node.name} (line {node.lineno})")
    assert not offenders, f"{path.name}: not a task nor trivial glue: {', '.join(offenders)}"


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
def test_no_task_returns_an_untyped_dict(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(_is_task(d) for d in node.decorator_list):
            returns = ast.unparse(node.returns) if node.returns else "(none)"
            assert returns != "(none)", f"{path.name}: task {node.name} has no return type"
            untyped = "Any" in returns or returns.split("[")[0] == "dict"
            assert not untyped, (
                f"{path.name}: task {node.name} returns {returns}; return a typed object"
            )


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module an ``import`` anywhere in ``tree`` (function bodies included) names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return found


def _is_prefect(module: str) -> bool:
    return module.split(".")[0] in PREFECT


def test_runtime_is_prefect_glue_only() -> None:
    """Every function of ``tasks/runtime.py`` imports or uses Prefect (itself, or through another
    function there); a class or a function that needs no Prefect is stage logic that crept in."""
    tree = ast.parse(RUNTIME.read_text())
    prefect_names = {
        alias.asname or alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(_is_prefect(m) for m in _imported_modules(node))
        for alias in node.names
    }
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert not classes, f"runtime.py: classes {classes} (move them to titan_core.pipeline)"
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert functions, "runtime.py defines no function"
    uses = {
        name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        for name, fn in functions.items()
    }
    glue = {
        name
        for name, fn in functions.items()
        if any(_is_prefect(m) for m in _imported_modules(fn)) or uses[name] & prefect_names
    }
    while grown := {n for n in functions if n not in glue and uses[n] & glue}:
        glue |= grown  # a function here that calls one that needs Prefect
    offenders = sorted(set(functions) - glue)
    assert not offenders, (
        f"runtime.py: {', '.join(offenders)} use no Prefect: stage logic belongs in "
        "titan_core.pipeline"
    )


@pytest.mark.parametrize("path", ALL_TASKS, ids=lambda p: p.name)
def test_tasks_do_not_import_flows(path: Path) -> None:
    modules = _imported_modules(ast.parse(path.read_text()))
    flows = [m for m in modules if m.split(".")[0] == "flows"]
    assert not flows, f"tasks/{path.name} imports {flows}: flows compose tasks, not the reverse"


def test_pipeline_never_imports_prefect() -> None:
    """``titan_core.pipeline`` is the logic Prefect tasks wrap: what it needs from Prefect (a run
    logger, a secret) is handed in, never imported, not even inside a function."""
    offenders = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((ROOT / "titan_core" / "pipeline").rglob("*.py"))
        for module in _imported_modules(ast.parse(path.read_text()))
        if _is_prefect(module) or module.split(".")[0] in ("flows", "tasks")
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("path", sorted((ROOT / "flows").glob("*.py")), ids=lambda p: p.name)
def test_flows_modules_define_flows(path: Path) -> None:
    if path.name == "__init__.py":
        return
    tree = ast.parse(path.read_text())
    flows = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(
            isinstance(t := (d.func if isinstance(d, ast.Call) else d), ast.Name) and t.id == "flow"
            for d in node.decorator_list
        )
    ]
    assert flows, f"flows/{path.name} defines no @flow: move it out of flows/"
