"""``prepare_data``: raw sources tokenized once into a prepared dataset, one task per source file.

The task is ``titan_core.data.prepare.prepare`` (plan, tokenize the files not yet prepared, commit
the new shards to the manifest) with a ``map_fn`` that runs each file's ``tokenize_shard`` as a
task of its own: on local processes (``data.workers``, all cores by default) or, with
``data.dask_address``, on that Dask cluster through Prefect's Dask task runner; either way each
is a task run in the Prefect UI, under ``prepare_data``.
Parameters, cache key, log lines and summary: ``titan_core.pipeline.stages.data``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.common import retry_transient
from tasks.runtime import load_secret, run_each, run_logger
from titan_core.data.prepare import PrepareSpec, Unit, prepare
from titan_core.data.shards import ShardInfo
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.stages.data import (
    PreparedData,
    credentials_once,
    log_plan,
    log_prepared,
    prepare_cache_key,
    prepared_summary,
    shard_run_label,
)

# Shard workers import this module to unpickle tokenize_shard: what the parent alone needs (run
# storage, which imports torch) is imported where it is used, so a worker starts in ~1 s, not ~5.


def _cache_key(context: Any, params: dict[str, Any]) -> str | None:
    """Prefect ``cache_key_fn``: the plan's key (None: not cached, the body raises the error)."""
    return prepare_cache_key(params, load_secret)


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
    unit: Unit, tokenize: Callable[[Unit], list[ShardInfo]], credentials_block: str = ""
) -> list[ShardInfo]:
    """Tokenize one source file (or Hugging Face shard) into its shards: ``tokenize`` is
    ``tokenize_unit`` with the plan's arguments, as ``prepare`` hands it to its ``map_fn``."""
    credentials_once(credentials_block, load_secret)
    shards = tokenize(unit)
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
    credentials_once(credentials_block, load_secret)
    logger = run_logger()

    def as_tasks(
        tokenize: Callable[[Unit], list[ShardInfo]], units: Sequence[Unit]
    ) -> list[list[ShardInfo]]:
        """``prepare``'s ``map_fn``: each unit a ``tokenize_shard`` task run."""
        calls = [
            {"unit": unit, "tokenize": tokenize, "credentials_block": credentials_block}
            for unit in units
        ]
        return run_each(tokenize_shard, calls, workers, dask_address)

    spec = PrepareSpec(
        sources=tuple(sources),
        text_field=text_field,
        validation_every=validation_every,
        tokenizer_path=tokenizer_path,
        root=root,
    )
    result = prepare(
        spec,
        workers=workers,
        map_fn=as_tasks,
        share_cores=not dask_address,  # a local unit gets the idle local cores' threads
        on_plan=functools.partial(log_plan, logger, dask_address),
    )
    prepared = prepared_summary(result)
    if not result.cached:
        log_prepared(logger, prepared)
    return prepared
