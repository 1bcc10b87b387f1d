"""``prepare_data``: raw sources tokenized once into a prepared dataset, one task per source file.

The stage plans (lists the sources, fingerprints their files, reads an existing manifest), runs
one ``tokenize_shard`` task per file not yet prepared and commits the new shards to the manifest
(``titan_core.data.prepare``). The shard tasks run on local processes (``data.workers``, all
cores by default) or, with ``data.dask_address``, on that Dask cluster through Prefect's Dask task
runner; either way each is a task run of its own in the Prefect UI, under ``prepare_data``.

``prepare_data`` is cached by the plan's key (the dataset's fingerprint, every file's identity and
the data root): the same sources and tokenizer show as Cached and tokenize nothing; a file
appended to a source changes the key, and only its shards are tokenized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.common import redact, retry_transient, run_logger
from titan_core.config.job import JobConfig
from titan_core.data.prepare import (
    Plan,
    PrepareSpec,
    Unit,
    commit_prepare,
    discard_on_failure,
    plan_prepare,
    tokenize_unit,
)
from titan_core.data.shards import Manifest, ShardInfo, is_prepared
from titan_core.errors import ConfigError, TitanError

# Shard workers import this module to unpickle tokenize_shard: what the parent alone needs (run
# storage, which imports torch) is imported where it is used, so a worker starts in ~1 s, not ~5.
DATASET_RECORD = "dataset.json"  # in a run root: the prepared dataset the run trained on


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """What ``prepare_data`` made: where the dataset is and how much of it this run added."""

    url: str
    """The prepared dataset (``<data root>/<fingerprint>``): what ``training.dataset`` names."""
    train_shards: int
    """Non-empty train shards in the manifest (the reader's stream, in order)."""
    train_tokens: int
    validation_tokens: int
    new_shards: int
    """Shards the preparing task run tokenized (a Cached result repeats that run's count)."""
    reused_units: int
    """Source files (or Hugging Face shards) it found prepared by an earlier run."""

    def summary(self) -> dict[str, Any]:
        """The entries a run's summary carries about its dataset."""
        return {
            "dataset": self.url,
            "dataset_train_shards": self.train_shards,
            "dataset_train_tokens": self.train_tokens,
        }


def data_root(cfg: JobConfig) -> str:
    """Where prepared datasets live: ``data.root``, else ``<storage.root>/data``."""
    from tasks.storage import absolute
    from titan_core import storage

    if cfg.data.root:
        return absolute(cfg.data.root)
    return storage.join(absolute(cfg.storage.root), "data")


def prepare_params(cfg: JobConfig, tokenizer_path: str) -> dict[str, Any]:
    """``prepare_data``'s parameters for ``cfg``'s ``[data]`` section and the run's tokenizer."""
    if cfg.training.dataset_mix:
        raise ConfigError(
            "data.sources: training.dataset_mix is set too; the mix replaces the prepared "
            "dataset, so set one of them (or mix prepared dataset URLs without data.sources)"
        )
    return {
        "sources": list(cfg.data.sources),
        "text_field": cfg.data.text_field,
        "validation_every": cfg.data.validation_every,
        "tokenizer_path": tokenizer_path,
        "root": data_root(cfg),
        "workers": cfg.data.workers,
        "dask_address": cfg.data.dask_address,
        "credentials_block": cfg.storage.credentials_block,
    }


def train_on(cfg: JobConfig, prepared: PreparedData) -> JobConfig:
    """``cfg`` training on the prepared dataset; validation reads its validation split unless
    ``validation.dataset`` names another dataset."""
    return dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, dataset=prepared.url, dataset_path="")
    )


def is_stored(prepared: PreparedData) -> bool:
    """Whether a (cached) result's dataset still has its manifest in storage."""
    return is_prepared(prepared.url)


def _spec(params: dict[str, Any]) -> PrepareSpec:
    return PrepareSpec(
        sources=tuple(params["sources"]),
        text_field=params["text_field"],
        validation_every=params["validation_every"],
        tokenizer_path=params["tokenizer_path"],
        root=params["root"],
    )


_configured: set[str] = set()


def _credentials(block: str) -> None:
    """S3 credentials from the Secret block ``block``, once per process (a Dask worker on another
    machine has only what the block gives it; local processes inherit the environment)."""
    if block and block not in _configured:
        from tasks.storage import configure_credentials

        configure_credentials(block)
        _configured.add(block)


def _cache_key(context: Any, params: dict[str, Any]) -> str | None:
    """The plan's key plus the data root's location; None (no caching) when planning fails, so
    the task body raises the error itself, as one line."""
    from tasks.storage import storage_identity

    try:
        _credentials(params.get("credentials_block", ""))
        key = plan_prepare(_spec(params)).cache_key
    except (TitanError, OSError):
        return None
    identity = f"{key}|{storage_identity(params['root'])}"
    return "prepare-data-" + hashlib.sha256(identity.encode()).hexdigest()[:32]


def _shard_run_name() -> str:
    """``tokenize_shard[<folder>/<file>]``: the source file (or Hugging Face shard) of the unit."""
    from prefect.runtime import task_run

    unit = task_run.parameters["unit"]
    url = unit.file.url.rstrip("/")
    if url.startswith("hf:"):
        return f"tokenize_shard[{url}]"
    folder, name = posixpath.split(url)
    return f"tokenize_shard[{posixpath.join(posixpath.basename(folder), name)}]"


@task(
    name="tokenize_shard",
    task_run_name=_shard_run_name,
    cache_policy=NO_CACHE,  # prepare_data caches the whole plan; a rerun rewrites the same bytes
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=retry_transient,
)
def tokenize_shard(
    unit: Unit,
    url: str,
    tokenizer_path: str,
    text_field: str,
    validation_every: int,
    fingerprint: str,
    num_threads: int = 1,
    credentials_block: str = "",
) -> list[ShardInfo]:
    """Tokenize one source file (or Hugging Face shard) into its shards under ``url``
    (``fingerprint``: the tokenizer's, as planned)."""
    _credentials(credentials_block)
    shards = tokenize_unit(
        unit,
        url=url,
        tokenizer_path=tokenizer_path,
        text_field=text_field,
        validation_every=validation_every,
        fingerprint=fingerprint,
        num_threads=num_threads,
    )
    run_logger().info(
        "Tokenized %s: %d documents, %d tokens (%s)",
        redact(unit.file.url),
        sum(s.num_docs for s in shards),
        sum(s.num_tokens for s in shards),
        ", ".join(f"{s.split} {s.num_tokens}" for s in shards),
    )
    return shards


@contextlib.contextmanager
def _api_for_workers() -> Iterator[None]:
    """Point the shard workers at this process's Prefect API.

    Without ``PREFECT_API_URL`` Prefect runs a temporary server in this process; a spawned worker
    would start a server of its own (seconds each, on the same database) instead of reporting
    to ours.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        url = str(client.api_url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


def task_runner(workers: int, dask_address: str, num_units: int) -> Any:
    """Dask's task runner for a scheduler address, else a local process pool (``workers``, 0 =
    every core, never more than there are units)."""
    if dask_address:
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(address=dask_address)
    from prefect.task_runners import ProcessPoolTaskRunner

    return ProcessPoolTaskRunner(max_workers=min(workers or os.cpu_count() or 1, num_units))


def tokenize_units(
    plan: Plan, *, workers: int, dask_address: str, credentials_block: str
) -> list[list[ShardInfo]]:
    """Run one ``tokenize_shard`` task per unit of ``plan.todo``; their shards, in unit order."""
    cores = workers or os.cpu_count() or 1
    # Fewer units than local cores: each unit's process encodes on the idle cores' threads too.
    threads = 1 if dask_address else max(1, cores // min(cores, len(plan.todo)))
    fixed = plan.unit_kwargs() | {"num_threads": threads, "credentials_block": credentials_block}
    with _api_for_workers(), task_runner(workers, dask_address, len(plan.todo)) as runner:
        futures = [
            runner.submit(tokenize_shard, parameters={"unit": unit, **fixed}) for unit in plan.todo
        ]
        return [future.result() for future in futures]


def _summary(url: str, manifest: Manifest, new_shards: int, reused_units: int) -> PreparedData:
    train, validation = manifest.split_shards("train"), manifest.split_shards("validation")
    return PreparedData(
        url=url,
        train_shards=len(train),
        train_tokens=sum(s.num_tokens for s in train),
        validation_tokens=sum(s.num_tokens for s in validation),
        new_shards=new_shards,
        reused_units=reused_units,
    )


@task(
    name="prepare_data",
    cache_key_fn=_cache_key,
    persist_result=True,
    result_serializer="json",
    retries=1,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=retry_transient,
)
def prepare_data(
    sources: list[str],
    text_field: str,
    validation_every: int,
    tokenizer_path: str,
    root: str,
    workers: int = 0,
    dask_address: str = "",
    credentials_block: str = "",
) -> PreparedData:
    """Tokenize the files of ``sources`` not yet prepared into ``<root>/<fingerprint>``.

    Cached by the plan (sources' files, tokenizer, text field, split rule) and the data root.
    """
    _credentials(credentials_block)
    spec = PrepareSpec(
        sources=tuple(sources),
        text_field=text_field,
        validation_every=validation_every,
        tokenizer_path=tokenizer_path,
        root=root,
    )
    plan = plan_prepare(spec)
    logger = run_logger()
    reused = plan.reused_units
    if not plan.todo and plan.exists:
        logger.info("Prepared dataset %s is up to date (%d files)", redact(plan.url), reused)
        return _summary(plan.url, plan.manifest, 0, reused)
    where = f"Dask cluster {dask_address}" if dask_address else "local processes"
    logger.info(
        "Preparing %s: %d new files on %s, %d prepared before",
        redact(plan.url),
        len(plan.todo),
        where,
        reused,
    )
    with discard_on_failure(plan):  # a failed unit leaves no shard of this plan behind
        results = tokenize_units(
            plan, workers=workers, dask_address=dask_address, credentials_block=credentials_block
        )
        manifest = commit_prepare(plan, results)
    prepared = _summary(plan.url, manifest, sum(len(r) for r in results), reused)
    logger.info(
        "Prepared dataset %s: %d new shards; %d train shards, %s train and %s validation tokens",
        redact(plan.url),
        prepared.new_shards,
        prepared.train_shards,
        f"{prepared.train_tokens:,}",
        f"{prepared.validation_tokens:,}",
    )
    return prepared


def record_dataset(run_root: str, prepared: PreparedData) -> None:
    """Write ``<run>/dataset.json``: the prepared dataset the run trains on, as it is now."""
    from titan_core import storage

    text = json.dumps(dataclasses.asdict(prepared), indent=1) + "\n"
    storage.write_text_atomic(storage.join(run_root, DATASET_RECORD), text)


def dataset_grew(run_root: str, prepared: PreparedData) -> bool:
    """Whether ``prepared`` has more train shards than the dataset the run at ``run_root``
    trained on (same dataset, files appended since)."""
    from titan_core import storage

    record = storage.join(run_root, DATASET_RECORD)
    if not storage.exists(record):
        return False
    seen = json.loads(storage.read_text(record))
    return seen.get("url") == prepared.url and prepared.train_shards > seen.get("train_shards", 0)
