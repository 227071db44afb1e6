"""``Tokenizer``: what genlm needs of a tokenizer (a Hugging Face fast tokenizer has all of it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """A tokenizer as genlm uses it. Vocabulary decoding also reads the ``tokenizers`` backend
    (``backend_tokenizer``) of a fast tokenizer; see :func:`genlm_core.decode_vocab`."""

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token id, or None."""

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token id, or None."""

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        """Token ids of ``text`` (``add_special_tokens=`` is passed as a keyword)."""

    def decode(self, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        """Text of ``token_ids`` (a ``str`` for one sequence)."""

    def __len__(self) -> int:
        """The number of token ids, special tokens included."""
