"""Fresh installs from this repo's wheels, as a new user makes them: each install the README names runs
``genlm backends`` and every runnable example of the README (the Quick start first). And the set-up's example
step resolves, from the registry, only to packages that scripts/constraints.txt pins, so the full set-up
(which passes the same constraints) changes none of them.

One fresh virtualenv, in two states: genlm-core with genlm-hf (transformers resolves to the newest of the
tested range), and genlm-core alone (genlm-hf and accelerate uninstalled) with transformers held at the range's
floor. Each test brings the virtualenv to its own state, so either may run alone or first; sharing it saves
making a virtualenv and installing torch, numpy and numba twice. Only the package registries are used; the
model hub is never reached.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .test_readme import blocks, promised_prints

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.install]

EXAMPLES = blocks("python")  # ```py blocks are illustrative
CONFIG = blocks("toml")[0]  # the model.toml the config example loads
PROMISED = promised_prints(EXAMPLES[0])


def core_transformers_range() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    return Requirement(re.search(r'"(transformers[^"]*)"', text).group(1))  # type: ignore[union-attr]


def run(*cmd: object, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)


def checked(*cmd: object, **kwargs: object) -> str:
    done = run(*cmd, **kwargs)  # type: ignore[arg-type]
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def pip(python: Path, *args: object) -> None:
    """``pip *args`` in ``python``'s virtualenv; an install there writes no bytecode (``--no-compile``): the
    packages are the same, Python compiles what it imports, and compiling every module of torch and
    transformers ahead took about 16 CPU-s of torch's install alone here."""
    extra = ["--no-compile"] if args[:1] == ("install",) else []
    checked(python, "-m", "pip", *args, *extra, "-q")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    checked(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out,
        ROOT, ROOT / "plugins" / "genlm_hf",
    )  # fmt: skip
    return {w.name.split("-")[0]: w for w in out.glob("*.whl")}


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new virtualenv with torch (the CPU wheel, first, as the README says); the tests install the rest."""
    path = tmp_path_factory.mktemp("venv")
    checked(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    pip(python, "install", "torch==2.13.0")
    return python


def user_env(home: Path) -> dict[str, str]:
    """A new user's environment: their own caches, nothing of this test run's plugin selection or path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENLM_", "HF_", "PYTEST", "PYTHONPATH"))}
    return {**env, "HOME": str(home), "HF_HOME": str(home / "hf"), "GENLM_CACHE_DIR": str(home / "genlm")}


def check_readme_runs(python: Path, home: Path, backends: set[str]) -> None:
    env = user_env(home)
    listing = checked(python.parent / "genlm", "backends", "--check", env=env, cwd=home)
    rows = {line.split()[0]: line for line in listing.splitlines()[2:] if line.strip() and "kind" not in line}
    assert backends <= {name for name, row in rows.items() if " yes " in row}, listing
    assert "failed to load" not in listing, listing
    (home / "model.toml").write_text(CONFIG)
    printed = checked(python, "-c", "\n".join(EXAMPLES), env=env, cwd=home).splitlines()
    assert PROMISED and printed[: len(PROMISED)] == PROMISED, printed  # the Quick start prints what it says


def installed_transformers(python: Path) -> Version:
    return Version(checked(python, "-c", "import transformers; print(transformers.__version__)").strip())


def test_core_and_hf_alone_run_the_readme(fresh_venv, wheels, tmp_path):
    python = fresh_venv
    pip(python, "install", wheels["genlm_core"], wheels["genlm_hf"])
    home = tmp_path / "home"
    home.mkdir()
    check_readme_runs(python, home, {"mock", "hf"})
    assert installed_transformers(python) in core_transformers_range().specifier
    # the offline model needs one more package: the error names it, at once and in one line
    done = run(python.parent / "genlm", "continue", "smollm2", "hi", "-b", "hf", env=user_env(home), cwd=home)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.strip().endswith("needs gguf: pip install gguf"), done.stderr


def test_core_alone_runs_the_readme_on_the_oldest_tested_transformers(fresh_venv, wheels, tmp_path):
    floor = next(s.version for s in core_transformers_range().specifier if s.operator == ">=")
    python = fresh_venv
    pip(python, "uninstall", "-y", "genlm-hf", "accelerate")  # where the test above ran
    pip(python, "install", wheels["genlm_core"], f"transformers=={floor}")
    assert "genlm-hf" not in checked(python, "-m", "pip", "list")
    home = tmp_path / "home"
    home.mkdir()
    check_readme_runs(python, home, {"mock"})
    assert installed_transformers(python) == Version(floor)


def test_the_example_steps_resolution_is_pinned_by_the_constraints_the_full_set_up_passes(tmp_path):
    """``bash scripts/bootstrap.sh example``'s two installs, resolved from scratch (``--dry-run --report
    --ignore-installed``: pip reads the wheels' metadata files, it downloads no large wheel) with the
    constraints: every package they would install is pinned there, at the version the full set-up resolves
    (tests/test_bootstrap.py checks this virtualenv against the pins). A package the example step starts to
    pull that is not pinned would float, and the full set-up could then change it."""
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    steps = [["torch==2.13.0"], ["-e", ".", "-e", "plugins/genlm_hf", "gguf"]]
    for step in steps:  # the commands this test resolves are the script's
        assert f"pip_install {' '.join(step)}\n" in bootstrap, step
    assert "constraints=(-c scripts/constraints.txt)" in bootstrap
    report = tmp_path / "report.json"
    checked(
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", report,
        "-c", ROOT / "scripts" / "constraints.txt", *steps[0], *steps[1], cwd=ROOT,
    )  # fmt: skip
    pins = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            name, version = line.split("#")[0].strip().split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = SpecifierSet(f"=={version}")
    resolved = {
        re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): Version(item["metadata"]["version"])
        for item in json.loads(report.read_text())["install"]
        if not item["download_info"].get("dir_info", {}).get("editable")
    }
    assert resolved, "the dry run resolved nothing"
    unpinned = {name: str(v) for name, v in resolved.items() if name not in pins}
    assert not unpinned, (
        f"the example step would install these unpinned (add them to scripts/constraints.txt): {unpinned}"
    )
    # what -c guarantees, checked: == without a local label matches torch's 2.13.0+cpu
    assert all(v in pins[name] for name, v in resolved.items()), {
        n: (str(v), str(pins[n])) for n, v in resolved.items()
    }
