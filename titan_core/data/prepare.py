"""Data preparation: raw sources -> token shards + manifest (the format is in ``shards.py``).

Three steps, so that any engine can run the middle one:

- ``plan_prepare`` lists and fingerprints the sources, reads an existing manifest and decides which
  units of work (one per source file or Hugging Face shard) are new. It writes nothing; bad input
  (unknown or empty source, a missing text field, a changed file, another tokenizer) fails here.
- ``tokenize_unit`` turns one unit into its train/validation shards. Units are independent, and
  the function is top-level and picklable: a process pool, Prefect tasks or a Dask cluster run it.
  Its bytes depend only on the unit and the tokenizer, never on the worker or the order.
- ``commit_prepare`` appends the new units to the manifest and writes it, last: until then
  readers see the previous manifest, and a failed unit leaves nothing committed.

``prepare`` is the three, on a local process pool or on the engine its ``map_fn`` hands the units
to (the pipeline's ``prepare_data`` task: Prefect tasks on local processes or a Dask cluster). A
dataset lives at ``<root>/<fingerprint>``, the fingerprint covering the sources as given, the text
field, the tokenizer and the split rule; rerunning it is a cache hit, and files added to a source
become new units appended to the same dataset (old shards are never rewritten).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import multiprocessing
import os
import posixpath
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import fsspec

from titan_core import storage
from titan_core.data.encode import SplitBuilder, cached_tokenizer, encode_documents
from titan_core.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    SHARD_DIR,
    SPLITS,
    Manifest,
    ShardInfo,
    SourceFile,
    check_tokenizer,
    damaged_units,
    manifest_url,
    read_manifest,
    remove_orphan_temps,
    shard_urls,
    staging_folder,
    token_dtype,
    tokenizer_info,
    write_manifest,
)
from titan_core.data.sources import (
    file_identity,
    filesystem,
    list_source,
    new_stats,
    normalize_source,
    read_documents,
    storage_errors,
)
from titan_core.errors import DataError
from titan_core.logging import logger

VALIDATION_RULE = "every_nth_document"


@dataclass(frozen=True, kw_only=True)
class PrepareSpec:
    """Everything that defines a prepared dataset (sources are normalised: local paths absolute)."""

    sources: tuple[str, ...]
    """Files, folders, fsspec URLs or ``hf:`` specs, in stream order."""
    tokenizer_path: str
    """tiktoken ranks file (path or URL)."""
    root: str
    """Data root: the dataset lives at ``<root>/<fingerprint>``."""
    text_field: str = "text"
    """Row field holding the document text (jsonl, json, parquet, Hugging Face rows)."""
    validation_every: int = 100
    """Document i of a unit is held out when ``i % N == N - 1``; 0 holds none out."""

    def __post_init__(self) -> None:
        if isinstance(self.sources, str):
            raise DataError("data.sources: expected a list of sources, got one string")
        if not self.sources:
            raise DataError("data.sources: no sources to prepare")
        if not self.text_field:
            raise DataError("data.text_field: expected a field name, got ''")
        if self.validation_every < 0:
            raise DataError(f"data.validation_every: expected >= 0, got {self.validation_every}")
        if not self.root:
            raise DataError("data.root: expected a folder or URL, got ''")
        if not self.tokenizer_path:
            raise DataError("tokenizer.path: expected a tiktoken ranks file, got ''")
        object.__setattr__(self, "sources", tuple(normalize_source(s) for s in self.sources))
        object.__setattr__(self, "root", _normalize_location(self.root))
        object.__setattr__(self, "tokenizer_path", _normalize_location(self.tokenizer_path))


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One unit of work: one source file or Hugging Face shard -> a train and a validation shard."""

    file: SourceFile
    """Identity of the file (``file.unit`` is the unit id, the stem of its shard names)."""
    source: str
    """The (normalised) source of the spec it came from."""
    index: int
    """Position in ``Plan.todo``."""


@dataclass(kw_only=True)
class Plan:
    """What ``prepare`` will do: the dataset URL, its manifest so far, the units still to do."""

    spec: PrepareSpec
    url: str
    """Dataset URL, ``<root>/<fingerprint>``."""
    manifest: Manifest
    """The manifest on storage, or a new one; not written by the plan."""
    todo: list[Unit]
    """Units not prepared yet, in stream order."""
    cache_key: str
    """Hash of the dataset fingerprint and every unit's identity: equal when nothing changed."""
    exists: bool = False
    """Whether the manifest is already on storage."""
    reused_units: int = 0
    """Units of the sources already prepared (skipped)."""
    gone: list[SourceFile] = field(default_factory=list)
    """Files in the manifest no longer in the sources (their shards are kept)."""
    root_existed: bool = True
    """Whether the (local) data root was there before this prepare (else a failure removes it
    again when it is empty)."""
    staging: str = field(default_factory=staging_folder)
    """This prepare's own folder in the dataset, where its units write their shards until
    ``commit_prepare`` moves them under ``shards/``: what a failed prepare removes."""

    def unit_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``tokenize_unit`` for this plan's units."""
        return {
            "url": self.url,
            "staging": self.staging,
            "tokenizer_path": self.spec.tokenizer_path,
            "text_field": self.spec.text_field,
            "validation_every": self.spec.validation_every,
            "fingerprint": self.manifest.tokenizer["fingerprint"],
        }


@dataclass(kw_only=True)
class PrepareResult:
    """What a ``prepare`` call did."""

    url: str
    """The prepared dataset, ``<root>/<fingerprint>``."""
    manifest: Manifest
    """Its manifest as written (or as found, when cached)."""
    new_shards: int
    """Shards written by this call."""
    reused_units: int
    """Units of the sources prepared before (skipped)."""
    cached: bool
    """Nothing was new: nothing was tokenized or written."""
    tokens: int
    """Tokens tokenized by this call (both splits)."""
    new_units: int = 0
    """Units tokenized by this call."""
    seconds: float = 0.0
    """Wall time of the call, planning included."""


def spec_from_config(cfg: Any, **given: Any) -> PrepareSpec:
    """The PrepareSpec of a JobConfig's ``[data]`` section (root defaults to <job.dump_folder>/data,
    the tokenizer to the bundled one); the PrepareSpec fields ``given`` win."""
    from titan_core.data.assets import default_tokenizer_path

    from_config = {
        "sources": tuple(cfg.data.sources),
        "tokenizer_path": cfg.tokenizer.path or str(default_tokenizer_path()),
        "root": cfg.data.root or f"{cfg.job.dump_folder.rstrip('/')}/data",
        "text_field": cfg.data.text_field,
        "validation_every": cfg.data.validation_every,
    }
    return PrepareSpec(**(from_config | given))


def dataset_fingerprint(spec: PrepareSpec, tokenizer_fingerprint: str) -> str:
    """The dataset id: sources as given, text field, tokenizer and split rule (16 hex digits)."""
    identity = {
        "format": [FORMAT, FORMAT_VERSION],
        "sources": list(spec.sources),
        "text_field": spec.text_field,
        "tokenizer": tokenizer_fingerprint,
        "validation": _validation(spec),
    }
    return _sha256(json.dumps(identity, sort_keys=True))[:16]


def unit_id(fingerprint: str, file: SourceFile) -> str:
    """A unit's id: a changed size or version of the same file is another unit."""
    return _sha256(json.dumps([fingerprint, file.url, file.size, file.version]))[:16]


# --------------------------------------------------------------------------- plan


def plan_prepare(spec: PrepareSpec) -> Plan:
    """List and fingerprint the sources, read the existing manifest, find the new units.

    Writes nothing. DataError for an unknown or empty source, rows without the text field, a
    missing tokenizer file, a file changed since it was prepared, or a manifest at the URL from
    another tokenizer or dataset.
    """
    tokenizer = cached_tokenizer(spec.tokenizer_path, refresh=True)
    fingerprint = dataset_fingerprint(spec, tokenizer.fingerprint)
    url = f"{spec.root.rstrip('/')}/{fingerprint}"
    listed = _list_units(spec, fingerprint)
    manifest = _read_existing(url, fingerprint, tokenizer.fingerprint)
    exists = manifest is not None
    if manifest is None:
        manifest = Manifest(
            fingerprint=fingerprint,
            tokenizer=tokenizer_info(tokenizer),
            dtype=token_dtype(tokenizer.n_words).str,
            text_field=spec.text_field,
            sources=list(spec.sources),
            validation=_validation(spec),
        )
    known = {f.url: f for f in manifest.files}
    # Units whose shards are gone or cut short (deleted by hand, lost with a disk) are prepared
    # again: tokenizing is deterministic, so the same bytes come back under the same names.
    damaged = damaged_units(url, manifest) if exists else {}
    if damaged:
        logger.warning(
            "data: %d prepared unit(s) of %s lost shard files (first: %s); preparing them again",
            len(damaged),
            url,
            next(iter(damaged.values())),
        )
    todo: list[Unit] = []
    for source, file in listed:
        old = known.get(file.url)
        if old is None or (old.unit == file.unit and old.unit in damaged):
            todo.append(Unit(file=file, source=source, index=len(todo)))
        elif old.unit != file.unit:
            raise DataError(
                f"{file.url}: changed since it was prepared into {url} (size {old.size} -> "
                f"{file.size}, version {old.version} -> {file.version}); prepared datasets are "
                "append-only: restore the file and add new data as new files, or start a new "
                f"dataset (another data root / --out, or delete {url})"
            )
    _check_hf_unchanged(todo, manifest, url)
    listed_urls = {file.url for _, file in listed}
    gone = [f for f in manifest.files if f.url not in listed_urls]
    if lost := [f.url for f in gone if f.unit in damaged]:
        raise DataError(
            f"{url}: shards of {lost[0]} are missing or cut short and its source is gone, so they "
            f"cannot be prepared again; restore the source or the shard files, or prepare a new "
            "dataset"
        )
    if gone:
        logger.warning(
            "data: %d prepared file(s) are gone from the sources (first: %s); their shards stay "
            "in %s",
            len(gone),
            gone[0].url,
            url,
        )
    _check_documents(spec, listed, todo, manifest)
    cache_key = _sha256("\n".join([fingerprint, *(file.unit for _, file in listed)]))
    return Plan(
        spec=spec,
        url=url,
        manifest=manifest,
        todo=todo,
        cache_key=cache_key,
        exists=exists,
        reused_units=len(listed) - len(todo),
        gone=gone,
        root_existed="://" in spec.root or os.path.isdir(spec.root),
    )


def _check_hf_unchanged(todo: list[Unit], manifest: Manifest, url: str) -> None:
    """A Hugging Face dataset has no files to append: a new shard of a dataset already prepared
    means it changed (a new revision, other shards), and would duplicate its documents."""
    prepared = {f.url.partition("#")[0] for f in manifest.files if f.url.startswith("hf:")}
    for unit in todo:
        dataset = unit.file.url.partition("#")[0]
        if unit.file.url.startswith("hf:") and dataset in prepared:
            raise DataError(
                f"{dataset}: changed since it was prepared into {url} (now {unit.file.url}, "
                f"version {unit.file.version}); prepared datasets are append-only: pin "
                "revision= to the prepared one, or start a new dataset (another data root / "
                f"--out, or delete {url})"
            )


def _list_units(spec: PrepareSpec, fingerprint: str) -> list[tuple[str, SourceFile]]:
    listed: list[tuple[str, SourceFile]] = []
    first_source: dict[str, str] = {}
    for source in spec.sources:
        for file in list_source(source):
            if file.url in first_source:
                raise DataError(
                    f"{file.url}: listed twice (by sources {first_source[file.url]} and "
                    f"{source}); give each file once"
                )
            first_source[file.url] = source
            file.unit = unit_id(fingerprint, file)
            listed.append((source, file))
    return listed


def _read_existing(url: str, fingerprint: str, tokenizer_fingerprint: str) -> Manifest | None:
    """The manifest at ``url`` (checked to be this dataset's), or None when there is none."""
    fs, path = filesystem(manifest_url(url))
    with storage_errors(url):
        try:
            fs.info(path)
        except FileNotFoundError:
            return None
        manifest = read_manifest(url)
    check_tokenizer(manifest, manifest_url(url), tokenizer_fingerprint)
    if manifest.fingerprint != fingerprint:
        raise DataError(
            f"{manifest_url(url)}: holds dataset {manifest.fingerprint}, not {fingerprint}; "
            "remove it or use another data root"
        )
    return manifest


def _check_documents(
    spec: PrepareSpec, listed: list[tuple[str, SourceFile]], todo: list[Unit], manifest: Manifest
) -> None:
    """Read the first document of each source's new units: a missing text field or a source
    without any document fails here, before anything is written."""
    docs_of_unit: Counter[str] = Counter()
    for shard in manifest.shards:
        docs_of_unit[shard.unit] += shard.num_docs
    new_units = {unit.file.unit for unit in todo}
    for source in spec.sources:
        units = [file for s, file in listed if s == source]
        has_docs = any(docs_of_unit[f.unit] for f in units if f.unit not in new_units)
        stats = new_stats()
        for file in (f for f in units if f.unit in new_units):
            with contextlib.closing(read_documents(file.url, spec.text_field, stats)) as docs:
                if next(docs, None) is not None:
                    has_docs = True
            if has_docs:
                break
        if not has_docs:
            raise DataError(
                f"{source}: empty source (no documents in {len(units)} file(s); skipped "
                f"{stats['skipped_empty']} empty and {stats['skipped_undecodable']} "
                "undecodable rows)"
            )


# --------------------------------------------------------------------------- tokenize


def tokenize_unit(
    unit: Unit,
    *,
    url: str,
    staging: str,
    tokenizer_path: str,
    text_field: str,
    validation_every: int,
    fingerprint: str,
    num_threads: int = 1,
) -> list[ShardInfo]:
    """Tokenize one unit into ``<unit>-train`` and ``<unit>-validation`` shards in the plan's
    ``staging`` folder of the dataset ``url`` (``commit_prepare`` publishes them).

    ``fingerprint`` is the tokenizer fingerprint the plan recorded (``Plan.unit_kwargs()``);
    every document is ``Tokenizer.encode(text, bos=True, eos=True)``; document i goes to
    validation when ``validation_every`` and ``i % validation_every == validation_every - 1``.
    Only splits with documents get a shard. ``num_threads`` > 1 encodes batches on threads
    (for a lone unit with idle cores; the same ids). Returns the shards written, train first.
    """
    tokenizer = cached_tokenizer(tokenizer_path, fingerprint)
    now = file_identity(unit.file.url)
    if (now.size, now.version) != (unit.file.size, unit.file.version):
        raise DataError(
            f"{unit.file.url}: changed while being prepared (size {unit.file.size} -> {now.size},"
            f" version {unit.file.version} -> {now.version}); run prepare again"
        )
    dtype = token_dtype(tokenizer.n_words)
    splits = {s: SplitBuilder(dtype, tokenizer.bos_id, tokenizer.eos_id) for s in SPLITS}
    stats = new_stats()
    docs = read_documents(unit.file.url, text_field, stats)
    for index, ids in enumerate(encode_documents(tokenizer, docs, num_threads)):
        held_out = validation_every and index % validation_every == validation_every - 1
        splits["validation" if held_out else "train"].add(ids)
    if stats["skipped_empty"] or stats["skipped_undecodable"]:
        logger.warning(
            "data: %s: skipped %d empty and %d undecodable rows",
            unit.file.url,
            stats["skipped_empty"],
            stats["skipped_undecodable"],
        )
    with storage_errors(url):
        return [
            builder.write(url, name=f"{unit.file.unit}-{split}", split=split,
                          unit=unit.file.unit, source=unit.file.url, folder=staging)
            for split, builder in splits.items()
            if builder.lengths
        ]  # fmt: skip


# --------------------------------------------------------------------------- commit


@contextlib.contextmanager
def dataset_lock(plan: Plan) -> Iterator[None]:
    """Serialise what prepares of one data root do to its files (create a staging folder,
    publish shards and the manifest, remove debris; never tokenizing): an exclusive ``flock``
    on the local data root folder, held for milliseconds. Object stores have no such lock: a
    prepare there only ever removes its staging folder (docs/data.md)."""
    if "://" in plan.spec.root:
        yield
        return
    with storage.folder_lock(plan.spec.root):
        yield


def commit_prepare(plan: Plan, results: Sequence[list[ShardInfo]]) -> Manifest:
    """Publish the planned units (``results[i]`` = shards of ``plan.todo[i]``, written to the
    plan's staging folder): move their files under ``shards/``, append them to the manifest and
    write it. Writes nothing when there was nothing to do and the manifest exists.

    Another prepare of the same dataset may have committed since the plan: the manifest is
    built on the one on storage, and a unit it holds already keeps its files (ours, the same
    bytes, go with the staging folder). If writing the manifest fails, the files this commit
    moved under ``shards/`` for units the manifest does not list are removed again."""
    if len(results) != len(plan.todo):
        raise ValueError(f"commit_prepare: {len(results)} results for {len(plan.todo)} units")
    if not plan.todo and plan.exists:
        return plan.manifest
    with dataset_lock(plan):
        for _ in range(_COMMIT_ATTEMPTS):
            published: list[tuple[str, str]] = []  # (unit, file) moved under shards/ for new units
            try:
                manifest, changed = _publish(plan, results, published)
                if changed:
                    with storage_errors(plan.url):
                        write_manifest(plan.url, manifest)
                if _committed(plan, manifest):
                    break
            except BaseException:
                with contextlib.suppress(Exception):
                    _unpublish(plan, published)
                raise
            # An object store has no lock: another prepare replaced the manifest with one built
            # on an older copy. Our files are published: build on its manifest once more.
            logger.warning("data: %s: the manifest changed while committing; again", plan.url)
        else:
            raise DataError(
                f"{manifest_url(plan.url)}: replaced by other prepares {_COMMIT_ATTEMPTS} times "
                "while committing; run prepare again"
            )
        _remove_staging(plan)
    return manifest


_COMMIT_ATTEMPTS = 5


def _publish(
    plan: Plan, results: Sequence[list[ShardInfo]], published: list[tuple[str, str]]
) -> tuple[Manifest, bool]:
    """The manifest on storage with the plan's units added, their staged files moved under
    ``shards/`` (``published`` collects those of new units as they move); whether it changed."""
    tokenizer = plan.manifest.tokenizer["fingerprint"]
    current = _read_existing(plan.url, plan.manifest.fingerprint, tokenizer)
    manifest = copy.deepcopy(current if current is not None else plan.manifest)
    damaged = damaged_units(plan.url, manifest) if current is not None else {}
    known = {f.unit for f in manifest.files}
    fs, _ = fsspec.core.url_to_fs(plan.url)
    changed = current is None
    for unit, shards in zip(plan.todo, results, strict=True):
        unit_id = unit.file.unit
        if unit_id in known and unit_id not in damaged:
            continue  # committed meanwhile by another prepare: its files stay, ours are copies
        assert all(s.unit == unit_id for s in shards), (unit, shards)
        for shard in shards:
            for staged, final in zip(_staged_urls(plan, shard), shard_urls(plan.url, shard)):
                with storage_errors(plan.url):
                    _move(fs, staged, final)
                if unit_id not in known:
                    published.append((unit_id, final))
        if unit_id in known:  # repaired: the same names and bytes as the entries it had
            by_name = {s.name: s for s in shards}
            manifest.shards = [by_name.get(s.name, s) if s.unit == unit_id else s
                               for s in manifest.shards]  # fmt: skip
        else:
            manifest.files.append(unit.file)
            manifest.shards.extend(shards)
        changed = True
    return manifest, changed


def _committed(plan: Plan, written: Manifest) -> bool:
    """Whether the manifest on storage lists every unit ``written`` does (locally, under the
    lock, it is ``written`` itself)."""
    if "://" not in plan.url:
        return True
    current = read_manifest(plan.url)
    return {f.unit for f in written.files} <= {f.unit for f in current.files}


def _unpublish(plan: Plan, published: list[tuple[str, str]]) -> None:
    """After a failed commit (under the lock): remove the files it moved under ``shards/`` for
    units that the manifest on storage does not list. Local folders only: on an object store
    another prepare may be committing the same unit's files right now, so they stay (a later
    prepare of the unit writes the same bytes under the same names)."""
    if "://" in plan.url or not published:
        return
    listed: set[str] = set()
    with contextlib.suppress(FileNotFoundError, DataError):
        listed = {f.unit for f in read_manifest(plan.url).files}
    for unit_id, path in published:
        if unit_id not in listed:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def _staged_urls(plan: Plan, shard: ShardInfo) -> tuple[str, str]:
    base = f"{plan.url.rstrip('/')}/{plan.staging}/{shard.name}"
    return f"{base}.tokens", f"{base}.docs"


def _move(fs: Any, src: str, dst: str) -> None:
    if "://" not in src:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)  # atomic: a reader sees the whole file or none
    else:
        fs.mv(src, dst)  # a server-side copy, then the staged object goes


def _remove_staging(plan: Plan) -> None:
    """Remove the plan's staging folder (what is left in it are copies or debris)."""
    path = f"{plan.url.rstrip('/')}/{plan.staging}"
    if "://" not in path:
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, inner = fsspec.core.url_to_fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=True)


# --------------------------------------------------------------------------- prepare

MapFn = Callable[[Callable[[Unit], list[ShardInfo]], Sequence[Unit]], Iterable[list[ShardInfo]]]


@contextlib.contextmanager
def discard_on_failure(plan: Plan) -> Iterator[None]:
    """When tokenizing or committing ``plan``'s units fails (or is interrupted): remove its
    staging folder, what this prepare alone wrote, and nothing else (a new dataset's folder
    goes too when nothing else is in it)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception), dataset_lock(plan):
            # The failure itself is what the user must see.
            _remove_staging(plan)
            if not plan.exists and "://" not in plan.url:
                folders = [posixpath.join(plan.url, SHARD_DIR), plan.url]
                for folder in folders + ([] if plan.root_existed else [plan.spec.root]):
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)  # only when empty: another prepare may be at work
        raise


def prepare(
    spec: PrepareSpec,
    *,
    workers: int = 0,
    map_fn: MapFn | None = None,
    share_cores: bool | None = None,
    on_plan: Callable[[Plan], None] | None = None,
) -> PrepareResult:
    """Plan, tokenize the new units (``map_fn(fn, units)``, default a pool of ``workers``
    processes, 0 = every core; ``map`` runs them inline), commit.

    ``fn`` is ``tokenize_unit`` with the plan's arguments (picklable: an engine may run it in
    other processes or on other machines). ``share_cores``: fewer units than ``workers`` cores
    give each unit's process the idle cores' encoding threads (default: with the local pool
    only; one thread per unit otherwise). ``on_plan(plan)`` is called once planned, before any
    unit is tokenized (progress reporting).
    """
    start = time.perf_counter()
    plan = plan_prepare(spec)
    if on_plan is not None:
        on_plan(plan)
    with dataset_lock(plan):
        if removed := remove_orphan_temps(plan.url):
            logger.info("data: removed %d temp file(s) of killed prepares", len(removed))
        if plan.todo and "://" not in plan.url:  # made now, under the lock: see discard
            with storage_errors(plan.url):
                os.makedirs(posixpath.join(plan.url, plan.staging), exist_ok=True)
    if not plan.todo:
        return PrepareResult(
            url=plan.url,
            manifest=plan.manifest,
            new_shards=0,
            reused_units=plan.reused_units,
            cached=True,
            tokens=0,
            seconds=time.perf_counter() - start,
        )
    cores = workers or os.cpu_count() or 1
    processes = min(cores, len(plan.todo))
    share = map_fn is None if share_cores is None else share_cores
    threads = max(1, cores // processes) if share else 1
    fn = functools.partial(tokenize_unit, **plan.unit_kwargs(), num_threads=threads)
    if map_fn is None:
        map_fn = functools.partial(process_map, processes=processes)
    with discard_on_failure(plan):
        results = list(map_fn(fn, plan.todo))
        manifest = commit_prepare(plan, results)
    new = [s for shards in results for s in shards]
    return PrepareResult(
        url=plan.url,
        manifest=manifest,
        new_shards=len(new),
        reused_units=plan.reused_units,
        cached=False,
        tokens=sum(s.num_tokens for s in new),
        new_units=len(plan.todo),
        seconds=time.perf_counter() - start,
    )


def process_map(
    fn: Callable[[Unit], list[ShardInfo]], units: Sequence[Unit], *, processes: int
) -> list[list[ShardInfo]]:
    """``[fn(u) for u in units]`` on ``processes`` local processes (inline for one); the first
    failure cancels the units not started yet and is raised."""
    if processes <= 1 or len(units) <= 1:
        results = []
        for done, unit in enumerate(units, start=1):
            results.append(fn(unit))
            _log_progress(done, len(units), unit)
        return results
    # fork when this process runs no other thread (nothing can hold a lock across the fork):
    # workers start at once with the tokenizer built. Else spawn: workers start clean, not as
    # a fork of a process whose threads (s3fs' event loop, torch's pools) may hold locks, and
    # see the environment (S3 credentials) as it is now, not as when a forkserver started.
    alone = threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if alone else "spawn")
    with ProcessPoolExecutor(max_workers=processes, mp_context=context) as pool:
        futures = {pool.submit(fn, unit): unit for unit in units}
        try:
            for done, future in enumerate(as_completed(futures), start=1):
                future.result()  # the first failure raises here
                _log_progress(done, len(units), futures[future])
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        return [future.result() for future in futures]


def _log_progress(done: int, total: int, unit: Unit) -> None:
    # About 20 lines however many units: a folder of 10,000 files must not print 10,000 lines.
    if done == total or done % max(1, total // 20) == 0:
        logger.info("data: tokenized %d/%d units (last: %s)", done, total, unit.file.url)


def _validation(spec: PrepareSpec) -> dict[str, Any]:
    return {"rule": VALIDATION_RULE, "every": spec.validation_every}


def _normalize_location(location: str) -> str:
    if "://" in location and not location.startswith("file://"):
        return location
    return os.path.abspath(os.path.expanduser(location.removeprefix("file://")))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
