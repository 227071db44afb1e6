"""The ecosystem's own test suites, fetched once and run unmodified under genlm_compat: the clients'
(genlm-control, llamppl) and the seeds' (genlm-backend, genlm-bytes) files that load a model.

``python -m tests.compat.client_suites`` runs the selected files on genlm-backend and genlm-bytes and on
genlm, prints the table of counts and writes ``seed_passing.txt``: the tests that pass on the seeds here,
which ``test_client_suites.py`` requires to pass on genlm.

Offline, the hub names these files load are stand-ins: the pytest plugin maps GPT-2 and the Llama-2
tokenizer names; the seeds' SmolLM names are folders placed beside the tests (:data:`STAND_INS`), which
every library loads as local paths: SmolLM2-135M for ``HuggingFaceTB/SmolLM-135M``, a random LoRA
adapter of it for ``vxef/smol_lora_toy`` and the model with that adapter merged for ``vxef/smol_merged_toy``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from genlm_core.testing.tokenizers import cache_dir

CLIENTS = {"genlm-control": "0.4.1", "llamppl": "0.2.3", "genlm-backend": "0.3.1", "genlm-bytes": "0.2.0"}
#: The files of each suite that touch a language model or a trie (the rest test pure potentials).
FILES = {
    "genlm-control": [
        "tests/potential/test_autobatch.py",
        "tests/potential/test_bytellm.py",
        "tests/potential/test_canonical.py",
        "tests/potential/test_coerce.py",
        "tests/potential/test_duplicate_byte_strings.py",
        "tests/potential/test_ensemble.py",
        "tests/potential/test_llm.py",
        "tests/sampler/test_set_sampler.py",
        "tests/sampler/test_token_sampler.py",
        "tests/test_setups.py",
        "tests/test_util.py",
    ],
    # llamppl's tests/test_examples.py imports its haiku example, which downloads NLTK's cmudict at import:
    # it cannot run offline, on genlm-backend or on genlm.
    "llamppl": ["tests/test_lmcontext.py", "tests/test_resampling.py"],
    "genlm-backend": [
        "tests/test_llm.py",
        "tests/test_hf_llm.py",
        "tests/test_hf_lora.py",
        "tests/test_lora.py",
        "tests/test_duplicates.py",
    ],
    "genlm-bytes": ["tests/test_beam.py", "tests/test_healing.py"],
}


def stand_ins() -> dict[str, Path]:
    """Hub name -> the local folder standing in for it, for names the seeds' tests load as paths."""
    from genlm_core.testing.models import smollm2_dir, smollm2_lora_dirs

    adapter, merged = smollm2_lora_dirs()
    return {"HuggingFaceTB/SmolLM-135M": smollm2_dir(), "vxef/smol_lora_toy": adapter, "vxef/smol_merged_toy": merged}


#: Files that run in a process of their own beside the rest of their suite, so that the suites run at once
#: share 2 cores evenly: genlm-control's tests/test_setups.py took 51 of its 123 s of tests here.
APART = {"genlm-control": ["tests/test_setups.py", "tests/potential/test_autobatch.py"]}
#: Suites that run with nothing else on the machine: genlm-backend's tests/test_hf_llm.py::test_batch_timeout
#: asserts that a batch comes back within half a batching timeout, and failed beside a busy test session.
ALONE = {"genlm-backend"}
#: Suites whose tests load the names of :func:`stand_ins` (placed in the suite's folder before a run).
STAND_INS = {"genlm-backend"}
#: Tests that are not deterministic on genlm-backend itself (unseeded SMC over random logits): each failed
#: there in some runs here (test_smc_with_fewer_logits: 1 of 3 runs with GENLM_COMPAT=off). They are run,
#: but not required.
FLAKY_ON_SEED = {
    # A hypothesis property over random text: "000000000" fails it on genlm-backend too (found in a CI run).
    "genlm-control::tests.potential.test_canonical::test_example",
    "genlm-control::tests.potential.test_duplicate_byte_strings::test_smc_with_fewer_logits[EleutherAI/llemma_7b]",
    "genlm-control::tests.potential.test_duplicate_byte_strings::test_smc_with_fewer_logits[codellama/CodeLlama-7b-hf]",
}
#: Tests that pass on the seeds but read the seed's private state, which genlm does not have: each is
#: listed with this reason in docs/migration.md ("Tests of the seeds' private state").
PRIVATE_STATE = {
    f"genlm-backend::tests.test_hf_llm::{name}": reason
    for name, reason in {
        "test_caching": "walks genlm-backend's KV-cache trie (`_caches`, its nodes' `has_token`/`get_token`)",
        "test_cache_operations": "calls `walk_cache`, which walks genlm-backend's `_caches` trie, and prints it",
        "test_cache_kv": "reads `past_key_values` off a `_caches` trie node found by `walk_cache`",
        "test_walk_cache_with_past": "reads the `(node, index, past, base)` of a `walk_cache` over `_caches`",
    }.items()
}
HERE = Path(__file__).parent
SEED_PASSING = HERE / "seed_passing.txt"
#: First on the suites' ``PYTHONPATH``: its ``sitecustomize.py`` makes ``import vllm`` fail there, as on a
#: machine without vLLM. No test of the suites runs vLLM on a CPU (genlm-control's one vLLM test needs CUDA),
#: and genlm-backend imports it whole at import when it is there: about 6 CPU-s of each process's start.
#: Under a test session it also applies the session's garbage-collector thresholds (``tests/process_site``).
WITHOUT_VLLM = HERE / "without_vllm"
#: How long the ``on_genlm`` fixture waits for the suites (all of them, from its start). Measured here (2 cores,
#: the fixture's wait: the suites beside, then genlm-backend's alone): 169 s on a quiet machine with the sources
#: and stand-ins cached (148 s beside, 21.5 s alone); 837 s with the machine loaded by other test runs and a
#: build (load average 8 to 13), of which 133 s fetching the sources and building the stand-ins the first time.
#: In a whole run the suites share the cores with a busy worker: about twice the quiet time, 340 s (the reference
#: machine: 240-319 s), plus 133 s of first set-up, 473 s; twice that for the 2x spread between machines of this
#: kind, 946 s, and a margin: 1200 s. The loaded run here fits in it; a run that does not fails with its message.
DEADLINE_S = 1200.0
#: Each test's own limit inside a suite (its pytest-timeout, which fails that test with its stack and goes on):
#: the longest test, genlm-control's test_with_llm_and_fsa_sampler[topk], took 77 s on the quiet machine and
#: over 150 s on the loaded one; twice that. A hung test ended there leaves the suites their usual time (473 s
#: with the first set-up) inside the deadline.
TEST_TIMEOUT_S = 300.0
#: What a suite stopped at the deadline is given to write its results after its interrupt, before it is killed.
STOP_GRACE_S = 30.0
OUTPUT_TAIL_CHARS = 3000


def source(name: str) -> Path:
    """The unpacked sdist of client ``name`` (with its tests), downloaded once per machine."""
    version = CLIENTS[name]
    root = Path(cache_dir()) / "clients"
    out = root / f"{name.replace('-', '_')}-{version}"
    if not (out / "tests").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(root),
                f"{name}=={version}",
            ],
            check=True,
        )
        archive = next(root.glob(f"{name.replace('-', '_')}-{version}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    return out


def start(name: str, on_genlm: bool, junit: Path, files: list[str], nice: int = 0) -> SuiteProcess:
    """Start pytest on ``files`` of client ``name``'s suite, writing its results to ``junit`` and its output
    beside them (``.log``): each test named as it starts (``-v``), so that the output of a suite stopped at
    its deadline ends with the test it was in."""
    env = {**os.environ, "GENLM_COMPAT": "on" if on_genlm else "off", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WITHOUT_VLLM), os.environ.get("PYTHONPATH")) if p)
    root = source(name)
    if name in STAND_INS:
        for hub_name, folder in stand_ins().items():
            link = root / hub_name
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(folder, target_is_directory=True)
    command = [sys.executable, "-m", "pytest", "-p", "genlm_compat.pytest_plugin", "-p", "no:cacheprovider", "-v"]
    command += ["--timeout", f"{TEST_TIMEOUT_S:g}", f"--junitxml={junit}", *files]
    return launch(name, files, junit, command, cwd=root, env=env, nice=nice)


def launch(
    name: str, files: list[str], junit: Path, command: list[str], cwd: Path, env: dict[str, str], nice: int = 0
) -> SuiteProcess:
    """Run ``command`` (a pytest run of ``files`` of suite ``name`` that writes ``junit``) in a process group of
    its own, so that it can be stopped with whatever it starts, its output in ``junit``'s ``.log``."""
    with open(junit.with_suffix(".log"), "wb") as output:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
    return SuiteProcess(name, files, junit, process)


def outcomes(name: str, junits: list[Path]) -> dict[str, str]:
    """``{test id: outcome}`` (passed/failed/skipped/error) from the junit files of client ``name``'s runs."""
    found: dict[str, str] = {}
    for junit in junits:
        for case in ET.parse(junit).iter("testcase"):
            test = f"{name}::{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            found[test] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return found


@dataclass
class SuiteProcess:
    """One pytest run of a suite's files (a suite runs in one process, or two: :data:`APART`)."""

    name: str
    files: list[str]
    junit: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)

    def output_tail(self, chars: int = OUTPUT_TAIL_CHARS) -> str:
        """The end of what the process wrote."""
        log = self.junit.with_suffix(".log")
        return log.read_text(errors="replace")[-chars:] if log.exists() else "(no output)"


@dataclass
class SuiteResult:
    """A suite's ``{test id: outcome}``, and why any of its processes gave no results or not all of them."""

    outcomes: dict[str, str]
    problems: list[str] = field(default_factory=list)


@dataclass
class SuiteRuns:
    """Client suites running in processes of their own; :meth:`outcomes` waits for them."""

    runs: list[SuiteProcess]

    def outcomes(self, deadline: float | None = None, grace_s: float = STOP_GRACE_S) -> dict[str, SuiteResult]:
        """Each suite's results, once all its processes have ended or at ``deadline`` (``time.monotonic()``;
        ``None``: no deadline). There a process still running is stopped (:func:`stop_group`: an interrupt,
        and after ``grace_s`` a kill of its process group) and named in its suite's problems with how long
        it ran and the end of its output. What it wrote before it stopped still counts."""
        try:
            for run in self.runs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            late = [run for run in self.runs if run.process.poll() is None]
            ran = {id(run): time.monotonic() - run.started for run in late}
            stop_group([run.process for run in late], grace_s)
        except BaseException:  # interrupted while waiting: leave nothing running
            self.stop()
            raise
        results = {run.name: SuiteResult({}) for run in self.runs}
        for run in self.runs:
            result = results[run.name]
            what = f"{run.name}'s suite ({' '.join(run.files)})"
            if id(run) in ran:
                result.problems.append(
                    f"{what} did not finish by its deadline: stopped after {ran[id(run)]:.0f} s; "
                    f"its output ends:\n{run.output_tail()}"
                )
            elif not run.junit.exists():  # pytest failed before writing results
                result.problems.append(
                    f"{what} exited with {run.process.returncode} and no results; its output ends:\n{run.output_tail()}"
                )
            if run.junit.exists():
                try:
                    result.outcomes.update(outcomes(run.name, [run.junit]))
                except ET.ParseError as error:  # killed while it wrote them
                    result.problems.append(f"{what} left unreadable results ({error})")
        return results

    @property
    def names(self) -> list[str]:
        """The suites, in the order they were started."""
        return list(dict.fromkeys(run.name for run in self.runs))

    def stop(self) -> None:
        """End the processes still running, and what they started (a session that stops early)."""
        stop_group([run.process for run in self.runs if run.process.poll() is None], grace_s=0)


def stop_group(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Interrupt each process's group (pytest then writes the results it has and where it was), wait up to
    ``grace_s`` seconds for them all, then kill the groups: what the processes started ends with them."""
    if not processes:
        return
    if grace_s > 0:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
        end = time.monotonic() + grace_s
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, end - time.monotonic()))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def results_by(
    deadline: float,
    first: SuiteRuns,
    then: list[str],
    start_then: Callable[[list[str]], SuiteRuns],
    grace_s: float = STOP_GRACE_S,
) -> dict[str, SuiteResult]:
    """The results of the suites running in ``first``, then of the suites ``then``, started (``start_then``)
    once ``first``'s have ended: all of them by ``deadline`` (``time.monotonic()``), where what still runs is
    stopped (:meth:`SuiteRuns.outcomes`). A suite of ``then`` that the deadline leaves no time for is not
    started, and says so."""
    found = first.outcomes(deadline, grace_s)
    if not then:
        return found
    if time.monotonic() >= deadline:
        ran = ", ".join(first.names) or "nothing"
        why = f"not started: the deadline passed while the suites before it ran ({ran})"
        return {**found, **{name: SuiteResult({}, [f"{name}'s suite was {why}"]) for name in then}}
    return {**found, **start_then(then).outcomes(deadline, grace_s)}


def start_all(names: list[str], on_genlm: bool, folder: Path, nice: int = 0) -> SuiteRuns:
    """Start the selected files of every suite in ``names`` at once (the files of :data:`APART` in a process
    of their own), ``nice`` steps below this process's CPU priority."""
    runs: list[SuiteProcess] = []
    for name in names:
        apart = APART.get(name, [])
        parts = [p for p in ([f for f in FILES[name] if f not in apart], apart) if p]
        for i, files in enumerate(parts):
            junit = folder / f"{name}-{on_genlm}-{i}.xml"
            runs.append(start(name, on_genlm, junit, files, nice))
    return SuiteRuns(runs)


def main(names: list[str]) -> None:
    """Run ``names`` (default: every suite) on the seeds and on genlm; rewrite their lines of ``seed_passing.txt``."""
    names = names or list(CLIENTS)
    before = SEED_PASSING.read_text().splitlines() if SEED_PASSING.exists() else []
    kept = [t for t in before if t.split("::")[0] not in names]
    passing, rows = [], []
    for name in names:
        results = {}
        for side in (False, True):
            began = time.perf_counter()
            result = start_all([name], side, Path("/tmp")).outcomes()[name]
            if result.problems:
                raise RuntimeError("\n".join(result.problems))
            results[side] = result.outcomes
            results[side, "s"] = time.perf_counter() - began
        for side, label in ((False, "the seeds (genlm-backend, genlm-bytes)"), (True, "genlm (install())")):
            counts = {k: sum(v == k for v in results[side].values()) for k in ("passed", "failure", "error", "skipped")}
            rows.append((name, label, counts, results[side, "s"]))
        passing += sorted(t for t, v in results[False].items() if v == "passed" and t not in FLAKY_ON_SEED)
        lost = sorted(t for t, v in results[False].items() if v == "passed" and results[True].get(t) != "passed")
        print(f"{name}: passing on the seeds but not on genlm: {lost or 'none'}")
    print("| suite | run on | passed | failed | errors | skipped | time |\n|---|---|---|---|---|---|---|")
    for name, label, c, secs in rows:
        print(f"| {name} | {label} | {c['passed']} | {c['failure']} | {c['error']} | {c['skipped']} | {secs:.0f} s |")
    SEED_PASSING.write_text("\n".join(sorted(kept + passing)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
