"""Tokenizers for tests: the built-in real ones (from :mod:`genlm_core.assets`) and a tiny in-memory one.

The real tokenizers are runtime assets (the ``mock`` backend uses them); they are re-exported here under
the names tests have always imported.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from genlm_core.assets import (
    DOWNLOAD_SIZES,
    GPT2_PATTERN,
    MISTRAL_COMMON,
    SMOLLM2,
    TEKKEN_SPECIALS,
    TOKENIZERS,
    WHISPER,
    byte_level_bpe,
    cache_dir,
    load_tokenizer,
    package_file,
    read_rank_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@functools.cache
def toy_tokenizer() -> PreTrainedTokenizerBase:
    """A tiny byte-level BPE tokenizer built in memory: ``<eos>`` (id 0), the 256 bytes, a few merges.

    Duplicate-free, instant to build, and real: a ``transformers`` fast tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from genlm_core.tokenization.vocab import byte_level_alphabet

    alphabet = sorted(byte_level_alphabet().items(), key=lambda kv: kv[1])
    vocab = {"<eos>": 0}
    for char, _ in alphabet:
        vocab[char] = len(vocab)
    merges = [("t", "h"), ("th", "e"), ("Ġ", "a"), ("a", "b"), ("ab", "c"), ("Ġ", "the"), ("Ġ", "ab")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", bos_token="<eos>")


__all__ = [
    "DOWNLOAD_SIZES",
    "GPT2_PATTERN",
    "MISTRAL_COMMON",
    "SMOLLM2",
    "TEKKEN_SPECIALS",
    "TOKENIZERS",
    "WHISPER",
    "byte_level_bpe",
    "cache_dir",
    "load_tokenizer",
    "package_file",
    "read_rank_file",
    "toy_tokenizer",
]
