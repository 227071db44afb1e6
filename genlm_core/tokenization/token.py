"""``Token``: the exact bytes of one vocabulary entry, carrying its id."""

from __future__ import annotations

import operator
from typing import Any


class Token(bytes):
    """The bytes of vocabulary entry ``token_id``: ``Token(token_id, byte_string)``, as in genlm-backend.

    A Token *is* its bytes (``b"".join(tokens)``, ``len``, slicing and ``.decode()`` work), and it carries
    its id. Equality and hashing follow one contract that serves vocabularies with duplicate byte strings
    and code that looks tokens up by plain bytes alike:

    - ``hash(tok) == hash(bytes(tok))``: a Token hashes as its bytes.
    - ``Token == Token`` iff both the ids and the bytes are equal, so two entries with the same bytes and
      different ids are distinct in sets and dicts.
    - ``Token == bytes`` compares content, so ``b"ab" in {tok}``, ``b"ab" in [tok]`` and ``tok == b"ab"``
      agree.

    (genlm-backend hashes by id, so there ``b"ab" in {tok}`` is False while ``b"ab" == tok`` is True.)
    Ordering is the bytes' order.

    >>> a, b = Token(5, b"ab"), Token(9, b"ab")
    >>> a == b, a == b"ab", len({a, b}), b"ab" in {a}
    (False, True, 2, True)
    """

    token_id: int

    def __new__(cls, token_id: int, byte_string: bytes) -> Token:
        try:
            if isinstance(token_id, bool):
                raise TypeError
            token_id = operator.index(token_id)
        except TypeError:
            raise TypeError(f"Token: token_id must be an int, got {type(token_id).__name__}") from None
        if not isinstance(byte_string, bytes):
            raise TypeError(f"Token: byte_string must be bytes, got {type(byte_string).__name__}")
        self = super().__new__(cls, byte_string)
        self.token_id = int(token_id)
        return self

    @property
    def byte_string(self) -> bytes:
        """The token's bytes, as a plain ``bytes`` object."""
        return bytes(self)

    @staticmethod
    def as_bytes(x: bytes) -> bytes:
        """Plain bytes of ``x``: a Token's ``byte_string``, any other bytes unchanged."""
        return bytes(x) if isinstance(x, Token) else x

    @staticmethod
    def is_plain_bytes(x: object) -> bool:
        """Whether ``x`` is ``bytes`` and not a Token."""
        return isinstance(x, bytes) and not isinstance(x, Token)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id and bytes.__eq__(self, other)
        if isinstance(other, bytes | bytearray | memoryview):
            return bytes.__eq__(self, bytes(other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = bytes.__hash__

    def __reduce__(self) -> tuple[Any, ...]:
        return (Token, (self.token_id, bytes(self)))

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={bytes(self)!r})"
