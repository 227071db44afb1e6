"""Exceptions raised by genlm, each saying what went wrong and what to do."""

from __future__ import annotations


class GenlmError(Exception):
    """Base class of every genlm error."""


class BackendNotFoundError(GenlmError, LookupError, ValueError):
    """A backend or trie engine was asked for by a name no installed plugin provides (also a
    ``ValueError``, what genlm-backend raises for an unknown backend)."""


class PluginConflictError(GenlmError):
    """Two plugins registered the same name."""


class PluginError(GenlmError):
    """A plugin is broken: a hook that matches no spec or has a bad signature, a name already taken,
    or a factory that does not resolve. Discovery records these as failures instead of raising."""


class OptionsError(GenlmError, ValueError):
    """Backend options failed validation (unknown option, wrong type). ``problems``: one phrase per bad
    option (its dotted path, the problem, the value), so that an error inside a nested model is
    reported once, under the outer option's path."""

    def __init__(self, message: str, problems: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.problems = list(problems)


class VocabDecodingError(GenlmError, ValueError):
    """A tokenizer's vocabulary could not be decoded to exact bytes."""


class ConfigError(GenlmError, ValueError):
    """A model config (a dict, a ``ModelConfig`` or a TOML/JSON file) is missing, unreadable or invalid."""


class ClosedError(GenlmError, RuntimeError):
    """A language model, trie or byte beam was used after ``cleanup()`` closed it.

    Every call on a closed object raises this (``cleanup()`` itself may be called again safely);
    requests still queued when it was closed fail with it too.
    """


class BatcherError(GenlmError, RuntimeError):
    """An AutoBatcher's worker stopped on an unexpected error; the error is the ``__cause__``.

    Every request waiting at that moment fails with it, and so does the next submit, once; the
    submit after that starts a fresh worker.
    """


class MissingDependencyError(GenlmError, ImportError):
    """A feature needs a package that is not installed; the message gives the pip command."""


class ModelNotFoundError(GenlmError, OSError):
    """A model name is neither a local path, nor a model genlm builds offline, nor in the Hugging Face
    cache, nor (when the hub can be reached) on the hub. An ``OSError``, as transformers' own."""
