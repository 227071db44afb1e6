"""Start-up a person notices: ``genlm backends``, ``genlm backends --check`` and a mistyped model name, each
command a fresh process, as a person runs it, interleaved round by round (A, B, C, ... A, B, C, ...).

Rows:

- ``python -c pass``: the interpreter's own start, the floor of any command;
- ``import torch``: what importing torch alone costs here (what ``genlm backends`` must not pay);
- ``genlm backends``: the listing (entry points, distribution metadata, the plugins' registrations; no engine);
- ``genlm backends --check``: also imports every backend and trie engine and asks what it can do here;
- ``genlm logprobs gpt3-typo x -b hf`` with ``HF_HUB_OFFLINE=1``: a mistyped model name, which fails in one
  line before anything imports the engine (with the hub reachable or refusing, the probe adds up to 1.5 s);
- with ``--base REV``: ``genlm backends`` and the mistyped name at that revision too (its ``genlm_core`` and
  plugin packages extracted with ``git archive`` and put first on ``PYTHONPATH``; the installed distributions'
  metadata, hence the entry points, are the same).

Each row gives the median wall time, the p25-p75 spread, the ratio to the interpreter's start, and which of
torch, transformers, vllm, mlx.core, mlx_lm, llama_cpp and numba the command imported (one more run, the command under a
wrapper that prints ``sys.modules`` at exit).

    python benchmarks/bench_startup.py [--rounds 5] [--base REV]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, fmt_s

from genlm_core.cli import table

HEAVY = ("torch", "transformers", "vllm", "mlx.core", "mlx_lm", "llama_cpp", "numba")
#: The packages of the working tree that a ``genlm`` command imports, and where each lives.
PACKAGES = [
    "genlm_core",
    "plugins/genlm_hf/genlm_hf",
    "plugins/genlm_vllm/genlm_vllm",
    "plugins/genlm_mlx/genlm_mlx",
    "plugins/genlm_llamacpp/genlm_llamacpp",
    "plugins/genlm_compat/genlm_compat",
    "examples/plugin_template/genlm_example",
]
#: The console script ``genlm`` (``genlm_core.cli:main``), run by the interpreter under test.
GENLM = "import sys; from genlm_core.cli import main; sys.exit(main(sys.argv[1:]))"
#: The same, then the heavy modules it imported, on stderr's last line.
WRAPPED = (
    "import sys\nfrom genlm_core.cli import main\ntry:\n    code = main(sys.argv[1:])\nfinally:\n"
    f"    print('imported:', ' '.join(m for m in {HEAVY!r} if m in sys.modules) or 'none', file=sys.stderr)\n"
    "sys.exit(code)"
)
TYPO = ["logprobs", "gpt3-typo", "x", "-b", "hf"]


def pythonpath(tree: Path) -> str:
    return ":".join(str(tree / Path(p).parent) for p in PACKAGES)


def run(argv: list[str], path: str | None, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    full = {**env, "PYTHONPATH": path} if path is not None else env
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=full, timeout=600)
    return time.perf_counter() - start, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="fresh processes per command (default: 5)")
    ap.add_argument("--base", default=None, help="also time the listing and the typo at this revision")
    opts = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GENLM_PLUGINS")}
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    ours = pythonpath(ROOT)
    commands: dict[str, tuple[list[str], list[str] | None, str | None, dict[str, str]]] = {
        "python -c pass": (["-c", "pass"], None, None, env),
        "import torch": (["-c", "import torch"], None, None, env),
        "genlm backends": (["-c", GENLM, "backends"], ["-c", WRAPPED, "backends"], ours, env),
        "genlm backends --check": (
            ["-c", GENLM, "backends", "--check"],
            ["-c", WRAPPED, "backends", "--check"],
            ours,
            env,
        ),
        "genlm logprobs gpt3-typo (offline)": (["-c", GENLM, *TYPO], ["-c", WRAPPED, *TYPO], ours, offline),
    }
    with tempfile.TemporaryDirectory() as old:
        if opts.base:
            archive = subprocess.run(
                ["git", "archive", opts.base, *PACKAGES], cwd=ROOT, capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
            base = pythonpath(Path(old))
            commands[f"genlm backends at {opts.base}"] = (
                ["-c", GENLM, "backends"],
                ["-c", WRAPPED, "backends"],
                base,
                env,
            )
            commands[f"genlm logprobs gpt3-typo (offline) at {opts.base}"] = (
                ["-c", GENLM, *TYPO],
                ["-c", WRAPPED, *TYPO],
                base,
                offline,
            )
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(opts.rounds):
            for name, (argv, _, path, cmd_env) in commands.items():
                seconds, done = run(argv, path, cmd_env)
                expected = 2 if "typo" in name else 0
                if done.returncode != expected:
                    raise SystemExit(
                        f"{name}: exit status {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
                    )
                times[name].append(seconds)
        imported = {}
        for name, (_, wrapped, path, cmd_env) in commands.items():
            if wrapped is None:
                imported[name] = "-"
                continue
            _, done = run(wrapped, path, cmd_env)
            imported[name] = done.stderr.strip().splitlines()[-1].removeprefix("imported: ")
    floor = statistics.median(times["python -c pass"])
    rows = []
    for name, seconds in times.items():
        q = statistics.quantiles(seconds, n=4) if len(seconds) >= 2 else [seconds[0]] * 3
        rows.append(
            [
                name,
                fmt_s(statistics.median(seconds)),
                f"{fmt_s(q[0])} - {fmt_s(q[2])}",
                f"{statistics.median(seconds) / floor:.1f}x",
                imported[name],
            ]
        )
    cpus = len(os.sched_getaffinity(0))
    print(f"start-up, fresh processes, {opts.rounds} rounds interleaved, {cpus} CPU(s), {sys.executable}")
    print(table(["command", "median", "p25 - p75", "/ python -c pass", "heavy modules imported"], rows))


if __name__ == "__main__":
    main()
