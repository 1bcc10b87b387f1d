"""``prepare_data``: raw sources tokenized once into a prepared dataset, one task per source file.

The stage plans (lists the sources, fingerprints their files, reads an existing manifest), runs
one ``tokenize_shard`` task per file not yet prepared and commits the new shards to the manifest
(``titan_core.data.prepare``). The shard tasks run on local processes (``data.workers``, all
cores by default) or, with ``data.dask_address``, on that Dask cluster through Prefect's Dask task
runner; either way each is a task run of its own in the Prefect UI, under ``prepare_data``.
Parameters, cache key and summary: ``titan_core.pipeline.data``.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.runners import api_for_workers, task_runner
from tasks.common import retry_transient
from titan_core.data.prepare import (
    PrepareSpec,
    Unit,
    commit_prepare,
    discard_on_failure,
    plan_prepare,
    tokenize_unit,
)
from titan_core.data.shards import ShardInfo
from titan_core.pipeline.common import redact, run_logger
from titan_core.pipeline.data import (
    PreparedData,
    credentials_once,
    prepare_cache_key,
    prepared_summary,
    shard_run_label,
    shard_threads,
)

# Shard workers import this module to unpickle tokenize_shard: what the parent alone needs (run
# storage, which imports torch) is imported where it is used, so a worker starts in ~1 s, not ~5.


def _cache_key(context: Any, params: dict[str, Any]) -> str | None:
    """Prefect ``cache_key_fn``: the plan's key (None: not cached, the body raises the error)."""
    return prepare_cache_key(params)


def _shard_run_name() -> str:
    """Prefect ``task_run_name``: ``tokenize_shard[<folder>/<file>]``."""
    from prefect.runtime import task_run

    return f"tokenize_shard[{shard_run_label(task_run.parameters['unit'])}]"


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
    credentials_once(credentials_block)
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
    credentials_once(credentials_block)
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
        return prepared_summary(plan.url, plan.manifest, 0, reused)
    where = f"Dask cluster {dask_address}" if dask_address else "local processes"
    logger.info(
        "Preparing %s: %d new files on %s, %d prepared before",
        redact(plan.url),
        len(plan.todo),
        where,
        reused,
    )
    with discard_on_failure(plan):  # a failed unit leaves no shard of this plan behind
        threads = shard_threads(workers, dask_address, len(plan.todo))
        fixed = plan.unit_kwargs() | {
            "num_threads": threads,
            "credentials_block": credentials_block,
        }
        with api_for_workers(), task_runner(workers, dask_address, len(plan.todo)) as runner:
            futures = [
                runner.submit(tokenize_shard, parameters={"unit": unit, **fixed})
                for unit in plan.todo
            ]
            results = [future.result() for future in futures]
        manifest = commit_prepare(plan, results)
    prepared = prepared_summary(plan.url, manifest, sum(len(r) for r in results), reused)
    logger.info(
        "Prepared dataset %s: %d new shards; %d train shards, %s train and %s validation tokens",
        redact(plan.url),
        prepared.new_shards,
        prepared.train_shards,
        f"{prepared.train_tokens:,}",
        f"{prepared.validation_tokens:,}",
    )
    return prepared
