"""Job configuration, the bottom layer: the schema (``job``), its keys and values (``schema``),
the command line (``argv``), TOML files (``toml``), ``--help`` (``help``) and the Prefect form
(``form``). Recipes and the resolver that layers them sit above the models
(``titan_core.models.registry``, ``titan_core.resolve``)."""

from titan_core.config.job import JobConfig

__all__ = ["JobConfig"]
