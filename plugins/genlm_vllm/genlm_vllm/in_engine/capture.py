"""Inside the engine: logits processors that hand each tagged request's logits back to genlm.

One processor per vLLM model runner, since their interfaces differ: :class:`CaptureLogits` for the
V1 runner (vLLM's CPU build, and CUDA with ``VLLM_USE_V2_MODEL_RUNNER=0``) and
:class:`CaptureLogitsV2` for Model Runner V2 (CUDA's default). :data:`~genlm_vllm.transport.keys.PROCESSORS`
names them; the engine is started with the one for the runner it will use
(:func:`genlm_vllm.vllm_api.release.resolve_runner`).

vLLM imports this module by name in whichever process runs the model (the caller's own for an
in-process engine, vLLM's engine-core process, each tensor/pipeline-parallel worker) and in the
caller's, where its input processor validates requests against the processor class. Importing it
changes nothing; constructing a processor (once per model runner, when the engine starts in that
process and before its first forward pass) applies :func:`~genlm_vllm.vllm_api.fixes.apply_cpu_fixes`
there, the one hook vLLM gives us in every worker, and sets how the worker waits for the engine's next
step (:data:`~genlm_vllm.transport.keys.WORKER_NAP`). The caller's side of the protocol (keys, slot
file, fingerprints) is :mod:`genlm_vllm.transport.keys`.

Requests are matched by the tag in ``SamplingParams.extra_args`` (never by row order), so it does
not matter how the scheduler splits, orders or chunks them. With chunked prefill every chunk produces
a row; the one kept is at the context's last position. Each step's tagged rows are written into one
block, normalised there (a float32 log-softmax over the first ``NORMALISE`` columns: the caller's
vocabulary), and leave the device in one copy per step; with ``ON_DEVICE`` (an in-process engine)
they stay on the model's device.

Exactly one process writes each row: tensor-parallel rank 0 of the last pipeline stage (with TP
every rank sees the same all-gathered logits; with PP only the last stage has any). Where the row
goes depends on the request's extra arguments:

- ``SLOT`` present: into a caller-owned shared-memory slot (:class:`~genlm_vllm.transport.shm.Segment`),
  using a sequence-numbered flag so the caller never mistakes an old or half-written row for its own;
- otherwise, where the caller steps the engine in this thread (an in-process engine), into the inbox its
  batch opened (:data:`~genlm_vllm.transport.mailbox.INBOX`): the row returns up the call that asked;
- otherwise into this process's :mod:`~genlm_vllm.transport.mailbox` by tag, fetched with
  ``collective_rpc("genlm_pop_rows", ...)`` through :class:`RowsExtension`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from genlm_core.rows import RowMemory, normalise
from genlm_vllm.transport import mailbox
from genlm_vllm.transport.keys import (
    AT,
    CONTEXT,
    NORMALISE,
    ON_DEVICE,
    SLOT,
    TAG,
    fingerprint,
    fingerprint_positions,
    split_positions,
    worker_nap,
)
from genlm_vllm.transport.shm import Segment
from genlm_vllm.vllm_api import worker
from genlm_vllm.vllm_api.fixes import apply_cpu_fixes
from genlm_vllm.vllm_api.release import (
    BatchUpdate,
    LogitsContext,
    LogitsProcRequestState,
    V1LogitsProcessor,
    V2LogitsProcessor,
)

log = logging.getLogger(__name__)

ROWS_WRITTEN = 0  #: rows this process has written (on the writing rank), for genlm_where
_segments: dict[str, Segment] = {}
_memory = RowMemory()  #: host blocks for the rows this process writes, each reused once nothing holds it


def set_up_this_process(vllm_config: Any) -> None:
    """What a process that runs the model needs before its first forward pass: vLLM's CPU fixes, and
    the worker's wait for the next step that the engine was started with."""
    apply_cpu_fixes()
    nap = worker_nap(vllm_config)
    if nap is not None:
        worker.nap_while_waiting(nap)


def is_row_writer() -> bool:
    """Whether this process writes rows: TP rank 0 of the last PP stage (True without parallelism)."""
    place = worker.parallel_place()
    if place is None:  # no process groups: a single process
        return True
    return place.tp_rank == 0 and place.last_stage


def _segment(path: str, n: int, width: int) -> Segment:
    segment = _segments.get(path)
    if segment is None:
        segment = _segments[path] = Segment(path, n, width)
    return segment


def write_rows(wanted: list[tuple[dict[str, Any], int]], logits: torch.Tensor) -> None:
    """Hand the rows ``logits[index]`` of ``(extra args, index)`` pairs to their callers, where each
    request's ``extra_args`` say (slot or tag): written into one block (:func:`_rows_of`), normalised on
    the model's device over the ``NORMALISE`` first columns where a request asks, and copied to the host
    once."""
    global ROWS_WRITTEN
    if not wanted:
        return
    ROWS_WRITTEN += len(wanted)
    by_width: dict[tuple[int | None, bool], list[tuple[dict[str, Any], int]]] = {}
    for args, index in sorted(wanted, key=_caller_order):
        by_width.setdefault((args.get(NORMALISE), bool(args.get(ON_DEVICE))), []).append((args, index))
    for (width, on_device), group in by_width.items():
        rows = _rows_of(logits, [index for _, index in group], width)
        if not on_device:
            rows = rows.to("cpu")
        inbox = mailbox.INBOX.get()
        for (args, _), row in zip(group, rows, strict=True):
            slot = args.get(SLOT)
            if slot is None and inbox is not None:
                inbox[args[TAG]] = row
            elif slot is None:
                mailbox.keep(args[TAG], row)
            else:
                path, n, slot_width, slot_index, seq = slot
                _segment(path, n, slot_width).write(slot_index, seq, row)


def _rows_of(logits: torch.Tensor, index: list[int], width: int | None) -> torch.Tensor:
    """``logits[index]`` as a new float32 block, log-normalised over its first ``width`` columns
    (None: raw). On the host the block comes from :data:`_memory`, memory used before, so a step's rows
    cost no page faults (on this kind of machine a fresh 4 MiB block of rows took 2 to 40 ms in the
    kernel), and each run of consecutive rows is normalised (or copied) straight into its place: no
    gathered copy of the step's logits first (a ``[256, 131072]`` gather costs most of a log-softmax)."""
    columns = logits.shape[-1]
    kept = columns if width is None else min(width, columns)
    out = _memory.take(len(index), kept, logits.device)
    if out is None:  # on an accelerator: one gather, then one log-softmax
        picked = logits[torch.tensor(index, device=logits.device)]
        return picked.to(torch.float32) if width is None else normalise(picked, kept)
    for at, start, length in _runs(index):
        rows = logits[start : start + length]
        if width is None:
            out[at : at + length].copy_(rows)
        else:
            normalise(rows, kept, out=out[at : at + length])
    return out


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """``index`` as runs of consecutive values: (place in ``index``, first value, length) each."""
    runs: list[tuple[int, int, int]] = []
    at = 0
    for k in range(1, len(index) + 1):
        if k == len(index) or index[k] != index[k - 1] + 1:
            runs.append((at, index[at], k - at))
            at = k
    return runs


def _caller_order(pair: tuple[dict[str, Any], int]) -> tuple[str, int, int]:
    """Where a row goes in its caller's batch: the tags of one batch are numbered in the caller's order
    (:meth:`~genlm_vllm.transport.channels.RowChannel.new_tags`), so rows gathered in this order come back as
    consecutive rows of one block, whatever order the engine's batch holds them in (after resampling it
    is another one): the caller then takes them without stacking them again. Matching stays by tag."""
    args, index = pair
    prefix, _, number = str(args.get(TAG, "")).rpartition("-")
    return (prefix, int(number), index) if number.isdigit() else (prefix, -1, index)


class CaptureLogits(V1LogitsProcessor):
    """The V1 model runner's processor: copies the logits of tagged requests; changes nothing.

    V1 tells a processor how its batch changed (:class:`BatchUpdate`: requests added, removed,
    moved); the row kept is the one produced while the request holds :data:`~genlm_vllm.transport.keys.AT` output
    tokens (none: the row of its prompt; a resident request's, after its program's tokens), on the
    context its fingerprint names."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        set_up_this_process(vllm_config)  # the engine starts in this process: its model runner builds us first
        #: batch index -> (extra args, prompt ids, output ids) of tagged requests (the lists are the
        #: runner's own, so they are read as they are at each step)
        self.slots: dict[int, tuple[dict[str, Any], list[int], list[int]]] = {}
        self.writer: bool | None = None  # decided at the first row: process groups exist by then

    def is_argmax_invariant(self) -> bool:
        return False  # else greedy batches skip us and we would see processed logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        removed, added, moved = worker.batch_changes(batch_update)
        for index in removed:
            self.slots.pop(index, None)
        for index, args, prompt, output_ids in added:
            if TAG in args and prompt is not None:
                self.slots[index] = (args, prompt, output_ids)
            else:
                self.slots.pop(index, None)
        for a, b, swapped in moved:
            moving_a, moving_b = self.slots.pop(a, None), self.slots.pop(b, None)
            if moving_a is not None:
                self.slots[b] = moving_a
            if swapped and moving_b is not None:
                self.slots[a] = moving_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.slots:
            return logits
        if self.writer is None:
            self.writer = is_row_writer()
        if not self.writer:
            return logits
        wanted = [
            (args, index)
            for index, (args, prompt, output_ids) in self.slots.items()
            if TAG in args
            and len(output_ids) == args.get(AT, 0)
            and index < logits.shape[0]
            and _context_matches(args, prompt, output_ids)
        ]
        write_rows(wanted, logits)
        return logits


@dataclass
class _Wanted:
    args: dict[str, Any]
    position: int  # the row at this position of the sequence (its last prompt token) is the one


class CaptureLogitsV2(V2LogitsProcessor):
    """Model Runner V2's processor: copies the logits of tagged requests; changes nothing.

    V2 gives each request a slot (recycled through a free list) at :meth:`add_request`, and each
    step's :class:`LogitsContext` maps logits rows to slots and positions. A request's row is the one
    at its last prefill position (``prefill_len - 1``: earlier chunks of a chunked prefill produce
    rows too), taken once. Token history lives on the device; the context's hash is checked there."""

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState):
        set_up_this_process(vllm_config)  # the engine starts in this process: its model runner builds us first
        self.req_states = req_states
        self.wanted: dict[int, _Wanted] = {}  # slot -> the row this request wants
        self.writer: bool | None = None

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        args = worker.request_args(sampling_params)
        if TAG not in args:
            self.wanted.pop(req_idx, None)  # a recycled slot: forget its last occupant
            return False
        length = worker.prefill_length(self.req_states, req_idx)
        expected = args.get(CONTEXT)
        if expected is not None and int(expected[0]) != length:
            log.error("genlm-vllm: request %s runs on another context than it was issued for; no row", args[TAG])
            self.wanted.pop(req_idx, None)
            return False
        self.wanted[req_idx] = _Wanted(args, length - 1)
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.wanted or not any(int(slot) in self.wanted for slot in worker.step_slots(ctx)):
            return logits
        if self.writer is None:
            self.writer = is_row_writer()
        slots, positions = worker.step_rows(ctx)
        rows = []
        for row, (slot, position) in enumerate(zip(slots, positions, strict=True)):
            want = self.wanted.get(slot)
            if want is None or position != want.position:
                continue
            del self.wanted[slot]  # one row per request
            if self.writer and self._context_matches(want, slot):
                rows.append((want.args, row))
        write_rows(rows, logits)
        return logits

    def _context_matches(self, want: _Wanted, slot: int) -> bool:
        expected = want.args.get(CONTEXT)
        if expected is None:
            return True
        length = want.position + 1
        history = worker.token_history(self.req_states)
        at = torch.tensor(fingerprint_positions(length), device=history.device)
        sampled = history[slot, at].tolist()  # only the ids the fingerprint reads
        if fingerprint(length, sampled) == list(expected):
            return True
        log.error("genlm-vllm: request %s runs on another context than it was issued for; no row", want.args[TAG])
        return False


def _context_matches(args: dict[str, Any], prompt: list[int], output_ids: list[int]) -> bool:
    """Whether the request runs on the context its tag was issued for (when the tag says which): its
    prompt and output tokens, read where the fingerprint reads them."""
    expected = args.get(CONTEXT)
    if expected is None:
        return True
    n, length = len(prompt), len(prompt) + len(output_ids)
    in_prompt, in_output = split_positions(length, n)
    sample = [prompt[i] for i in in_prompt] + [output_ids[i] for i in in_output]
    if fingerprint(length, sample) == list(expected):
        return True
    log.error("genlm-vllm: request %s runs on another context than it was issued for; no row", args[TAG])
    return False


class RowsExtension:
    """Mixed into vLLM's workers (``worker_extension_cls``): rows leave through ``collective_rpc``.

    The reply carries raw float32 bytes and a shape: vLLM's RPC queue turns tensors and arrays into
    something else unless insecure serialisation is allowed.
    """

    def genlm_pop_rows(self, tags: list[str], discard: list[str]) -> tuple[list[str], int, bytes] | None:
        """Take the rows of ``tags`` (those present) and drop those of ``discard``. Returns
        ``(found tags, row width, bytes)`` from the writing rank, None from the others."""
        if not is_row_writer():
            return None
        found = mailbox.take(tags, discard)
        if not found:
            return [], 0, b""
        rows = torch.stack([row for _, row in found])
        return [tag for tag, _ in found], int(rows.shape[1]), rows.numpy().tobytes()

    def genlm_kept_rows(self) -> int | None:
        """How many rows wait to be fetched on the writing rank (None elsewhere); for tests."""
        return mailbox.waiting() if is_row_writer() else None

    def genlm_where(self) -> dict[str, Any]:
        """This worker's process, host, node address and ranks, and how its tensor- and
        pipeline-parallel groups talk (on CPU: "shm" for vLLM's shared-memory collectives, else
        "torch.distributed", the network path; elsewhere the communicator's class name); for tests
        and the self-test."""
        import os
        import socket

        place = worker.parallel_place()
        assert place is not None, "genlm_where runs in vLLM's workers"
        tp_path, pp_path = worker.group_paths()
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": worker.node_address() or _ray_node_address(),
            "tp_rank": place.tp_rank,
            "pp_rank": place.pp_rank,
            "writer": is_row_writer(),
            "rows_written": ROWS_WRITTEN,
            "tp_path": tp_path,
            "pp_path": pp_path,
        }


def _ray_node_address() -> str | None:
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else None
    except ImportError:
        return None
