"""``LazyTrieState``: one hypothesis of the beam — a token context plus a position inside the next token."""

from __future__ import annotations

import math

import numpy as np

from genlm_core.closing import CLOSED, Closed

from .lm_state import StatefulTokenizedLM
from .probs import EOS, EOT, LazyByteProbs, check_symbol
from .trie import AsyncTokenByteTrie, Masses, TrieMode


class LazyTrieState:
    """Committed tokens (``lm_state``), the trie ``node`` reached by the bytes of the unfinished
    token, and ``weight``: the log-probability of the committed tokens times the probability that
    the next token starts with ``partial``. ``masses`` (node masses under the next-token
    distribution, in probability space, float64) are computed by :meth:`materialize`, once;
    ``mass`` is genlm-bytes' view of them, the array of every node's log-mass.
    """

    __slots__ = ("_extensions", "_log_mass", "lm_state", "masses", "mode", "node", "terminated", "trie", "weight")

    def __init__(
        self,
        lm_state: StatefulTokenizedLM,
        trie: AsyncTokenByteTrie,
        node: int,
        weight: float,
        masses: Masses | None = None,
        mode: TrieMode = TrieMode.WITH_EOS,
        terminated: bool = False,
    ):
        self.lm_state = lm_state
        self.trie = trie
        self.node = node
        self.weight = weight
        self.masses = masses
        self.mode = mode
        self.terminated = terminated
        self._extensions: list[LazyTrieState] | None = None
        self._log_mass: np.ndarray | None = None

    @classmethod
    def initial(
        cls,
        lm: object,
        trie: AsyncTokenByteTrie,
        mode: TrieMode = TrieMode.WITH_EOS,
        initial_context: list[int] | None = None,
        max_context_length: int | None = None,
    ) -> LazyTrieState:
        """At the root, weight 0, after ``initial_context`` (default: the tokenizer's own prefix)."""
        lm_state = StatefulTokenizedLM.initial(lm, initial_context, max_context_length)  # type: ignore[arg-type]
        return cls(lm_state, trie, trie.trie.root, 0.0, mode=mode)

    @property
    def partial(self) -> bytes:
        """The bytes of the unfinished token."""
        return self.trie.trie.node2prefix[self.node] if self.node != self.trie.trie.eos_node else b""

    def _mass(self) -> Masses:
        if self.masses is None:
            raise ValueError("state is not yet materialized: await state.materialize()")
        return self.masses

    @property
    def mass(self) -> np.ndarray:
        """Log-mass of every trie node under the next-token distribution (genlm-bytes' ``mass``;
        the EOS node last). ValueError before :meth:`materialize`."""
        if self._log_mass is None:
            self._log_mass = self._mass().log_all()
        return self._log_mass

    async def materialize(self) -> LazyTrieState:
        """Compute the node masses of the next-token distribution (one LM call, one trie sum)."""
        if self.masses is None:
            logprobs = await self.lm_state.logp_next()
            # exp in float64: the float32 row is the exact input; rounding its exponentials to float32
            # would cost ~1e-7 of log Z per step
            self.masses = self.trie.trie.masses(logprobs, self.mode, log=True)
        return self

    def cleanup(self) -> Closed:
        """Close the byte trie this state uses (as genlm-bytes' ``await state.cleanup()``); see
        :meth:`ByteBeamState.close <genlm_core.bytes.ByteBeamState.close>`."""
        self.trie.close()
        return CLOSED

    def with_mode(self, mode: TrieMode) -> LazyTrieState:
        """The same hypothesis under another EOS mode (masses are recomputed lazily if needed)."""
        if mode is self.mode:
            return self
        return LazyTrieState(self.lm_state, self.trie, self.node, self.weight, None, mode, self.terminated)

    def __lshift__(self, b: int) -> LazyTrieState | None:
        """Consume byte ``b`` (or EOS, 257) inside the current token; None if impossible."""
        b = check_symbol(b)
        if self.terminated:
            return None
        trie = self.trie.trie
        mass = self._mass()
        if b == EOS:
            if self.node != trie.root or self.mode is not TrieMode.WITH_EOS or mass.eos <= 0.0:
                return None
            weight = self.weight + math.log(mass.eos) - math.log(mass[self.node])
            return LazyTrieState(self.lm_state, self.trie, trie.eos_node, weight, mass, self.mode, True)
        child = trie.children(self.node).get(b)
        if child is None:
            return None
        child_mass = mass[child]
        if child_mass <= 0.0:
            return None
        weight = self.weight + math.log(child_mass) - math.log(mass[self.node])
        return LazyTrieState(self.lm_state, self.trie, child, weight, mass, self.mode)

    def extend_all(self) -> list[LazyTrieState]:
        """Commit the unfinished token: one new state at the root per token with exactly these bytes
        (duplicate tokens give several). Not yet materialized."""
        if self._extensions is None:
            mass = self._mass()
            log_here = math.log(mass[self.node])
            self._extensions = [
                LazyTrieState(
                    self.lm_state << token_id,
                    self.trie,
                    self.trie.trie.root,
                    self.weight + math.log(mass[leaf]) - log_here,
                    None,
                    self.mode,
                )
                for leaf, token_id in self.trie.trie.eot_edges(self.node)
                if mass[leaf] > 0.0
            ]
        return self._extensions

    @property
    def logp_next(self) -> LazyByteProbs:
        """Next-symbol log-probabilities from this state alone: bytes, EOT (index 256), EOS."""
        if self.terminated:
            return LazyByteProbs(np.full(258, -np.inf))
        return LazyByteProbs(self.trie.trie.logp_next(self.node, self._mass(), self.mode))

    def __repr__(self) -> str:
        tail = "<EOS>" if self.terminated else repr(self.partial)
        return f"{self.weight:.3f}: {self.lm_state!r} + {tail}"


__all__ = ["EOS", "EOT", "LazyTrieState"]
