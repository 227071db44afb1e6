"""Runtime modules of genlm_core never use the testing kit: ``genlm_core.testing`` may import them, not the
other way round. Every import counts, function-level and ``TYPE_CHECKING`` ones included, and so do lazy
``"genlm_core.testing..."`` references (a registered factory or check would import it at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "genlm_core"
TESTING = CORE / "testing"
RUNTIME = sorted(p for p in CORE.rglob("*.py") if TESTING not in p.parents)


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_testing(module: str) -> bool:
    return module == "genlm_core.testing" or module.startswith("genlm_core.testing.")


def uses_of_testing(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, what) for every import of, or lazy reference to, ``genlm_core.testing`` in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if is_testing(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            names = [f"{target}.{a.name}" for a in node.names]
            if is_testing(target) or any(is_testing(n) for n in names):
                found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import ..."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_testing(node.value.split(":")[0]):
            found.append((node.lineno, f"reference {node.value!r}"))
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
    lines = [line for line, _ in uses_of_testing(source, "genlm_core.trie.example")]
    assert lines == [2, 3, 4, 5, 6, 9, 11]
    assert len(RUNTIME) > 30 and CORE / "mock.py" in RUNTIME and CORE / "testing" / "models.py" not in RUNTIME


def test_no_runtime_module_uses_the_testing_kit():
    offenders = [
        f"{path.relative_to(CORE.parent)}:{line}: {what}"
        for path in RUNTIME
        for line, what in uses_of_testing(path.read_text(), module_name(path), path.name == "__init__.py")
    ]
    assert offenders == [], "runtime modules use genlm_core.testing:\n" + "\n".join(offenders)
