"""What a person running a flow from the command line sees when the input is wrong.

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

from titan_core.errors import TitanError


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
