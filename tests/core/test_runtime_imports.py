"""Runtime modules never use a test kit, a developer tool or another plugin: genlm-core's and every plugin's.

A package's kits are its ``testing`` and ``tools`` (a module or a subpackage; core's ``genlm_core.testing``,
genlm-llamacpp's ``genlm_llamacpp.testing``, genlm-hf's and genlm-vllm's ``tools``) and genlm-compat's pytest
plugin: they may import the runtime, not the other way round. A plugin's runtime imports core and itself only;
core's runtime imports no plugin. Every import counts, function-level and ``TYPE_CHECKING`` ones included, and so
do lazy ``"module:attr"`` references (a registered factory, check or name resolver would import it at run time).
Read from the sources, so this runs without any plugin installed. Each check also runs on planted offences.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Every import package of this repository's distributions: name -> folder.
PACKAGES = {
    p.name: p
    for p in [
        ROOT / "genlm_core",
        *sorted((ROOT / "plugins").glob("*/genlm_*")),
        ROOT / "examples" / "plugin_template" / "genlm_example",
    ]
    if (p / "__init__.py").exists()
}
#: A package's test kit and developer tools, by the name of its module or subpackage.
KIT_NAMES = ("testing", "tools")
#: Kits by another name: the pytest plugin the client suites run under (``pytest -p genlm_compat.pytest_plugin``).
OTHER_KITS = ("genlm_compat.pytest_plugin",)
KITS = (*(f"{package}.{kit}" for package in PACKAGES for kit in KIT_NAMES), *OTHER_KITS)


def within(module: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def is_kit(module: str) -> bool:
    return within(module, KITS)


def not_at_runtime(package: str) -> tuple[str, ...]:
    """What a runtime module of ``package`` may not import: every kit (its own too), and every other package of
    the repository but core."""
    return (*KITS, *(p for p in PACKAGES if p not in (package, "genlm_core")))


def package_modules(package: str) -> dict[str, Path]:
    folder = PACKAGES[package]
    return {
        ".".join((package, *p.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in sorted(folder.rglob("*.py"))
    }


def runtime_modules(package: str) -> dict[str, Path]:
    return {m: p for m, p in package_modules(package).items() if not is_kit(m)}


def uses(source: str, module: str, is_package: bool, forbidden: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, what) for every import of, or lazy reference to, a module within ``forbidden`` in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if within(a.name, forbidden)]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            names = [f"{target}.{a.name}" for a in node.names]
            if within(target, forbidden) or any(within(n, forbidden) for n in names):
                found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import ..."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if within(node.value.split(":")[0], forbidden):
                found.append((node.lineno, f"reference {node.value!r}"))
    return found


def offences(package: str, sources: dict[str, str] | None = None) -> list[str]:
    """``module:line: what`` for each use of a kit, a tool or another plugin by a runtime module of ``package``
    (its sources as they are, or as in ``sources``: module -> source, for the modules it names)."""
    sources = sources or {}
    found = []
    for module, path in runtime_modules(package).items():
        source = sources.get(module) or path.read_text(encoding="utf-8")
        for line, what in sorted(uses(source, module, path.name == "__init__.py", not_at_runtime(package))):
            found.append(f"{module}:{line}: {what}")
    return found


def test_the_check_sees_every_kind_of_use():
    source = '''
import genlm_core.testing
from genlm_core.testing.tokenizers import load_tokenizer
from genlm_core import testing
from .. import testing as kit
from ..testing import models

def later():
    from genlm_core.testing.models import smollm2_dir

register_check = "genlm_core.testing:no_such_check"
from genlm_core.assets import load_tokenizer  # fine: a runtime module
"""A docstring may mention genlm_core.testing."""
'''
    lines = [line for line, _ in uses(source, "genlm_core.trie.example", False, not_at_runtime("genlm_core"))]
    assert lines == [2, 3, 4, 5, 6, 9, 11]
    runtime = runtime_modules("genlm_core")
    assert len(runtime) > 30 and "genlm_core.mock" in runtime and "genlm_core.testing.models" not in runtime


def test_every_plugin_and_its_kits_are_seen():
    assert {"genlm_hf", "genlm_llamacpp", "genlm_vllm", "genlm_mlx", "genlm_compat", "genlm_example"} < set(PACKAGES)
    assert "genlm_hf.tools.contract" in package_modules("genlm_hf")
    assert "genlm_hf.tools.contract" not in runtime_modules("genlm_hf") and "genlm_hf.lm" in runtime_modules("genlm_hf")
    assert "genlm_llamacpp.testing" not in runtime_modules("genlm_llamacpp")
    assert "genlm_llamacpp.files" in runtime_modules("genlm_llamacpp")
    assert "genlm_compat.pytest_plugin" not in runtime_modules("genlm_compat")


@pytest.mark.parametrize("package", ["genlm_hf", "genlm_llamacpp"])
def test_a_planted_use_of_a_kit_tool_or_other_plugin_is_found(package):
    """Each kind of offence, planted in a real runtime module's source, is named with its module and line."""
    module = {"genlm_hf": "genlm_hf.lm", "genlm_llamacpp": "genlm_llamacpp.files"}[package]
    kit = {"genlm_hf": "tools", "genlm_llamacpp": "testing"}[package]
    source = runtime_modules(package)[module].read_text(encoding="utf-8")
    n = source.count("\n")
    planted = source + (
        "\n\ndef _smollm2():\n"
        f"    from .{kit} import anything\n"  # its own kit, relative
        "    from genlm_core.testing.models import smollm2_dir\n"  # core's kit, in a function
        "    import genlm_vllm.tools.contract\n"  # another plugin's tool
        "    from genlm_mlx import AsyncMLX\n"  # another plugin
        f'    return "{package}.{kit}:anything"\n'  # a lazy reference
    )
    real = offences(package)
    assert [o for o in offences(package, {module: planted}) if o not in real] == [
        f"{module}:{n + 4}: from .{kit} import ...",
        f"{module}:{n + 5}: from genlm_core.testing.models import ...",
        f"{module}:{n + 6}: import genlm_vllm.tools.contract",
        f"{module}:{n + 7}: from genlm_mlx import ...",
        f"{module}:{n + 8}: reference '{package}.{kit}:anything'",
    ]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_runtime_module_uses_a_kit_tool_or_other_plugin(package):
    found = offences(package)
    assert found == [], f"runtime modules of {package} use a test kit, a tool or another plugin:\n" + "\n".join(found)
