"""A language model over bytes, from any token-level AsyncLM (beam over tokenizations)."""

from genlm_core.bytes.beam import BeamParams, ByteBeamState
from genlm_core.bytes.heal import TokenHealer
from genlm_core.bytes.lm_state import StatefulTokenizedLM
from genlm_core.bytes.probs import EOS, EOT, Chart, LazyByteProbs
from genlm_core.bytes.trie import AsyncTokenByteTrie, TokenByteTrie, TrieMode
from genlm_core.bytes.trie_state import LazyTrieState

__all__ = [
    "EOS",
    "EOT",
    "AsyncTokenByteTrie",
    "BeamParams",
    "ByteBeamState",
    "Chart",
    "LazyByteProbs",
    "LazyTrieState",
    "StatefulTokenizedLM",
    "TokenByteTrie",
    "TokenHealer",
    "TrieMode",
]
