"""Decode a tokenizer's vocabulary into exact bytes, from the tokenizer object alone.

Supported: byte-level BPE (GPT-2, Llama-3, Mistral Tekken and other tiktoken-style tokenizers) and
SentencePiece-style vocabularies (``▁`` for spaces, ``<0xNN>`` byte-fallback pieces). Added and
special tokens decode to the UTF-8 bytes of their text. Every result is checked by a round trip
on a probe text; a tokenizer that cannot be decoded raises :class:`VocabDecodingError`.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, NamedTuple

from genlm_core.errors import VocabDecodingError
from genlm_core.tokenization.protocol import Tokenizer
from genlm_core.tokenization.token import Token

log = logging.getLogger(__name__)

#: Text used to check a decoded vocabulary by round trip: spaces, newlines, accents, CJK, emoji.
PROBE_TEXT = "Hello, world!  It's 2024:\n\tcafé — naïve 你好 🎉 x²\n\n  end."
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


class Vocabulary(NamedTuple):
    """A decoded vocabulary: one entry per id in ``range(len(byte_vocab))``."""

    byte_vocab: list[Token]
    str_vocab: list[str]
    #: Ids below ``len(byte_vocab)`` that no token of the tokenizer has (they get -inf logprob).
    missing_ids: list[int]


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_types(backend: Any) -> set[str]:
    """The decoder's step types; a ``Replace`` of ``▁`` by a space is reported as ``Replace▁``."""
    decoder = backend.decoder
    if decoder is None:
        return set()
    stack, types = [json.loads(decoder.__getstate__())], set()
    while stack:
        node = stack.pop()
        kind = node.get("type", "")
        if kind == "Replace" and node.get("pattern", {}).get("String") == _SPIECE_SPACE and node.get("content") == " ":
            kind = "Replace▁"
        types.add(kind)
        stack.extend(node.get("decoders", []))
    return types


def _backend(tokenizer: Any) -> Any:
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "decoder") and hasattr(tokenizer, "to_str"):
        return tokenizer  # a bare tokenizers.Tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise VocabDecodingError(
            f"{type(tokenizer).__name__}: no `tokenizers` backend (backend_tokenizer) to read the vocabulary "
            "from; load the fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))"
        )
    return backend


#: How ``str_vocab`` writes a token whose bytes are not valid UTF-8 (genlm-backend's choices).
BYTE2STR_FALLBACKS = ("tokenizer", "latin1", "replace")


def decode_vocabulary(tokenizer: Tokenizer, *, check: bool = True, byte2str_fallback: str = "tokenizer") -> Vocabulary:
    """Decode every token id of ``tokenizer`` to its exact bytes (see module docstring).

    ``check`` runs a round trip on :data:`PROBE_TEXT` and raises if the bytes do not reproduce it.
    ``byte2str_fallback`` says how ``str_vocab`` writes tokens whose bytes are not valid UTF-8:
    ``"tokenizer"`` (the tokenizer's own piece, e.g. GPT-2's ``"Ã"``; the default, as in genlm-backend),
    ``"latin1"`` (the bytes read as Latin-1) or ``"replace"`` (``"\ufffd"`` for each bad sequence).
    """
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise ValueError(f"byte2str_fallback must be one of {BYTE2STR_FALLBACKS}, got {byte2str_fallback!r}")
    name = type(tokenizer).__name__
    backend = _backend(tokenizer)
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    added: dict[int, Any] = backend.get_added_tokens_decoder()
    size = max(len(tokenizer) if hasattr(tokenizer, "__len__") else 0, max(vocab.values(), default=-1) + 1)
    pieces: list[str | None] = [None] * size
    for text, i in vocab.items():
        pieces[i] = text
    types = _decoder_types(backend)

    if "ByteLevel" in types:
        table = {ord(c): chr(b) for c, b in byte_level_alphabet().items()}

        def to_bytes(piece: str) -> bytes:
            return piece.translate(table).encode("latin-1")

        alphabet = set(byte_level_alphabet())
        regular = "".join(p for i, p in enumerate(pieces) if p is not None and i not in added)
        stray = set(regular) - alphabet
        if stray:
            raise VocabDecodingError(
                f"{name}: byte-level decoder, but tokens use characters outside the byte alphabet: "
                f"{sorted(stray)[:10]!r}"
            )
    elif {"ByteFallback", "Metaspace", "Replace▁"} & types:
        byte_fallback = "ByteFallback" in types

        def to_bytes(piece: str) -> bytes:
            if byte_fallback and (m := _BYTE_FALLBACK.match(piece)):
                return bytes([int(m.group(1), 16)])
            return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")
    else:
        raise VocabDecodingError(
            f"{name}: cannot decode a vocabulary with decoder steps {sorted(types) or 'None'}; "
            "supported are byte-level BPE (ByteLevel) and SentencePiece-style "
            "(Metaspace / Replace '▁' / ByteFallback) tokenizers"
        )

    byte_vocab: list[Token] = []
    missing: list[int] = []
    for i, piece in enumerate(pieces):
        if piece is None:
            missing.append(i)
            byte_vocab.append(Token(i, b""))
        elif i in added:
            byte_vocab.append(Token(i, added[i].content.encode("utf-8")))
        else:
            byte_vocab.append(Token(i, to_bytes(piece)))
    if missing:
        log.warning("%s: %d ids below %d have no token; they get -inf logprob", name, len(missing), size)
    str_vocab = [_to_str(t, pieces[i], byte2str_fallback) for i, t in enumerate(byte_vocab)]
    if check:
        _check_round_trip(tokenizer, name, byte_vocab)
    return Vocabulary(byte_vocab, str_vocab, missing)


def _to_str(token: bytes, piece: str | None, fallback: str) -> str:
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        if fallback == "latin1":
            return token.decode("latin-1")
        if fallback == "tokenizer" and piece is not None:
            return piece
        return token.decode("utf-8", errors="replace")


def decode_vocab(
    tokenizer: Tokenizer, byte2str_fallback: str = "tokenizer", *, check: bool = True
) -> tuple[list[Token], list[str]]:
    """``(byte_vocab, str_vocab)`` of ``tokenizer``: ``byte_vocab[i]`` is the exact bytes of id ``i``;
    ``str_vocab[i]`` its text (``byte2str_fallback``: see :func:`decode_vocabulary`).

    >>> from genlm_core.testing.tokenizers import toy_tokenizer
    >>> tok = toy_tokenizer()
    >>> byte_vocab, str_vocab = decode_vocab(tok)
    >>> ids = tok.encode("the abc")
    >>> byte_vocab[ids[0]], byte_vocab[ids[1]]
    (Token(token_id=258, byte_string=b'the'), Token(token_id=259, byte_string=b' a'))
    >>> byte_vocab[tok.eos_token_id], str_vocab[257]
    (Token(token_id=0, byte_string=b'<eos>'), 'th')
    """
    vocab = decode_vocabulary(tokenizer, check=check, byte2str_fallback=byte2str_fallback)
    return vocab.byte_vocab, vocab.str_vocab


def encode_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, for transformers and bare tokenizers alike."""
    if hasattr(tokenizer, "backend_tokenizer") or not hasattr(tokenizer, "to_str"):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _check_round_trip(tokenizer: Tokenizer, name: str, byte_vocab: list[Token]) -> None:
    expected = PROBE_TEXT.encode("utf-8")
    ids = encode_ids(tokenizer, PROBE_TEXT)
    got = b"".join(byte_vocab[i] for i in ids)
    # SentencePiece tokenizers that add a dummy-prefix "▁" produce one extra leading space: that
    # space is the true byte content of their first token.
    if got not in (expected, b" " + expected):
        raise VocabDecodingError(
            f"{name}: decoded vocabulary fails the round trip: encoding {PROBE_TEXT!r} and joining the "
            f"token bytes gave {got!r}"
        )
