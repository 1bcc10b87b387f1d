"""A run's stored ``config.toml`` as what it is everywhere else: MLflow params, key for key.

Preflight stores the resolved config (``titan_core.build.resolve_auto``); the train stage records
the seed checkpoint in it (``record_seed``) and then logs ``config_params`` to the pipeline run and
its train stage run. The ranks load that file and save it back unchanged.
"""

from __future__ import annotations

import tomllib
from typing import Any

import tomli_w

from titan_core import storage
from titan_core.config.schema import flatten_tables


def config_params(config_url: str) -> dict[str, Any]:
    """The stored config as flat params: ``section.field`` (``section.sub.field`` in nested
    sections) -> value, lists as JSON, as ``titan_core.config.schema.flatten``."""
    return flatten_tables(tomllib.loads(storage.read_text(config_url)))


def record_seed(config_url: str, seed_url: str) -> None:
    """Store the seed checkpoint in the run's config as ``checkpoint.initial_load_path``, so the
    stored config (and the run's params) say what the ranks load, as their own save will."""
    table = tomllib.loads(storage.read_text(config_url))
    if table["checkpoint"].get("initial_load_path") != seed_url:
        table["checkpoint"]["initial_load_path"] = seed_url
        storage.write_text(config_url, tomli_w.dumps(table))
