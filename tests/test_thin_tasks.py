"""``tasks/`` holds Prefect tasks only: what they call lives in importable modules outside
Prefect (``titan_core.pipeline``), and they return small typed objects, never ``dict[str, Any]``.

Allowed besides ``@task`` functions: imports (re-exports included), constants, and trivial glue,
i.e. a function of at most three statements handed to a ``@task`` decorator in the same module
(``cache_key_fn``, ``task_run_name``, ``retry_condition_fn``) or the module ``tasks/common.py``'s
retry condition.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TASKS = sorted((Path(__file__).resolve().parents[1] / "tasks").glob("*.py"))
GLUE_STATEMENTS = 3


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
