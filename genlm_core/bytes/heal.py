"""``TokenHealer``: find another tokenization when no hypothesis can take the next byte.

A prompt that ends mid-token (``"Hello wor"``) leaves a narrow beam committed to a tokenization
that cannot continue with the next byte (``"l"``). Healing backs off inside the unfinished token:
commit a shorter token that is a prefix of it, replay the remaining bytes from the root (committing
more tokens where it gets stuck), then consume the byte.
"""

from __future__ import annotations

import logging
import math

from .trie_state import LazyTrieState

log = logging.getLogger(__name__)


class TokenHealer:
    """``max_backoff``: most bytes to back off (None: the whole unfinished token).
    ``max_splits``: most extra tokens committed while replaying (None: unlimited; 0: none)."""

    def __init__(self, max_backoff: int | None = None, max_splits: int | None = None):
        self.max_backoff = max_backoff
        self.max_splits = max_splits

    async def try_heal(self, state: LazyTrieState, next_byte: int) -> LazyTrieState | None:
        """A state that has consumed ``next_byte`` after re-tokenizing ``state``'s unfinished token, or None."""
        partial = state.partial
        trie = state.trie.trie
        mass = state._mass()
        # weight of the committed tokens alone: undo the factor of the unfinished token
        base = state.weight - (math.log(mass[state.node]) - math.log(mass[trie.root]))
        shortest = 0 if self.max_backoff is None else max(0, len(partial) - self.max_backoff)
        for k in range(len(partial), shortest - 1, -1):
            node = trie.node_of(partial[:k])
            if node is None:
                continue
            for leaf, token_id in trie.eot_edges(node):
                if mass[leaf] <= 0.0:
                    continue
                weight = base + math.log(mass[leaf]) - math.log(mass[trie.root])
                start = LazyTrieState(state.lm_state << token_id, state.trie, trie.root, weight, None, state.mode)
                healed = await self._replay(start, [*partial[k:], next_byte])
                if healed is not None:
                    log.debug("healed at k=%d: committed token %d, replayed %r", k, token_id, partial[k:])
                    return healed
        return None

    async def _replay(self, current: LazyTrieState, todo: list[int]) -> LazyTrieState | None:
        splits = 0
        await current.materialize()
        for b in todo:
            nxt = current << b
            if nxt is None:
                if self.max_splits is not None and splits >= self.max_splits:
                    return None
                splits += 1
                for extension in current.extend_all():
                    nxt = (await extension.materialize()) << b
                    if nxt is not None:
                        break
                if nxt is None:
                    return None
            current = nxt
        return current
