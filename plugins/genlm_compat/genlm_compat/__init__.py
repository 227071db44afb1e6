"""Run programs written for genlm-backend and genlm-bytes (genlm-control, llamppl) on genlm.

``wrap(lm)`` gives any genlm ``AsyncLM`` genlm-backend's interface; ``install()`` makes genlm-backend's
loaders build genlm models (``uninstall()`` restores it).
"""

from genlm_compat import seed as _seed  # noqa: F401  # first: imports genlm-backend without its side effects
from genlm_compat.bytes import CompatByteBeamState
from genlm_compat.install import install, installed, load, uninstall
from genlm_compat.lm import CompatLM, wrap
from genlm_compat.tries import CompatAsyncCharacterTrie, CompatCharacterTrie, CompatParallelCharacterTrie

__all__ = [
    "CompatAsyncCharacterTrie",
    "CompatByteBeamState",
    "CompatCharacterTrie",
    "CompatLM",
    "CompatParallelCharacterTrie",
    "install",
    "installed",
    "load",
    "uninstall",
    "wrap",
]
