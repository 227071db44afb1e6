"""The row channels and process layout of genlm-vllm, without an engine: the worker's side is
played by :class:`genlm_vllm.transport.shm.Segment` opened by path, as a worker process opens it."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'genlm-vllm[cpu]')", allow_module_level=True)

from genlm_core.errors import OptionsError
from genlm_core.request import Request
from genlm_core.testing import bounds
from genlm_vllm import VLLMOptions
from genlm_vllm.in_engine.capture import RowsExtension, write_rows
from genlm_vllm.layout import layout
from genlm_vllm.start.env import engine_env, threads_bind
from genlm_vllm.start.files import ENGINE_MARK, EngineFiles
from genlm_vllm.transport.channels import LocalRows, RpcRows, SharedMemoryRows
from genlm_vllm.transport.keys import SLOT, TAG
from genlm_vllm.transport.mailbox import ROWS
from genlm_vllm.transport.shm import WRITING, Segment, leftover_files

WIDTH = 10


def worker_write(args: dict, row: torch.Tensor) -> None:
    """What the writing rank does with a request's extra_args."""
    path, n, width, index, seq = args[SLOT]
    Segment(path, n, width).write(index, seq, row)


@pytest.fixture
def shm(tmp_path):
    rows = SharedMemoryRows(WIDTH, slots_per_file=4, directory=str(tmp_path))
    yield rows
    rows.close()


def test_shared_memory_rows_come_back_by_slot_not_position(shm):
    ticket = shm.prepare(3)
    want = [torch.randn(WIDTH) for _ in range(3)]
    for i in (2, 0, 1):  # any order
        worker_write(ticket.extra_args[i], want[i])
    got = shm.collect(ticket)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert shm.in_use == 3
    shm.release(ticket)
    assert shm.in_use == 0


def test_unwritten_stale_or_half_written_slots_read_as_missing(shm):
    first = shm.prepare(1)
    worker_write(first.extra_args[0], torch.ones(WIDTH))
    shm.release(first)
    second = shm.prepare(3)
    assert second.slots[0][:2] == first.slots[0][:2]  # the same slot, handed out again
    assert shm.collect(second) == [None, None, None]  # its old row is not the new request's
    path, n, width, index, seq = second.extra_args[1][SLOT]
    Segment(path, n, width).write(index, seq - 1, torch.ones(WIDTH))  # another request's number
    segment = second.slots[2][0]
    segment.flags[second.slots[2][1]] = WRITING  # a writer caught mid-copy
    assert shm.collect(second) == [None, None, None]


def test_concurrent_batches_never_share_a_slot_and_the_pool_grows(shm):
    tickets = [shm.prepare(3) for _ in range(5)]  # 15 slots from files of 4
    slots = [(s.path, i) for t in tickets for s, i, _ in t.slots]
    assert len(set(slots)) == 15 and len(shm.segments) == 4
    seqs = [seq for t in tickets for *_, seq in t.slots]
    assert len(set(seqs)) == 15


def test_a_failed_batch_retires_its_slots(shm):
    failed = shm.prepare(2)
    shm.release(failed, finished=False)  # its requests might still write
    later = shm.prepare(4)
    assert not {(s.path, i) for s, i, _ in failed.slots} & {(s.path, i) for s, i, _ in later.slots}
    assert shm.retired == 2


def test_close_and_garbage_collection_remove_the_files(tmp_path):
    rows = SharedMemoryRows(WIDTH, slots_per_file=2, directory=str(tmp_path))
    rows.prepare(5)
    assert len(os.listdir(tmp_path)) == 3
    rows.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        rows.prepare(1)
    dropped = SharedMemoryRows(WIDTH, directory=str(tmp_path))
    dropped.prepare(1)
    del dropped
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_files_in_dev_shm_are_named_ours():
    rows = SharedMemoryRows(WIDTH)
    rows.prepare(1)
    try:
        assert rows.paths[0] in leftover_files(os.getpid())
    finally:
        rows.close()
    assert rows.paths[0] not in leftover_files(os.getpid())


def test_rpc_rows_merge_by_tag_and_drop_failed_ones_on_the_writer():
    ROWS.clear()
    extension = RowsExtension()
    sent = []

    def pop(tags, discard):
        sent.append(list(discard))
        return [None, extension.genlm_pop_rows(tags, discard)]  # rank 1 answers None, rank 0 rows

    rows = RpcRows(pop)
    failed = rows.prepare(2)
    for tag in failed.tags:
        ROWS[tag] = torch.zeros(WIDTH)
    rows.release(failed, finished=False)
    ticket = rows.prepare(3)
    want = {ticket.tags[0]: torch.randn(WIDTH), ticket.tags[2]: torch.randn(WIDTH)}
    ROWS.update(want)
    got = rows.collect(ticket)
    assert torch.equal(got[0], want[ticket.tags[0]]) and got[1] is None and torch.equal(got[2], want[ticket.tags[2]])
    assert sent == [failed.tags] and ROWS == {}


def test_local_rows_come_back_in_the_inbox_of_the_call_that_asked():
    """The capture processor, run in the caller's thread while a batch's inbox is open, puts each row
    there (never in the mailbox); one written in another thread (no inbox there) reaches the caller by
    its tag through the mailbox; a row of another request never comes back; once released, the inbox
    is closed (rows go to the mailbox again) and a failed batch's late rows are dropped there."""
    import threading

    def write(tags: list[str], rows: torch.Tensor) -> None:
        write_rows([({TAG: tag}, i) for i, tag in enumerate(tags)], rows)

    channel = LocalRows()
    outer = channel.prepare(1)
    ticket = channel.prepare(3)
    assert [a[TAG] for a in ticket.extra_args] == ticket.tags
    logits = torch.randn(3, WIDTH)
    write([ticket.tags[0], "another request"], logits[[0, 2]])
    elsewhere = threading.Thread(target=write, args=([ticket.tags[2]], logits[[1]]))
    elsewhere.start()
    elsewhere.join()
    assert set(ROWS) == {ticket.tags[2]}  # only the other thread's row went by the mailbox
    got = channel.collect(ticket)
    assert torch.equal(got[0], logits[0]) and got[1] is None and torch.equal(got[2], logits[1])
    assert ROWS == {}
    channel.release(ticket)
    write(outer.tags, logits[[2]])  # the outer batch's inbox is open again
    assert torch.equal(channel.collect(outer)[0], logits[2]) and ROWS == {}
    channel.release(outer, finished=False)
    write(outer.tags, logits[[0]])  # no inbox open: a late row of the failed batch waits by its tag
    assert set(ROWS) == {outer.tags[0]}
    channel.release(outer, finished=False)
    assert ROWS == {}


@pytest.mark.parametrize(
    ("ranks", "cores", "want"),
    [
        (2, [0, 1], "0|1"),
        (1, [0, 1], "0-1"),
        (2, list(range(16)), "0-7|8-15"),
        (3, [0, 1, 2, 5], "0-1|2|5"),
        (4, [0, 1], "0|1|0|1"),
    ],
)
def test_threads_bind_splits_the_allowed_cores(ranks, cores, want):
    assert threads_bind(ranks, cores) == want


def test_thread_binding_defaults_and_refuses_a_wrong_count(monkeypatch):
    monkeypatch.setattr("genlm_vllm.vllm_api.release.on_cpu_build", lambda: True)
    monkeypatch.setattr("genlm_vllm.start.env.allowed_cores", lambda: [0, 1])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    tp2 = layout(VLLMOptions(engine_opts={"tensor_parallel_size": 2}))
    assert engine_env(tp2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert engine_env(layout(VLLMOptions(multiprocess=True)))["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(layout(VLLMOptions()))  # in-process: vLLM's own
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    with pytest.raises(ValueError, match="binds 1 ranks, but this engine has 2"):
        engine_env(tp2)


def test_layouts_and_impossible_combinations():
    assert layout(VLLMOptions()).capture == "local"
    assert layout(VLLMOptions(engine="async")).describe() == "AsyncLLM, multiprocess; rows by shm"
    pp = layout(VLLMOptions(engine_opts={"pipeline_parallel_size": 2, "tensor_parallel_size": 2}))
    assert (pp.world_size, pp.capture, pp.multiprocess) == (4, "shm", False)
    assert layout(VLLMOptions(engine_opts={"distributed_executor_backend": "ray"})).capture == "rpc"
    with pytest.raises(OptionsError, match=r"AsyncLLM.*always runs its engine core in its own process"):
        VLLMOptions(engine="async", multiprocess=False)
    with pytest.raises(OptionsError, match="capture='local' needs the model in this process"):
        VLLMOptions(capture="local", multiprocess=True)
    with pytest.raises(OptionsError, match="cannot reach Ray workers"):
        VLLMOptions(capture="shm", engine_opts={"distributed_executor_backend": "ray"})
    dp = layout(VLLMOptions(engine="async", engine_opts={"data_parallel_size": 2, "data_parallel_backend": "ray"}))
    assert (dp.data_parallel, dp.capture, dp.describe()) == (2, "rpc", "AsyncLLM, multiprocess, DP=2, Ray; rows by rpc")
    with pytest.raises(OptionsError, match="data_parallel_size > 1 runs only under AsyncLLM"):
        VLLMOptions(engine_opts={"data_parallel_size": 2})
    with pytest.raises(OptionsError, match="replicas=N runs N LLM engines"):
        VLLMOptions(replicas=2, engine="async")
    with pytest.raises(OptionsError, match="tensor_parallel_size"):
        VLLMOptions(engine_opts={"tensor_parallel_size": "two"})
    with pytest.raises(OptionsError, match="pipeline_parallel_size"):
        VLLMOptions(engine_opts={"pipeline_parallel_size": 0})


def test_async_scheduling_is_off_for_live_sessions_and_vllms_default_elsewhere():
    """The choice (VLLMOptions.async_scheduling): sessions wait for each step's row, so vLLM's async
    scheduling is off for them and refused if asked for; one-token requests keep vLLM's default."""
    from genlm_vllm.start.engine_args import engine_kwargs

    def kwargs(**options):
        opts = VLLMOptions(**options)
        return engine_kwargs("m", opts, layout(opts), "v1")

    for sessions in ({}, {"multiprocess": True}, {"engine_opts": {"tensor_parallel_size": 2}}, {"replicas": 2}):
        assert kwargs(**sessions)["async_scheduling"] is False, sessions
    assert "async_scheduling" not in kwargs(engine="async")  # vLLM's default (on, on CUDA)
    assert "async_scheduling" not in kwargs(live={"enabled": False})
    assert kwargs(engine="async", async_scheduling=False)["async_scheduling"] is False
    assert kwargs(live={"enabled": False}, async_scheduling=True)["async_scheduling"] is True
    for asked in ({"async_scheduling": True}, {"engine_opts": {"async_scheduling": True}}):
        with pytest.raises(OptionsError, match="cannot run live sessions"):
            VLLMOptions(**asked)


def test_workers_nap_on_the_cpu_build_and_only_where_there_are_workers(monkeypatch):
    """VLLMOptions.worker_wait: the nap travels to the workers in vLLM's additional_config, for layouts
    with worker processes only, merged under the user's own additional_config; 'auto' follows the build."""
    from genlm_vllm.start.engine_args import NAP_S, engine_kwargs
    from genlm_vllm.transport.keys import WORKER_NAP, worker_nap
    from genlm_vllm.vllm_api import release

    def settings(**options):
        opts = VLLMOptions(**options)
        return engine_kwargs("m", opts, layout(opts), "v1").get("additional_config")

    workers = ({"multiprocess": True}, {"engine_opts": {"tensor_parallel_size": 2}}, {"engine": "async"})
    for asked in workers:
        assert settings(**asked) == {WORKER_NAP: NAP_S}, asked  # auto, on vLLM's CPU build here
        assert settings(**asked, worker_wait="spin") is None
    assert settings() is None and settings(worker_wait="nap") is None  # in-process: no worker waits
    mine = {"engine_opts": {"tensor_parallel_size": 2, "additional_config": {"mine": 1, WORKER_NAP: 0.002}}}
    assert settings(**mine) == {"mine": 1, WORKER_NAP: 0.002}  # theirs over ours
    assert worker_nap(SimpleNamespace(additional_config=settings(**mine))) == 0.002
    assert worker_nap(SimpleNamespace(additional_config={})) is None
    monkeypatch.setattr(release, "on_cpu_build", lambda: False)  # CUDA: vLLM's own spin unless asked
    assert settings(multiprocess=True) is None
    assert settings(multiprocess=True, worker_wait="nap") == {WORKER_NAP: NAP_S}


def test_the_capture_follows_the_runner_and_the_runner_is_checked_after_start(monkeypatch):
    from genlm_vllm.drivers.launch import check_started
    from genlm_vllm.start.engine_args import engine_kwargs
    from genlm_vllm.transport.keys import PROCESSORS
    from genlm_vllm.vllm_api import release

    opts = VLLMOptions()
    lay = layout(opts)
    assert engine_kwargs("m", opts, lay, "v2")["logits_processors"] == ["genlm_vllm.in_engine.capture:CaptureLogitsV2"]
    assert engine_kwargs("m", opts, lay, "v1")["logits_processors"] == [PROCESSORS["v1"]]
    assert engine_env(lay, "v2")["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert engine_env(lay, "v1")["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    with pytest.raises(ValueError, match="model_runner='v2' needs Triton"):
        release.resolve_runner("v2", {})
    assert release.resolve_runner("v1", {}) == "v1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert release.resolve_runner("auto", {}) == "v2"  # a runner the user pinned is followed

    def config(v2: bool, async_scheduling: bool) -> SimpleNamespace:
        return SimpleNamespace(
            use_v2_model_runner=v2,
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
            model_config=SimpleNamespace(max_model_len=2048),
        )

    driver = SimpleNamespace(runner=None, context_limit=None)
    with pytest.raises(RuntimeError, match=r"started its V2 model runner.*pass model_runner='v2'"):
        check_started(driver, config(True, False), "v1", sessions=True)
    with pytest.raises(RuntimeError, match="async scheduling on"):
        check_started(driver, config(False, True), "v1", sessions=True)
    check_started(driver, config(True, True), "v2", sessions=False)
    assert (driver.runner, driver.context_limit) == ("v2", 2047)


def test_auto_is_what_vllms_own_rule_decides(monkeypatch, tmp_path):
    """Without a pinned runner, "auto" is what vLLM's configuration decides: V1 on the CPU build (no
    Triton there for V2), where "auto" answers without building a configuration."""
    from genlm_core.testing.models import tiny_model_dir
    from genlm_vllm.vllm_api import release

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    path = str(tiny_model_dir("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1))
    kwargs = {"model": path, "kv_cache_memory_bytes": 2**26}
    assert release.runner_vllm_picks(kwargs) == "v1"
    assert release.resolve_runner("auto", kwargs) == "v1"


def test_ray_address_reaches_an_engine_core_in_its_own_process(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = {"engine_opts": {"distributed_executor_backend": "ray"}, "multiprocess": True}
    assert engine_env(layout(VLLMOptions(**ray, ray_address="10.0.0.1:6379")))["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert "RAY_ADDRESS" not in engine_env(layout(VLLMOptions(**ray)))  # none named, none connected
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert engine_env(layout(VLLMOptions(**ray)))["RAY_ADDRESS"] == "10.0.0.2:6379"
    assert "RAY_ADDRESS" not in engine_env(layout(VLLMOptions(multiprocess=True)))  # no Ray: left alone


def test_the_replica_router_keeps_lineages_together_and_balances_new_contexts():
    from genlm_vllm.drivers.replicas import LOOKBACK, PrefixRouter, ReplicaError

    router = PrefixRouter(3)
    prompts = [[7, i] for i in range(6)]
    first = router.assign(prompts)
    assert sorted(first) == [0, 0, 1, 1, 2, 2]  # nothing known: least loaded
    steps = [p + [1, 2] for p in prompts]  # two SMC steps later
    assert router.assign(steps) == first
    two = PrefixRouter(2)
    assert two.assign([[1], [2]]) == [0, 1]
    assert two.assign([[2] + [5] * LOOKBACK]) == [1]  # the known prefix is LOOKBACK tokens back
    assert two.assign([[2] + [6] * (LOOKBACK + 1)]) == [0]  # further back: a new context, least loaded
    children = [steps[0] + [3, t] for t in range(4)]  # after resampling, four particles continue one parent
    placed = router.assign(children)
    assert placed[:2] == [first[0]] * 2 and first[0] not in placed[2:]  # up to its fair share of 4 / 3
    assert router.assign([c + [9] for c in children]) == placed  # and each stays where it went
    one_run = PrefixRouter(2)  # every particle of one SMC run extends the same prompt
    one_run.assign([[5, 5]])
    assert sorted(one_run.assign([[5, 5, t] for t in range(32)])) == [0] * 16 + [1] * 16
    router.dead.add(first[0])
    moved = router.assign([steps[0] + [4]])[0]
    assert moved != first[0]
    router.dead.update({0, 1, 2})
    with pytest.raises(ReplicaError, match="all 3 replicas have failed"):
        router.assign([[1]])
    small = PrefixRouter(2, memory=2)
    small.assign([[1], [2], [3]])
    assert small._known(Request((1,))) is None  # bounded memory forgets the oldest
    assert small._known(Request((3,))) is not None


SCRIPT = """
from genlm_vllm.start.processes import check_main_guard

def start():
    check_main_guard()
    print("started")

{body}
"""


@pytest.mark.parametrize(
    ("body", "fails"),
    [
        ("start()", True),
        ("if True:\n    start()", True),
        ('if __name__ == "__main__":\n    start()', False),
        ("def main():\n    start()\n\nif __name__ == '__main__':\n    main()", False),
    ],
)
@pytest.mark.slow
@pytest.mark.process
def test_a_script_without_a_main_guard_gets_the_fix_named(tmp_path, body, fails):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(SCRIPT).format(body=body))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    if fails:
        assert out.returncode != 0
        assert 'if __name__ == "__main__":' in out.stderr and f"{script}, line" in out.stderr
    else:
        assert out.returncode == 0 and out.stdout.strip() == "started", out.stderr


def test_engine_files_removes_only_its_own_unused_files(tmp_path, monkeypatch):
    """What an engine's close removes: the files whose names carry its tag and that no other process uses;
    not another engine's (started at the same moment or not), not one without a tag, not one still in use."""
    monkeypatch.setattr("genlm_vllm.transport.shm.SHM_DIR", str(tmp_path))
    files, other = EngineFiles(), EngineFiles()
    mine = f"{ENGINE_MARK}{files.tag}-"
    names = {
        "orphan": f"sem.mp-{mine}1",
        "held": f"psm_{mine}0a1b2c3d",
        "other": f"sem.mp-{ENGINE_MARK}{other.tag}-1",
        "untagged": "psm_0a1b2c3d",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    held = str(tmp_path / names["held"])
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; f = open({held!r}); print(1, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        holder.stdout.readline()  # it holds the file open now
        assert files.files() == {str(tmp_path / names["orphan"]), held}
        assert files.remove_orphans() == [str(tmp_path / names["orphan"])]
    finally:
        holder.kill()
        holder.wait()
    assert sorted(os.listdir(tmp_path)) == sorted([names["held"], names["other"], names["untagged"]])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_processes_started_while_an_engine_starts_name_their_files_with_its_tag(method, monkeypatch):
    """Inside :meth:`EngineFiles.marking`, this process and the processes multiprocessing starts from it, and
    theirs, name their semaphores and shared-memory segments with the engine's tag; after it, this process's
    names are as before."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    monkeypatch.syspath_prepend(os.path.dirname(__file__))  # a spawned child has this process's sys.path
    import shm_child  # a child imports it, not this module (and vLLM)

    context = mp.get_context(method)
    queue = context.Queue()  # made before the marking: not the engine's
    files = EngineFiles()
    with files.marking():
        here = [shared_memory.SharedMemory(create=True, size=16)]
        lock = context.Lock()
        child = context.Process(target=shm_child.names_made_here, args=(queue, os.getpid()))
        child.start()
        # the child uses the queue (made before the marking) when the start ends: its files are not the engine's
        made = [queue.get(timeout=120)]
    try:
        child.join(120)
        assert child.exitcode == 0
        made.append(queue.get(timeout=10))  # the child's and its child's
        assert len({pid for pid, _, _ in made}) == 2
        tag = f"{ENGINE_MARK}{files.tag}-"
        for _, sem, segment in made:
            assert sem.startswith(f"/mp-{tag}") and segment.startswith(f"psm_{tag}")  # a segment's name has no "/"
        assert here[0].name.startswith(f"psm_{tag}") and lock._semlock.name.startswith(f"/mp-{tag}")
        after = shared_memory.SharedMemory(create=True, size=16)
        assert tag not in after.name and tag not in context.Lock()._semlock.name
        after.close()
        after.unlink()
    finally:
        here[0].close()
        here[0].unlink()
    assert files.files() == {f"/dev/shm/sem{lock._semlock.name.replace('/', '.')}"}  # the children's are gone
    del lock
    gc.collect()
    assert files.files() == set()


def test_files_of_a_killed_process_are_removed_by_the_next_one(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"genlm-vllm-{dead.pid}-abc-0"
    alive = tmp_path / f"genlm-vllm-{os.getpid()}-abc-0"
    orphan.write_bytes(b"x")
    alive.write_bytes(b"x")
    rows = SharedMemoryRows(WIDTH, directory=str(tmp_path))
    assert not orphan.exists() and alive.exists()
    rows.close()


def test_cpu_lora_kernel_gives_no_adapter_tokens_no_delta():
    """vLLM's CPU kernel read index -1 as the last adapter slot; after the fix such tokens get zero."""
    from vllm.lora.punica_wrapper import punica_cpu

    from genlm_vllm.vllm_api.fixes import apply_cpu_fixes

    assert apply_cpu_fixes()
    x = torch.randn(3, 8)
    weights = torch.randn(1, 1, 4, 8)  # one adapter slot: rank 4, hidden 8
    out = torch.full((3, 4), 7.0)
    punica_cpu.bgmv_shrink(x, weights, out, torch.tensor([-1, 0, -1]), 0.5)
    assert torch.equal(out[0], torch.zeros(4)) and torch.equal(out[2], torch.zeros(4))
    want = 0.5 * weights[0, 0] @ x[1]
    # two float32 dot products of 8 terms (and a scaling), any order: twice a worst-case sum of 9 terms
    one = bounds.sum_error(9, 0.5 * (weights[0, 0].abs() @ x[1].abs()).max().item(), probabilistic=False)
    tol = bounds.Bound(2 * one, f"2 x {one.basis}")
    bounds.within("vllm: bgmv_shrink vs matmul", (out[1] - want).abs().max().item(), tol)
