"""``Closed``: what ``cleanup()`` returns, so that both ``obj.cleanup()`` and ``await obj.cleanup()`` work."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any


class Closed:
    """The result of a ``cleanup()`` that has already closed its object.

    genlm-backend and genlm-bytes made some ``cleanup`` methods coroutines and their users write
    ``await trie.cleanup()``; other code calls ``cleanup()`` without awaiting. Closing is synchronous
    here, so ``cleanup()`` closes at once and returns this: awaiting it does nothing more, and not
    awaiting it leaves no "never awaited" warning.
    """

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return
        yield  # makes this a generator: awaiting finishes at once

    def __repr__(self) -> str:
        return "Closed()"


#: The one instance every ``cleanup()`` returns.
CLOSED = Closed()
