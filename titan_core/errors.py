"""User-facing error types: caught at entry points and printed as one line, exit code 2
(``CommError``: 3, so that launchers relaunch it rather than treat it as bad input)."""


class TitanError(ValueError):
    """A problem with the user's input (config, files, data); printed as one line."""

    exit_code = 2


class ConfigError(TitanError):
    """Invalid configuration: the message names the key path and what was expected."""


class DataError(TitanError):
    """Missing, empty or unreadable dataset or tokenizer file."""


class CheckpointError(TitanError):
    """Missing, incomplete or incompatible checkpoint."""


class CommError(TitanError):
    """A collective failed or timed out (a dead or stuck peer): worth a relaunch."""

    exit_code = 3
