"""Check a transformers release's own sources against what genlm-hf relies on, without importing it.

    python -m genlm_hf.tools.contract --installed        # the transformers installed here
    python -m genlm_hf.tools.contract --newest           # the newest release of TESTED (downloaded once)
    python -m genlm_hf.tools.contract 'transformers==5.19.0'

Every entry of :data:`genlm_hf.transformers_api.INTERFACES` is looked up in the release's ``.py`` files
with :mod:`ast` (along base classes, following imports within transformers): it exists, a call passes
no parameter it lacks and omits none it requires, an overridden method's leading parameters are ours
in our order, and its instances carry the attributes we read or set. A problem is one line naming the
internal, the file, and what :mod:`genlm_hf.transformers_api` uses it for.

A developer tool, apart from genlm-hf's runtime: it reads sources with :mod:`genlm_core.testing.sources`
(part of genlm-core, standard library only; releases are fetched with ``pip download``), so it needs no
extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from genlm_core.testing.sources import Sources, installed_sources, release_version, wheel_sources
from genlm_hf.transformers_api import INTERFACES, TESTED, Interface


def newest_sources() -> Path:
    """The sources of the newest transformers release in :data:`~genlm_hf.transformers_api.TESTED`."""
    return wheel_sources("transformers", f"transformers{TESTED}")


def check(root: Path) -> list[str]:
    """The problems of the transformers sources under ``root`` (the ``transformers`` folder); [] if none."""
    sources = Sources(root)
    return [problem for interface in INTERFACES for problem in check_one(sources, interface)]


def check_one(sources: Sources, interface: Interface) -> list[str]:
    """What is wrong with one declared internal in ``sources`` (nothing: [])."""
    where = f"transformers/{interface.path}: {interface.qualname}"
    if sources.find(interface.path, interface.qualname) is None:
        return [f"{where} is missing (used by {interface.why})"]
    problems = []
    params = sources.parameters(interface.path, interface.qualname)
    if params is not None:
        if interface.overridden:
            if params[: len(interface.params)] != list(interface.params):
                problems.append(
                    f"{where} takes {params}, but our override takes {list(interface.params)} first ({interface.why})"
                )
        else:
            missing = [p for p in interface.params if p not in params]  # not left to **kwargs: named
            if missing:
                problems.append(f"{where} has no parameter {', '.join(missing)} ({interface.why})")
            required = sources.required_parameters(interface.path, interface.qualname) or []
            extra = [p for p in required if p not in interface.params]
            if extra:
                problems.append(f"{where} requires {', '.join(extra)}, which we do not pass ({interface.why})")
    elif interface.params:
        problems.append(f"{where} is not a function ({interface.why})")
    if interface.attributes:
        carried = sources.attributes(interface.path, interface.qualname)
        lacking = [a for a in interface.attributes if a not in carried]
        if lacking:
            problems.append(f"{where} has no attribute {', '.join(lacking)} ({interface.why})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m genlm_hf.tools.contract", description=__doc__.splitlines()[0])
    parser.add_argument("requirements", nargs="*", help="releases to download and check ('transformers==5.19.0')")
    parser.add_argument("--installed", action="store_true", help="check the transformers installed here")
    parser.add_argument("--newest", action="store_true", help=f"check the newest release of transformers{TESTED}")
    args = parser.parse_args(argv)
    roots = [installed_sources("transformers")] if args.installed else []
    roots += [newest_sources()] if args.newest else []
    roots += [wheel_sources("transformers", r) for r in args.requirements]
    if not roots:
        parser.error("name a release, or --installed, or --newest")
    failed = False
    for root in roots:
        problems = check(root)
        print(f"transformers {release_version(root) or '?'} ({root}): {'ok' if not problems else 'PROBLEMS'}")
        for problem in problems:
            print(f"  {problem}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
