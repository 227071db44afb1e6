"""What crosses from the caller into vLLM's processes: the keys a request carries, the names vLLM loads our
engine-side code by, and context fingerprints.

Both sides import this module: the caller (:mod:`genlm_vllm.transport.channels`, :mod:`genlm_vllm.live`,
the engine arguments) and the engine's processes (:mod:`genlm_vllm.in_engine.capture`,
:mod:`genlm_vllm.in_engine.forks`). It imports neither vLLM nor anything that does, and does nothing at
import; what it reads of vLLM's configuration it reads through :mod:`genlm_vllm.vllm_api.worker`. The
slot file's format is :mod:`genlm_vllm.transport.shm`'s.

- The ``extra_args`` keys a request carries into the engine (:data:`TAG`, :data:`SLOT`,
  :data:`CONTEXT`, :data:`NORMALISE`, :data:`ON_DEVICE`, :data:`FORK`, :data:`AT`).
- The names vLLM loads our engine-side code by, in each of its processes (:data:`PROCESSORS`,
  :data:`EXTENSION`, :data:`CONNECTOR` in :data:`CONNECTOR_MODULE`).
- What the engine's processes are set up with, in vLLM's ``additional_config`` (:data:`WORKER_NAP`).
- A context's fingerprint (:func:`context_fingerprint`), which the engine checks a request runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from genlm_core.context import Context
from genlm_vllm.vllm_api.worker import engine_settings

# ---- extra_args keys ------------------------------------------------------------------------------

TAG = "genlm_capture"  #: the request's tag (a string): its row is captured and matched by it
SLOT = "genlm_slot"  #: [segment path, slots in segment, width, slot index, sequence number]
CONTEXT = "genlm_context"  #: (optional) the :func:`context_fingerprint` the row must be for
NORMALISE = "genlm_normalise"  #: (optional) normalise the row over this many first columns
ON_DEVICE = "genlm_on_device"  #: (optional, in-process engines) keep the row on the model's device
FORK = "genlm_fork"  #: the request id of the live sequence whose context this one extends
#: (optional) how many output tokens a request holds when its row is computed: a resident request's
#: row after the tokens its program chose (:class:`~genlm_vllm.vllm_api.client.ResidentCore`); absent: 0, the
#: row at its prompt's last token
AT = "genlm_at"

# ---- the names vLLM loads our code by -------------------------------------------------------------

#: The capture processor for each model runner (their interfaces differ), as ``module:Class``.
PROCESSORS = {"v1": "genlm_vllm.in_engine.capture:CaptureLogits", "v2": "genlm_vllm.in_engine.capture:CaptureLogitsV2"}
#: Mixed into vLLM's workers (``worker_extension_cls``: vLLM wants a dotted path here).
EXTENSION = "genlm_vllm.in_engine.capture.RowsExtension"
#: The KV connector that lets forks copy their parent's unfinished block (``kv_transfer_config``).
CONNECTOR = "ForkConnector"
CONNECTOR_MODULE = "genlm_vllm.in_engine.forks"

# ---- settings for the engine's processes, in vLLM's additional_config -------------------------------

#: Seconds a worker sleeps between checks for the engine's next step, where vLLM would spin
#: (:attr:`genlm_vllm.VLLMOptions.worker_wait`); absent: vLLM's own wait.
WORKER_NAP = "genlm_worker_nap_s"


def worker_nap(vllm_config: Any) -> float | None:
    """The :data:`WORKER_NAP` an engine was started with (None: vLLM's own wait)."""
    settings = engine_settings(vllm_config)
    value = settings.get(WORKER_NAP) if settings is not None else None
    return None if value is None else float(value)


# ---- context fingerprints -------------------------------------------------------------------------

#: Ids a fingerprint reads: the last ones and as many spread over the context. A check against a
#: request run on another context (a bookkeeping bug), not against an adversary: a wrong request
#: differs in its length, its last ids or its start; each side reads at most 16 ids per row.
FINGERPRINT_SAMPLE = 8


@functools.lru_cache(maxsize=4096)
def fingerprint_positions(length: int) -> tuple[int, ...]:
    """The positions of a context of ``length`` tokens that :func:`context_fingerprint` reads: in
    order, each once (kept for the lengths a step's contexts have)."""
    spread = range(0, length, length // FINGERPRINT_SAMPLE + 1)
    return tuple(sorted({*spread, *range(max(0, length - FINGERPRINT_SAMPLE), length)}))


@functools.lru_cache(maxsize=4096)
def split_positions(length: int, first: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`fingerprint_positions` of ``length`` as (those below ``first``, those from ``first`` on,
    less ``first``): where a context held as ``first`` prompt ids and its output ids is read."""
    positions = fingerprint_positions(length)
    return tuple(i for i in positions if i < first), tuple(i - first for i in positions if i >= first)


def context_fingerprint(token_ids: Sequence[int]) -> list[int]:
    """``[length, hash]`` of a context, the hash of the ids at :func:`fingerprint_positions` (ints
    hash alike in every process): what the engine checks a request runs on, in time independent of
    the context's length. Rows are matched by tag; this catches a request run on another context."""
    positions = fingerprint_positions(len(token_ids))
    sample = token_ids.take(positions) if isinstance(token_ids, Context) else [token_ids[i] for i in positions]
    return fingerprint(len(token_ids), sample)


def fingerprint(length: int, sample: Sequence[int]) -> list[int]:
    """The :func:`context_fingerprint` of a context of ``length`` tokens whose ids at
    :func:`fingerprint_positions` are ``sample`` (for the engine, which holds them elsewhere)."""
    return [length, hash(tuple(sample))]
