"""Exceptions raised by genlm, each saying what went wrong and what to do."""

from __future__ import annotations


class GenlmError(Exception):
    """Base class of every genlm error."""


class BackendNotFoundError(GenlmError, LookupError):
    """A backend or trie engine was asked for by a name no installed plugin provides."""


class PluginConflictError(GenlmError):
    """Two plugins registered the same name."""


class OptionsError(GenlmError, ValueError):
    """Backend options failed validation (unknown option, wrong type)."""


class VocabDecodingError(GenlmError, ValueError):
    """A tokenizer's vocabulary could not be decoded to exact bytes."""
