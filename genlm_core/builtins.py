"""genlm-core's own plugin: the built-in components, registered through the same hooks as any other."""

from __future__ import annotations

from genlm_core.config import MockOptions
from genlm_core.hookspecs import hookimpl
from genlm_core.registry import Register


@hookimpl
def register_trie_engines(register: Register) -> None:
    register.trie_engine(
        "numba",
        "genlm_core.trie:TokenCharacterTrie",
        aliases=("cpu", "sequential"),
        description="CPU engine: float64 bottom-up sums over a contiguous subtree numbering (numba).",
    )
    register.trie_engine(
        "torch",
        "genlm_core.trie:ParallelTokenCharacterTrie",
        aliases=("parallel",),
        description="torch engine on CPU or CUDA (device=...).",
    )


@hookimpl
def register_backends(register: Register) -> None:
    register.backend(
        "mock",
        "genlm_core.mock:MockAsyncLM.from_options",
        options=MockOptions,
        description="No model: deterministic random distributions over a real tokenizer's vocabulary.",
        resolve_name="genlm_core.hub:resolve_tokenizer",
        default_priority=None,  # its rows are random: used only when named
    )
