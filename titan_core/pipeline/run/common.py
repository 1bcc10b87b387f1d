"""What every pipeline stage shares: loading the run's config, secret redaction, logging.

Stage code logs to the logger its caller hands it (``Logger``: a Prefect task's run logger), else
to the ``titan`` logger (``titan_logger``); it never asks an orchestrator for one.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from titan_core.config.job import JobConfig

# Environment variables whose values must never reach a log, a param, a tag or an artifact.
SECRET_ENV_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
# token(?!s): a count of tokens (evaluate.max_new_tokens) is no secret; a token is.
_SECRET_KEY_RE = re.compile(r"secret|token(?!s)|password|passwd|credential|api_key", re.IGNORECASE)
_URL_USERINFO_RE = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
MASK = "***"
Logger = logging.Logger | logging.LoggerAdapter
"""Where stage code logs: the ``titan`` logger, or a Prefect run logger (an adapter)."""
_registered: set[str] = set()


def register_secret(value: str) -> None:
    """Treat ``value`` (e.g. read from a Secret block) as a secret from now on."""
    if value and len(value) >= 4:
        _registered.add(value)


def known_secrets() -> list[str]:
    """Secret values currently known: registered ones and the secret environment variables."""
    found = {os.environ.get(name, "") for name in SECRET_ENV_VARS} | _registered
    return sorted((s for s in found if len(s) >= 4), key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every known secret value and any URL password replaced by ``***``."""
    for secret in known_secrets():
        text = text.replace(secret, MASK)
    return _URL_USERINFO_RE.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)


def public_url(url: str) -> str:
    """``url`` without its user info (``https://user:pass@host`` -> ``https://host``): for links
    people open (the browser asks for credentials itself) and for what is shown or stored."""
    return _URL_USERINFO_RE.sub(lambda m: m.group("scheme"), url)


def mask_params(params: dict[str, Any]) -> dict[str, Any]:
    """Config params safe to record: secret-looking keys masked, values redacted."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = key.rsplit(".", 1)[-1]
        # *_block names a Prefect block (storage.credentials_block): a name, not a secret.
        if _SECRET_KEY_RE.search(name) and not name.endswith("_block") and value not in ("", None):
            out[key] = MASK
        else:
            out[key] = redact(value) if isinstance(value, str) else value
    return out


def load_config(config_url: str) -> JobConfig:
    """The resolved config a run saved (``<run>/config.toml``, a path or URL), validated."""
    from titan_core.resolve import parse_args

    return parse_args(["--job.config_file", config_url])


def titan_logger() -> logging.Logger:
    """The ``titan`` logger, set up: where stage code logs when its caller passes no logger
    (a Prefect task passes its run logger, ``tasks.runtime.run_logger``)."""
    from titan_core.logging import init_logger, logger

    init_logger()
    return logger


# A rank's line that is a warning or an error: titan's own level word, or Python's warnings
# (`…/x.py:12: UserWarning: …`).
_WARNING_LINE = re.compile(r"\bWARNING\b|\b[A-Z]\w*Warning: ")
_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b")
# titan's INFO lines on how the training goes: its steps (metrics, validation), the checkpoints
# it saves, the replica groups, its end. A rank's other INFO lines say how it set itself up
# (the model, what it loaded, the MFU peak, where metrics go).
_TITAN_INFO = re.compile(r"\[titan\] [\d:]+ INFO ")
_PROGRESS = re.compile(
    r"INFO (step: |Training steps |Saved checkpoint |Training done |stopped early "
    r"|fault tolerance: )"
)


def relay_line(logger: Any, line: str) -> None:
    """Log a line a rank printed at the level it reads as (warnings and errors stand out in
    the Prefect UI's log filter), secrets redacted. titan's INFO lines on how a rank set itself
    up go at DEBUG: the Prefect UI shows them, the pipeline console with ``-v``."""
    line = redact(line)
    if _ERROR_LINE.search(line):
        logger.error(line)
    elif _WARNING_LINE.search(line):
        logger.warning(line)
    elif _TITAN_INFO.search(line) and not _PROGRESS.search(line):
        logger.debug(line)
    else:
        logger.info(line)
