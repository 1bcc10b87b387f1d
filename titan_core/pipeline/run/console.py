"""What a person running a flow from the command line sees: one console format, the lines of
titan's stages without Prefect's and MLflow's boilerplate, and one line for a wrong input.

The console (``console_settings``, set by the ``titan`` commands that run flows) is configured
by each library's own settings: Prefect's logging config is titan's ``logging.yml`` (Prefect's
own, with one format: the engine's ``[titan] 10:01:09 INFO …``; the stages' lines at INFO, the
ranks' progress and every library's warnings on the console, while what Prefect's engine says
at INFO, the task states and the run's link, goes to the Prefect UI only); Prefect's telemetry
is off on the client too (``DO_NOT_TRACK``, which also keeps its first-run notice off the
console) and MLflow logs warnings only (``MLFLOW_LOGGING_LEVEL``: no "Creating initial MLflow
database tables"). The launch command is logged at DEBUG: ``VERBOSE_ENV=DEBUG`` (what ``titan
pipeline run -v`` sets, Prefect's override of one item of the logging config) shows it.

Prefect logs a failed task or flow run with its traceback, on the console and to the API. For a
user error (a ``TitanError``: bad config, unreachable storage or tracking server, missing data)
or a failed launch (``LaunchError``, already summarised in one line), the traceback says nothing
the one-line message does not: the console shows the message alone, and the CLI prints one
``error:`` line at the end. The Prefect UI's logs (the API handler) keep the whole traceback, and
any other exception keeps it everywhere. ``tasks.runtime.quiet_user_errors`` puts this formatter on
Prefect's console handlers.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from pathlib import Path

from titan_core.errors import TitanError

LOGGING_CONFIG = Path(__file__).with_name("logging.yml")
"""Prefect's logging config for the pipeline console (``PREFECT_LOGGING_SETTINGS_PATH``)."""
VERBOSE_ENV = "PREFECT_LOGGING_HANDLERS_TITAN_CONSOLE_LEVEL"
"""The level of the stages' console handler (``titan_console`` in ``logging.yml``): INFO, or
DEBUG for the launch command and the ranks' set-up lines too."""
ENGINE_LEVEL_ENV = "PREFECT_LOGGING_LOGGERS_TITAN_LEVEL"
"""The level of the engine's ``titan`` logger in this process: WARNING, or INFO."""
# A line a rank printed, as torchrun (and a replica group's tag) prefixed it: shown as it is.
_RANK_LINE = re.compile(r"\[(g\d+ )?rank\d+\]:")


def console_settings(verbose: bool = False) -> dict[str, str]:
    """The environment of a quiet console, each variable a setting of the library it quiets
    (a ``titan`` command sets those the user has not); ``verbose``: DEBUG lines of the stages
    and INFO lines of the engine too (``-v``)."""
    quiet = {
        "PREFECT_LOGGING_SETTINGS_PATH": str(LOGGING_CONFIG),
        "DO_NOT_TRACK": "1",  # Prefect's client telemetry off (analytics are off on the server)
        "MLFLOW_LOGGING_LEVEL": "WARNING",
    }
    return quiet | ({VERBOSE_ENV: "DEBUG", ENGINE_LEVEL_ENV: "INFO"} if verbose else {})


class ConsoleFormatter(logging.Formatter):
    """The console's one format, the engine's: ``[titan] 10:01:09 INFO message``. A line a
    rank printed (``[rank0]:[titan] 10:01:09 INFO step: …``, ``[g1 rank0]:…`` under replica
    groups) is already in it and is shown as the rank wrote it, single-spaced (the engine pads
    its step lines into columns, for a console of their own). Paths under the current folder
    are shown relative to it (``outputs/…``); the Prefect UI keeps every line as it was said."""

    def __init__(self) -> None:
        super().__init__("[titan] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The record's line (its traceback, if any, is added by ``format``)."""
        if _RANK_LINE.match(record.message):
            line = re.sub(r" {2,}", " ", record.message)
        else:
            line = super().formatMessage(record)
        return relative_paths(line)


def relative_paths(text: str) -> str:
    """``text`` with each path under the current folder relative to it, as a person there
    types it (``/work/proj/outputs/x`` -> ``outputs/x``; ``sqlite:////work/proj/m.db`` ->
    ``sqlite:///m.db``)."""
    here = os.getcwd() + os.sep
    if here == os.sep:
        return text
    return text.replace("file://" + here, "").replace(here, "")


def is_user_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a one-line user error or a summarised launch failure."""
    from titan_core.launch.failures import LaunchError

    return isinstance(exc, TitanError | LaunchError)


class OneLineUserErrors(logging.Formatter):
    """Wraps a console handler's formatter: records of user errors lose their traceback."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record``; a user error's traceback is left out (on a copy: the other
        handlers, the Prefect API's among them, still get the original record)."""
        if record.exc_info and is_user_error(record.exc_info[1]):
            record = copy.copy(record)
            record.exc_info, record.exc_text = None, None
        return self.inner.format(record)
