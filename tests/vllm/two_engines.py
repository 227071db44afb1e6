"""One of the two engines ``test_shm_files.py`` starts at the same moment: a multiprocess vLLM engine on the
tiny model, whose /dev/shm files this script reports while the engine runs and after it is closed.

Run as ``python two_engines.py MODEL GO OUT OPTIONS``: waits for the file GO, starts the engine, computes the
rows of a few contexts, writes a JSON report to OUT, waits for OUT + ".close", computes the rows again, closes the
engine and writes what it left to OUT + ".closed"."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Any

import psutil

from genlm_core import load_model_by_name
from genlm_vllm.start.files import ENGINE_MARK, engine_files
from genlm_vllm.transport.shm import FILE_PREFIX, SHM_DIR

CONTEXTS = [[1, 2, 3], [4, 5, 6, 7], [8]]


def used_by(processes: list[psutil.Process]) -> set[str]:
    """The /dev/shm files these processes map or hold open, that are still there."""
    used: set[str] = set()
    for process in processes:
        try:
            used.update(m.path for m in process.memory_maps(grouped=False) if m.path.startswith(SHM_DIR + "/"))
            used.update(f.path for f in process.open_files() if f.path.startswith(SHM_DIR + "/"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {p for p in used if os.path.exists(p)}  # not those unlinked since (psutil drops " (deleted)")


def write(path: str, report: dict) -> None:
    """Whole or not at all: the test polls for the file."""
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def main(model: str, go: str, out: str, options: str) -> None:
    while not os.path.exists(go):
        time.sleep(0.005)
    lm: Any = load_model_by_name(model, backend="vllm", llm_opts=json.loads(options))  # genlm-vllm's: .driver
    rows = [lm.next_token_logprobs_sync(c).tolist() for c in CONTEXTS]
    me = psutil.Process()
    engine = [p for p in me.children(recursive=True) if p.name().startswith("VLLM::")]
    tag = lm.driver.files.tag
    mine = lm.driver.files.files()  # with its tag, or used by its processes once it had started
    tagged = {p for p in mine if f"{ENGINE_MARK}{tag}-" in p}
    slots = {os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith(f"{FILE_PREFIX}{os.getpid()}-")}
    used = used_by([me, *engine])
    files = {}
    for path in mine | slots | used:
        try:
            files[path] = oct(stat.S_IMODE(os.stat(path).st_mode))
        except FileNotFoundError:
            continue
    report = {
        "tag": tag,
        "engine_processes": len(engine),
        "files": files,  # path -> mode, of every file of the engine's while it runs
        "tagged": sorted(tagged),
        "not_the_engines": sorted(used - mine - slots),  # used by the engine's processes, and not its own
        "rows": rows,
        "contexts": CONTEXTS,
    }
    write(out, report)
    while not os.path.exists(out + ".close"):
        time.sleep(0.01)
    again = [lm.next_token_logprobs_sync(c).tolist() for c in CONTEXTS]  # after the other engine closed, maybe
    lm.cleanup()
    psutil.wait_procs(engine, timeout=30)
    left = sorted(p for p in mine | slots | set(engine_files(tag)) if os.path.exists(p))
    write(out + ".closed", {"left": left, "rows": again})


if __name__ == "__main__":
    main(*sys.argv[1:5])
