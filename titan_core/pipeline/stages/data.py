"""Prepared data of a pipeline run: ``prepare_data``'s parameters, cache key, log lines and
summary, and the record of the dataset a run trained on. The tasks are in ``tasks/data.py``.

The stage is ``titan_core.data.prepare.prepare``: it plans (lists the sources, fingerprints their
files, reads an existing manifest), tokenizes each file not yet prepared and commits the new
shards to the manifest. The task hands it a ``map_fn`` that runs one ``tokenize_shard`` task per
file, on local processes (``data.workers``, all cores by default) or, with
``data.dask_address``, on that Dask cluster through Prefect's Dask task runner; either way each
is a task run of its own in the Prefect UI, under ``prepare_data``.

``prepare_data`` is cached by the plan's key (the dataset's fingerprint, every file's identity and
the data root): the same sources and tokenizer show as Cached and tokenize nothing; a file
appended to a source changes the key, and only its shards are tokenized.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_core.config.job import JobConfig
from titan_core.data.prepare import Plan, PrepareResult, PrepareSpec, Unit, plan_prepare
from titan_core.data.shards import is_prepared
from titan_core.errors import ConfigError, TitanError
from titan_core.pipeline.run.common import Logger, redact

if TYPE_CHECKING:
    from titan_core.pipeline.run.transfer import SecretLoader

# Shard workers import this module to unpickle tokenize_shard: what the parent alone needs (run
# storage, which imports torch) is imported where it is used, so a worker starts in ~1 s, not ~5.
DATASET_RECORD = "dataset.json"  # in a run root: the prepared dataset the run trained on


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """What ``prepare_data`` made: where the dataset is and how much of it this run added."""

    url: str
    """The prepared dataset (``<data root>/<fingerprint>``): what ``dataloader.dataset`` names."""
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
    """Where prepared datasets live: ``data.root``, else ``<job.dump_folder>/data`` of the user's
    config (the output root; a run's config has its own folder there)."""
    from titan_core import storage
    from titan_core.pipeline.run.paths import absolute

    if cfg.data.root:
        return absolute(cfg.data.root)
    return storage.join(absolute(cfg.job.dump_folder), "data")


def prepare_params(cfg: JobConfig, tokenizer_path: str) -> dict[str, Any]:
    """``prepare_data``'s parameters for ``cfg``'s ``[data]`` section and the run's tokenizer."""
    if cfg.dataloader.mix:
        raise ConfigError(
            "data.sources: dataloader.mix is set too; the mix replaces the prepared "
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
        cfg, dataloader=dataclasses.replace(cfg.dataloader, dataset=prepared.url, path="")
    )


def is_stored(prepared: PreparedData) -> bool:
    """Whether a (cached) result's dataset still has its manifest in storage."""
    return is_prepared(prepared.url)


def prepare_spec(params: dict[str, Any]) -> PrepareSpec:
    """The ``PrepareSpec`` of ``prepare_data``'s parameters."""
    return PrepareSpec(
        sources=tuple(params["sources"]),
        text_field=params["text_field"],
        validation_every=params["validation_every"],
        tokenizer_path=params["tokenizer_path"],
        root=params["root"],
    )


_configured: set[str] = set()


def credentials_once(block: str, load_secret: SecretLoader) -> None:
    """S3 credentials from the Secret block ``block`` (read by ``load_secret``), once per process
    (a Dask worker on another machine has only what the block gives it; local processes inherit
    the environment)."""
    if block and block not in _configured:
        from titan_core.pipeline.run.transfer import configure_credentials

        configure_credentials(block, load_secret)
        _configured.add(block)


def prepare_cache_key(params: dict[str, Any], load_secret: SecretLoader) -> str | None:
    """``prepare_data``'s cache key: the plan's key plus the data root's location; None (no
    caching) when planning fails, so the task body raises the error itself, as one line."""
    from titan_core.pipeline.run.paths import storage_identity

    try:
        credentials_once(params.get("credentials_block", ""), load_secret)
        key = plan_prepare(prepare_spec(params)).cache_key
    except (TitanError, OSError):
        return None
    identity = f"{key}|{storage_identity(params['root'])}"
    return "prepare-data-" + hashlib.sha256(identity.encode()).hexdigest()[:32]


def prepared_summary(result: PrepareResult) -> PreparedData:
    """What a prepared dataset holds, and what this ``prepare`` call added to it."""
    manifest = result.manifest
    train, validation = manifest.split_shards("train"), manifest.split_shards("validation")
    return PreparedData(
        url=result.url,
        train_shards=len(train),
        train_tokens=sum(s.num_tokens for s in train),
        validation_tokens=sum(s.num_tokens for s in validation),
        new_shards=result.new_shards,
        reused_units=result.reused_units,
    )


def log_plan(logger: Logger, dask_address: str, plan: Plan) -> None:
    """What ``prepare`` is about to do (its ``on_plan``): nothing, the dataset being up to date,
    or tokenize the new files on local processes or the Dask cluster."""
    if not plan.todo:
        logger.info(
            "Prepared dataset %s is up to date (%d files)", redact(plan.url), plan.reused_units
        )
        return
    where = f"Dask cluster {dask_address}" if dask_address else "local processes"
    logger.info(
        "Preparing %s: %d new files on %s, %d prepared before",
        redact(plan.url),
        len(plan.todo),
        where,
        plan.reused_units,
    )


def log_prepared(logger: Logger, prepared: PreparedData) -> None:
    """What a ``prepare`` call that tokenized new files made of the dataset."""
    logger.info(
        "Prepared dataset %s: %d new shards; %d train shards, %s train and %s validation tokens",
        redact(prepared.url),
        prepared.new_shards,
        prepared.train_shards,
        f"{prepared.train_tokens:,}",
        f"{prepared.validation_tokens:,}",
    )


def shard_run_label(unit: Unit) -> str:
    """``<folder>/<file>`` of a unit's source file (or its Hugging Face shard URL)."""
    url = unit.file.url.rstrip("/")
    if url.startswith("hf:"):
        return url
    folder, name = posixpath.split(url)
    return posixpath.join(posixpath.basename(folder), name)


def record_dataset(run_root: str, prepared: PreparedData) -> None:
    """Write ``<run>/dataset.json``: the prepared dataset the run trains on, as it is now."""
    from titan_core import storage

    text = json.dumps(dataclasses.asdict(prepared), indent=1) + "\n"
    storage.write_text(storage.join(run_root, DATASET_RECORD), text)


def dataset_grew(run_root: str, prepared: PreparedData) -> bool:
    """Whether ``prepared`` has more train shards than the dataset the run at ``run_root``
    trained on (same dataset, files appended since)."""
    from titan_core import storage

    record = storage.join(run_root, DATASET_RECORD)
    if not storage.exists(record):
        return False
    seen = json.loads(storage.read_text(record))
    return seen.get("url") == prepared.url and prepared.train_shards > seen.get("train_shards", 0)
