"""Exact byte views of tokenizer vocabularies."""

from genlm_core.tokenization.protocol import Tokenizer
from genlm_core.tokenization.token import Token
from genlm_core.tokenization.vocab import Vocabulary, decode_vocab, decode_vocabulary, encode_ids

__all__ = ["Token", "Tokenizer", "Vocabulary", "decode_vocab", "decode_vocabulary", "encode_ids"]
