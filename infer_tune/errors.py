"""Errors that end a command with one clear line and exit code 2 (no traceback unless --debug)."""


class InferTuneError(Exception):
    """Bad input or an unusable environment: the message says what, where, and what to do."""

    exit_code = 2


class ModelError(InferTuneError):
    """A model reference that cannot be resolved or loaded."""


class SuiteError(InferTuneError):
    """A prompt suite that cannot be loaded."""


class ConfigError(InferTuneError):
    """A technique config or recipe with an invalid field."""


class ResultError(InferTuneError):
    """A result file that is missing, corrupt, or of an unknown schema."""
