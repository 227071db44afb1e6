"""genlm's byte-level LM behind genlm-bytes' ``ByteBeamState.initial(llm, params, trie_opts=None)``.

genlm-control's ``ByteLLM`` builds its beam with genlm-bytes' ``ByteBeamState.initial`` and then uses
``prune``, ``<<``, ``logp_next``, ``logZ``, ``prefill`` and ``await cleanup()``, which genlm's beam has with the
same meaning. :func:`~genlm_compat.install` points genlm-bytes' names here, so that a wrapped model's
byte LM runs on genlm (float64 masses, one batched trie) instead of on genlm-bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from genlm_compat.lm import CompatLM
from genlm_core import AsyncLM
from genlm_core.bytes import BeamParams, ByteBeamState
from genlm_core.closing import CLOSED, Closed

PARAM_FIELDS = ("K", "prune_threshold", "verbose", "eos_byte_strings", "heal", "heal_max_backoff", "heal_max_splits")


def beam_params(params: Any) -> BeamParams:
    """genlm's :class:`BeamParams` from genlm-bytes' (same fields) or ours."""
    if isinstance(params, BeamParams):
        return params
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"params must be BeamParams, got {type(params).__name__}")
    return BeamParams(**{name: getattr(params, name) for name in PARAM_FIELDS})


class CompatByteBeamState(ByteBeamState):
    """genlm's :class:`ByteBeamState`, built from genlm-bytes' arguments: a wrapped model (or any genlm
    ``AsyncLM``) and genlm-bytes' ``BeamParams``. Every beam it leads to is of this class (``prune``,
    ``<<``, ``prefill``), and ``cleanup()`` does what genlm-bytes' does: it stops the byte trie's worker,
    and a later call on the beam starts it again (genlm's own beams refuse every call once closed)."""

    @classmethod
    async def initial(  # type: ignore[override]  # genlm-bytes' signature
        cls, llm: Any, params: Any, trie_opts: dict[str, Any] | None = None, **kwargs: Any
    ) -> ByteBeamState:
        lm = llm.genlm_lm if isinstance(llm, CompatLM) else llm
        if not isinstance(lm, AsyncLM):
            raise TypeError(f"genlm's byte LM needs a genlm model (genlm_compat.wrap(...)), got {type(llm).__name__}")
        return await super().initial(lm, beam_params(params), trie_opts, **kwargs)

    def cleanup(self) -> Closed:
        """Stop the byte trie's worker thread (genlm-bytes' ``await beam.cleanup()``); the beam stays usable."""
        if self.trie is not None:
            self.trie.release()
        return CLOSED
