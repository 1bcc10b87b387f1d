"""``download_tokenizer``: the tokenizer a run trains with, stored in the run root once per source
(``titan_core.pipeline.stages.tokenizer`` does the work)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from tasks.common import retry_transient
from tasks.runtime import run_logger
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.stages.tokenizer import store_tokenizer, tokenizer_cache_key


def _cache_key(context: Any, params: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn``: by source and output root."""
    return tokenizer_cache_key(params["source"], params["root"])


@task(
    name="download_tokenizer",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=retry_transient,
)
def download_tokenizer(
    source: str, dest: str, root: str, attempts: int = 4, progress: bool = True
) -> str:
    """Fetch the tokenizer ``source`` and store it under ``dest``; returns the stored file's URL.

    Cached by (source, output ``root``, the runs' shared root): ``dest`` may differ between
    runs that share the result.
    """
    logger = run_logger()
    stored = store_tokenizer(source, dest, attempts=attempts, progress=progress, logger=logger)
    logger.info("Tokenizer %s (%d tokens) stored at %s", source, stored.n_words, redact(stored.url))
    return stored.url
