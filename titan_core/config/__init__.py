"""Job configuration: the schema (``job``) and how CLI/TOML/registry resolve into it."""

from titan_core.config.job import JobConfig

__all__ = ["JobConfig"]
