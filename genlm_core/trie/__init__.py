"""Token-character tries: masses of every byte prefix from a distribution over tokens."""

from genlm_core.trie.async_trie import AsyncTokenCharacterTrie
from genlm_core.trie.base import TrieBase
from genlm_core.trie.cpu import TokenCharacterTrie
from genlm_core.trie.index import END, TrieIndex
from genlm_core.trie.parallel import ParallelTokenCharacterTrie

__all__ = [
    "END",
    "AsyncTokenCharacterTrie",
    "ParallelTokenCharacterTrie",
    "TokenCharacterTrie",
    "TrieBase",
    "TrieIndex",
]
