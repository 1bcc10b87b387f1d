"""User-facing error types: caught at entry points and printed as one line, exit code 2."""


class TitanError(ValueError):
    """A problem with the user's input (config, files, data); printed as one line."""


class ConfigError(TitanError):
    """Invalid configuration: the message names the key path and what was expected."""


class DataError(TitanError):
    """Missing, empty or unreadable dataset or tokenizer file."""


class CheckpointError(TitanError):
    """Missing, incomplete or incompatible checkpoint."""
