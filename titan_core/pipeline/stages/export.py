"""The pipeline's export stage without an orchestrator: the final DCP checkpoint as a Hugging
Face folder in the run root (``<run>/hf``), kept when a complete one is already there. Its MLflow
stage run (``convert``) has the metric ``export/num_shards`` and says where the export is (tag
``export/url``, and its description)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from titan_core import storage
from titan_core.config.job import JobConfig
from titan_core.pipeline.run.common import redact
from titan_core.pipeline.run.paths import absolute
from titan_core.pipeline.run.tracking import (
    NOTE_TAG,
    TrackingContext,
    client,
    log_metrics,
    log_stage_config,
    stage_run,
)

HF_DIR = "hf"


@dataclass(frozen=True)
class HfExport:
    """A Hugging Face export of a checkpoint."""

    url: str
    """The export's folder (path or URL)."""
    num_shards: int
    """Safetensors shards written; 0 when a complete export was kept."""
    kept: bool
    """Whether a complete export was already there (an earlier attempt's), left as it was."""


def is_exported(output: str) -> bool:
    """Whether ``output`` holds a complete export (its index file is published last)."""
    from titan_core.convert.dcp_to_hf import INDEX_FILE

    return storage.exists(storage.join(output, INDEX_FILE))


def export_checkpoint(
    checkpoint_url: str,
    job: JobConfig,
    output: str = "",
    tracking: TrackingContext | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> HfExport:
    """Export ``checkpoint_url`` (safetensors, config, tokenizer) to ``output`` (default
    ``<run>/hf``) as the config's ``[convert]`` section says, as a ``convert`` stage run; an
    existing complete export is kept. ``overrides`` (dotted keys) apply onto ``job``."""
    from titan_core.build import build_model_args
    from titan_core.config.job import parse_size
    from titan_core.config.schema import apply_values
    from titan_core.convert.dcp_to_hf import dcp_to_hf
    from titan_core.data import Tokenizer, default_tokenizer_path

    cfg = apply_values(job, overrides or {})
    output = output or storage.join(cfg.job.dump_folder, HF_DIR)
    if is_exported(output):
        return HfExport(output, 0, kept=True)
    storage.remove_tree(output)  # debris of an interrupted attempt (an export publishes whole)
    tokenizer_path = cfg.tokenizer.path or str(default_tokenizer_path())
    model_args = build_model_args(cfg, Tokenizer(tokenizer_path).n_words)
    with stage_run(tracking, "convert") as run_id:
        log_stage_config(tracking, run_id, cfg.job.dump_folder)  # the run's root: its config
        shards = dcp_to_hf(
            checkpoint_url,
            output,
            model_args=model_args,
            tokenizer_path=tokenizer_path,
            dtype=cfg.convert.dtype,
            max_shard_size=parse_size(cfg.convert.max_shard_size),
            progress=cfg.storage.progress,
            model_name=cfg.model.name,
        )
        log_metrics(tracking, run_id, {"export/num_shards": len(shards)})
        tag_export(tracking, run_id, output)
    return HfExport(output, len(shards), kept=False)


EXPORT_TAG = "export/url"  # the convert run's way to its export (MLflow shows it with the run)


def tag_export(tracking: TrackingContext | None, run_id: str, output: str) -> None:
    """Tag the convert stage run with where its export is (``export/url``, secrets redacted,
    a local path made absolute) and say so in its description."""
    if tracking is None or not run_id:
        return
    url = redact(output if storage.is_url(output) else absolute(output))
    mlflow_client = client(tracking.uri)
    mlflow_client.set_tag(run_id, EXPORT_TAG, url)
    mlflow_client.set_tag(run_id, NOTE_TAG, f"Hugging Face export: `{url}`")
