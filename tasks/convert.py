"""``convert_to_hf``: the final DCP checkpoint as a Hugging Face folder in the run root."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.common import load_config, redact, retry_transient, run_logger
from tasks.tracking import TrackingContext, log_metrics, stage_run
from titan_core import storage

HF_DIR = "hf"


def is_exported(output: str) -> bool:
    """Whether ``output`` holds a complete export (its index file is published last)."""
    from titan_core.convert.dcp_to_hf import INDEX_FILE

    return storage.exists(storage.join(output, INDEX_FILE))


@task(
    name="convert_to_hf",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[2, 8],
    retry_condition_fn=retry_transient,
)
def convert_to_hf(
    checkpoint_url: str,
    config_url: str,
    output: str = "",
    dtype: str = "bfloat16",
    tracking: TrackingContext | None = None,
) -> str:
    """Export ``checkpoint_url`` (safetensors, config, tokenizer) to ``output`` (default
    ``<run>/hf``); returns the folder's URL. An existing complete export is kept."""
    from titan_core.build import build_model_args
    from titan_core.convert.dcp_to_hf import dcp_to_hf
    from titan_core.data import Tokenizer, default_tokenizer_path

    cfg = load_config(config_url)
    output = output or storage.join(cfg.job.dump_folder, HF_DIR)
    logger = run_logger()
    if is_exported(output):
        logger.info("Hugging Face export already complete at %s", redact(output))
        return output
    storage.remove_tree(output)  # debris of an interrupted attempt (an export publishes whole)
    tokenizer_path = cfg.tokenizer.path or str(default_tokenizer_path())
    model_args = build_model_args(cfg, Tokenizer(tokenizer_path).n_words)
    with stage_run(tracking, "convert") as run_id:
        shards = dcp_to_hf(
            checkpoint_url,
            output,
            model_args=model_args,
            tokenizer_path=tokenizer_path,
            dtype=dtype,
            progress=cfg.storage.progress,
            model_name=cfg.model.name,
        )
        log_metrics(tracking, run_id, {"num_shards": len(shards)})
    logger.info(
        "Exported %s to %s (%d shards)", redact(checkpoint_url), redact(output), len(shards)
    )
    return output
