"""What the Prefect UI shows of a flow's parameter schema (its run form), as the tests check it.

The UI (3.8) shows a ``{"type": "null"}`` schema as 'Property is type "None"', a choice
(``anyOf``) as tabs titled by each choice's title, else by its type ("dict", "None"), a
``$ref`` by the definition's title (a model's class name unless it is given one), and it fills
a field's ``default`` into the value it submits.
"""

from __future__ import annotations

from typing import Any


def form_problems(schema: dict[str, Any], where: str = "") -> list[str]:
    """Where the run form of parameter ``schema`` would show a type or a class name, or submit a
    null: null types, untitled choices, definitions titled by their class name, null defaults."""
    defs = schema.get("definitions") or schema.get("$defs") or {}
    problems = [
        f"{where}definitions.{name}: titled {d.get('title')!r}"
        for name, d in defs.items()
        if d.get("title", name) == name
    ]

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
            return
        if not isinstance(node, dict):
            return
        kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "null" in kinds:
            problems.append(f"{where}{path}: a null type")
        if "default" in node and node["default"] is None:
            problems.append(f"{where}{path}: a null default")
        for choice in node.get("anyOf", []) + node.get("oneOf", []):
            if "title" not in choice:
                problems.append(f"{where}{path}: a choice titled by its type: {choice}")
        for key, value in node.items():
            walk(value, f"{path}.{key}" if path else key)

    walk(schema.get("properties", {}), "")
    walk(defs, "definitions")
    return problems
