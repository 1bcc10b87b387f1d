"""Every file titan writes goes through one path: ``titan_core.storage``'s writers.

``open_write``/``write_text``/``write_bytes`` (a file appears whole, or not at all),
``output_path`` (for a library that writes by name), ``LineLog`` (files that grow by lines) and
``folder_lock``. Each knows the failure modes (a full disk, a read-only folder, an interrupt): one
``StorageError`` line naming the file, exit code 2, nothing half-written or left behind. The scan
below reads the source of the engine, the tasks and the flows and fails on any other way of
creating or writing a file, so that a new writer cannot forget them; the drills in
tests/test_full_disk.py run each writer on a nearly full disk.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("titan_core", "tasks", "flows")

# The one path, and the few places that write through another mechanism, each with why.
ALLOWED = {
    "titan_core/storage.py": "the one writer",
    "titan_core/convert/__init__.py": "StagedOutput: an export folder built out of sight and "
    "published whole by one rename (or removed whole)",
    "titan_core/convert/shard_writer.py": "safetensors shards streamed into a StagedOutput's "
    "staging folder (large sequential writes; the folder is published or removed whole)",
    "titan_core/testing/s3.py": "test infrastructure: the S3 test server's own log, handed to "
    "its process",
}

# Calls that create or write a file whatever their arguments.
WRITING_CALLS = {
    "write_text",
    "write_bytes",
    "savefig",
    "export_chrome_trace",
    "save_file",  # safetensors
    "tofile",
    "pipe_file",
    "put_file",
    "get_file",
    "mkstemp",
    "NamedTemporaryFile",
    "copyfile",
    "copy2",
    "touch",
}
QUALIFIED = {("torch", "save"), ("np", "save"), ("numpy", "save"), ("shutil", "copy")}
WRITE_MODES = set("wax+")
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _mode(call: ast.Call, position: int) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "mode":
            return keyword.value
    return call.args[position] if len(call.args) > position else None


def _writes(call: ast.Call) -> str | None:
    """Why ``call`` writes a file, or None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    owner = (
        func.value.id
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        else ""
    )
    if owner == "storage":
        return None  # the one path
    if name in WRITING_CALLS or (owner, name) in QUALIFIED:
        return f"{owner + '.' if owner else ''}{name}()"
    if owner == "os" and name == "open":
        flags = {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)}
        if flags & WRITE_FLAGS:
            return f"os.open with {sorted(flags & WRITE_FLAGS)}"
        return None
    if name in ("open", "fdopen"):
        mode = _mode(call, 1)
        if mode is None:
            return None  # read mode
        if not isinstance(mode, ast.Constant):
            return f"{name}() with a mode that is not a literal"
        if WRITE_MODES & set(str(mode.value)):
            return f"{name}(..., {mode.value!r})"
    if name in ("dump",) and owner in ("json", "pickle"):
        return f"{owner}.dump() to a file"
    return None


def _staged_names(tree: ast.AST) -> set[str]:
    """Names bound by ``with storage.output_path(...) as NAME``: a library writing there writes
    through the one path (the temp file it hands out)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call, target = item.context_expr, item.optional_vars
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "output_path"
                    and isinstance(target, ast.Name)
                ):
                    names.add(target.id)
    return names


def _found() -> list[str]:
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            staged = _staged_names(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not (why := _writes(node)):
                    continue
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Name) and first.id in staged:
                    continue  # a library writing into storage.output_path's temp file
                found.append(f"{rel}:{node.lineno}: {why}")
    return found


def test_every_writer_goes_through_storage() -> None:
    """No file is opened for writing, created or copied outside ``titan_core.storage`` (and the
    few mechanisms in ``ALLOWED``, each with its reason)."""
    found = _found()
    assert found == [], "write through titan_core.storage instead:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_writer(tmp_path: Path) -> None:
    """The scan is not blind: each way of writing a file is found in a sample."""
    sample = """
open(p, "w"); open(p, mode="ab"); open(p, m); os.fdopen(fd, "w"); os.open(p, os.O_WRONLY)
Path(p).write_text(t); Path(p).write_bytes(b); fig.savefig(p); prof.export_chrome_trace(p)
torch.save(x, p); np.save(p, a); shutil.copy(a, b); tempfile.mkstemp(); fs.pipe_file(p, b)
json.dump(x, f); pickle.dump(x, f); arr.tofile(p)
open(p); open(p, "rb"); os.open(p, os.O_RDONLY); json.dumps(x)
"""
    calls = [n for n in ast.walk(ast.parse(sample)) if isinstance(n, ast.Call)]
    found = [why for call in calls if (why := _writes(call))]
    assert len(found) == 17, found
