"""Where a run's things are: the run-root layout, run ids, and local roots made absolute.

Layout of one run (the output root ``job.dump_folder`` is a folder or ``s3://bucket/prefix``)::

    <root>/<experiment>/<run_id>/
      config.toml  tokenizer/  checkpoint/seed  checkpoint/step-N  hf/  eval/
      profile/  memory_snapshot/  metrics.jsonl  logs/

What the runs of one root share lives beside them: ``<root>/.prefect-results/`` (the results of
the cached stages) and ``<root>/data/`` (prepared datasets).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import dataclass

from titan_core import storage

SEED_DIR = "checkpoint/seed"
# The cached stages' results (Prefect's result storage): in the output root, beside what they
# point to, so that every way of starting a run (the CLI, a worker, a schedule) shares them.
RESULTS_DIR = ".prefect-results"
# new_run_id's form (a sweep's trials add -t<N>), as a flow run's first name carries it.
_RUN_ID_RE = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}(-t\d+)?")


@dataclass(frozen=True)
class RunPaths:
    """Every URL of one run, derived from the output root, experiment and run id."""

    root: str
    experiment: str
    run_id: str

    @property
    def results(self) -> str:
        """``<root>/.prefect-results``: the cache of the runs of this output root."""
        return storage.join(self.root, RESULTS_DIR)

    @property
    def run_root(self) -> str:
        """``<root>/<experiment>/<run_id>``."""
        return storage.join(self.root, self.experiment, self.run_id)

    def path(self, *parts: str) -> str:
        """A path inside the run root."""
        return storage.join(self.run_root, *parts)

    @property
    def config(self) -> str:
        """The resolved config the run trains with."""
        return self.path("config.toml")

    @property
    def checkpoint(self) -> str:
        """The checkpoint folder (seed/ and step-N/)."""
        return self.path("checkpoint")


def new_run_id() -> str:
    """A sortable, unique run id: ``YYYYmmdd-HHMMSS-xxxxxx``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def is_run_id(name: str) -> bool:
    """Whether ``name`` has the form of a ``new_run_id`` (or a sweep trial's ``<id>-t<N>``)."""
    return _RUN_ID_RE.fullmatch(name) is not None


def absolute(root: str) -> str:
    """A local root as an absolute path (URLs unchanged), so every process agrees on it."""
    return root if storage.is_url(root) else os.path.abspath(root.removeprefix("file://"))


def storage_identity(root: str) -> str:
    """The root plus the S3 endpoint it resolves to: cache keys must not cross servers."""
    if root.startswith("s3://"):
        return f"{root}@{os.environ.get('AWS_ENDPOINT_URL', 'aws')}"
    return absolute(root)


def same_location(a: str, b: str) -> bool:
    """Whether two paths/URLs name the same place (local paths compared absolutely)."""
    return absolute(a).rstrip("/") == absolute(b).rstrip("/")
