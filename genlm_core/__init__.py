"""genlm-core: async, autobatched language models for probabilistic programs, with backend plugins."""

from genlm_core.batching import AutoBatcher, ContentKey, Failed
from genlm_core.cache import OutputCache
from genlm_core.config import BackendOptions, ModelConfig
from genlm_core.context import Context
from genlm_core.errors import (
    BackendNotFoundError,
    BatcherError,
    ClosedError,
    ConfigError,
    GenlmError,
    MissingDependencyError,
    ModelNotFoundError,
    OptionsError,
    PluginConflictError,
    PluginError,
    VocabDecodingError,
)
from genlm_core.hookspecs import hookimpl
from genlm_core.lm import AsyncLM, LoRASelection, Request, RowsOut, logits_to_logprobs
from genlm_core.loading import default_backend, load_model, load_model_by_name
from genlm_core.plugins import get_plugins
from genlm_core.proposal import Proposal, masked_proposal
from genlm_core.registry import Register
from genlm_core.tokenization import Token, Tokenizer, decode_vocab, decode_vocabulary

__all__ = [
    "AsyncLM",
    "AutoBatcher",
    "BackendNotFoundError",
    "BackendOptions",
    "BatcherError",
    "ClosedError",
    "ConfigError",
    "ContentKey",
    "Context",
    "Failed",
    "GenlmError",
    "LoRASelection",
    "MissingDependencyError",
    "ModelConfig",
    "ModelNotFoundError",
    "OptionsError",
    "OutputCache",
    "PluginConflictError",
    "PluginError",
    "Proposal",
    "Register",
    "Request",
    "RowsOut",
    "Token",
    "Tokenizer",
    "VocabDecodingError",
    "decode_vocab",
    "decode_vocabulary",
    "default_backend",
    "get_plugins",
    "hookimpl",
    "load_model",
    "load_model_by_name",
    "logits_to_logprobs",
    "masked_proposal",
]
