"""``StatefulTokenizedLM``: an immutable token context over an AsyncLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genlm_core.context import Context
from genlm_core.lm import AsyncLM
from genlm_core.validation import check_int


def default_initial_context(lm: AsyncLM) -> list[int]:
    """What the tokenizer itself puts before text (e.g. ``[BOS]``); else BOS; else EOS.

    Tokenizers without a BOS token (Qwen-style) are never given ``None``; one with neither BOS,
    EOS nor a prefix of its own needs an explicit ``initial_context``.
    """
    tok = lm.tokenizer
    try:
        prefix = list(tok.encode("", add_special_tokens=True))
    except Exception:  # tokenizers without that call
        prefix = []
    if prefix:
        return prefix
    for attr in ("bos_token_id", "eos_token_id"):
        token_id = getattr(tok, attr, None)
        if token_id is not None:
            return [int(token_id)]
    raise ValueError(
        f"{type(tok).__name__} has no BOS or EOS token to start a context with; pass initial_context=[...]"
    )


class StatefulTokenizedLM:
    """A token context and the model that continues it; ``state << token`` returns a new state.

    The context is a :class:`~genlm_core.context.Context` handle of the model: a state extends its
    parent's in O(1), and its request reads none of its ids again. ``max_context_length`` (kept by
    every derived state) caps the context: the oldest tokens are dropped first.
    """

    __slots__ = ("context", "max_context_length", "model", "n_calls")

    def __init__(
        self,
        model: AsyncLM,
        context: Sequence[int] | Context,
        max_context_length: int | None = None,
        n_calls: int = 0,
    ):
        if max_context_length is not None:
            max_context_length = check_int(max_context_length, "max_context_length", 1)
        self.model = model
        if max_context_length is not None and len(context) > max_context_length:
            context = context[len(context) - max_context_length :]
        self.context: Context = model.context(context)
        self.max_context_length = max_context_length
        self.n_calls = n_calls

    @classmethod
    def initial(
        cls, model: AsyncLM, initial_context: Sequence[int] | None = None, max_context_length: int | None = None
    ) -> StatefulTokenizedLM:
        """The starting state: ``initial_context``, or :func:`default_initial_context`."""
        context = list(initial_context) if initial_context is not None else default_initial_context(model)
        return cls(model, context, max_context_length)

    def __lshift__(self, token: int) -> StatefulTokenizedLM:
        if type(token) is not int:
            token = check_int(token, "token")
        return StatefulTokenizedLM(self.model, self.context.extend(token), self.max_context_length, self.n_calls)

    async def logp_next(self) -> torch.Tensor:
        """Next-token log-probabilities after the context (batched with concurrent calls)."""
        self.n_calls += 1
        return await self.model.next_token_logprobs(self.context)

    def __repr__(self) -> str:
        vocab: Any = self.model.byte_vocab
        return "|".join(repr(bytes(vocab[i]))[2:-1] for i in self.context)
