"""``Token``: the exact bytes of one vocabulary entry, carrying its id."""

from __future__ import annotations

from typing import Any


class Token(bytes):
    """The bytes of a vocabulary entry, with its ``token_id``.

    Equality and hashing contract: a Token compares and hashes exactly as its bytes; the id is
    carried along but ignored by ``==`` and ``hash``. So ``b in {tok}``, ``b in [tok]`` and
    ``b == tok`` always agree, and Tokens mix freely with plain ``bytes`` in sets and dicts.
    Two Tokens with the same bytes and different ids (duplicate vocabulary entries) are therefore
    equal; where identity matters, key on ``tok.token_id``.
    """

    token_id: int

    def __new__(cls, value: bytes, token_id: int) -> Token:
        self = super().__new__(cls, value)
        self.token_id = int(token_id)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Token, (bytes(self), self.token_id))

    def __repr__(self) -> str:
        return f"Token({bytes(self)!r}, token_id={self.token_id})"

    # bytes' own __eq__/__hash__ apply unchanged: that is the contract documented above.
    __eq__ = bytes.__eq__
    __hash__ = bytes.__hash__
