"""Errors users can catch by name: `except ponytail.ConfigError`."""


class PonytailError(Exception):
    """Base class of every error Ponytail raises on purpose."""


class ConfigError(PonytailError, ValueError):
    """A configuration value is invalid or disagrees with the model.

    The message names the field, the value given and what is allowed or expected.
    """


class KernelError(PonytailError, RuntimeError):
    """A custom kernel could not be built or was handed arguments it cannot work on."""
