"""``convert``: a DCP checkpoint of a run to a Hugging Face folder, as a flow of its own."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.convert import convert_to_hf
from titan_core import storage
from titan_core.pipeline.run.paths import absolute


def run_config_url(checkpoint: str) -> str:
    """``<run>/config.toml`` for a step directory ``<run>/checkpoint/step-N``."""
    from titan_core.evaluate import resolve_checkpoint

    return storage.join(resolve_checkpoint(checkpoint).run_root, "config.toml")


@flow(name="convert")
def convert(
    checkpoint: str,
    output: str = "",
    config_file: str = "",
    overrides: dict[str, Any] | None = None,
) -> str:
    """Export ``checkpoint`` (a step dir, or a run's checkpoint folder = its newest step) to
    ``output`` (default ``<run>/hf``) as the job config's ``[convert]`` section says; the config
    defaults to the run's ``config.toml``, ``overrides`` (dotted keys, e.g.
    ``{"convert.dtype": "float32"}``) apply on top. Returns the export's URL."""
    from titan_core.evaluate import resolve_checkpoint
    from titan_core.resolve import resolve_job

    step_dir = resolve_checkpoint(checkpoint).step_dir
    job = resolve_job("", config_file or run_config_url(step_dir))
    return convert_to_hf(
        step_dir, job, output=absolute(output) if output else "", overrides=overrides
    )
