"""Errors users can catch by name: `except ponytail.ConfigError`."""


class PonytailError(Exception):
    """Base class of every error Ponytail raises on purpose."""


class ConfigError(PonytailError, ValueError):
    """A configuration value is invalid or disagrees with the model.

    The message names the field, the value given and what is allowed or expected.
    """


class ContextLengthError(ConfigError):
    """A request's prompt plus max_tokens does not fit the model's context (max_model_len)."""

    def __init__(self, message: str, prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(message, prompt_tokens, max_tokens, max_model_len)  # all in args: pickles across Ray
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    def __str__(self) -> str:
        return self.args[0]

    @property
    def too_many_tokens(self) -> str:
        """Which part alone is over the context: "prompt" or "max_tokens" (or "prompt" when only the sum is)."""
        return "max_tokens" if self.max_tokens >= self.max_model_len > self.prompt_tokens else "prompt"


class KernelError(PonytailError, RuntimeError):
    """A custom kernel could not be built or was handed arguments it cannot work on."""


class EngineDeadError(PonytailError, RuntimeError):
    """The engine's process (ProcessAsyncLLM) exited: its requests failed and it takes no more."""
