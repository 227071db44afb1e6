"""Plugins are written against core's public API only: no underscore name of genlm_core is used by
any plugin in this repo or by the out-of-tree template."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_SOURCES = [*ROOT.glob("plugins/*/genlm_*/**/*.py"), *ROOT.glob("examples/plugin_template/**/*.py")]


def private_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, attributes set on self, module globals."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


CORE_PRIVATE = set().union(*(private_names(ast.parse(p.read_text())) for p in (ROOT / "genlm_core").rglob("*.py")))


def uses_of_core_private(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in CORE_PRIVATE and node.attr not in own:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("genlm_core"):
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_")
            ]
    return found


def test_the_check_sees_plugin_sources_and_core_private_names():
    assert len(PLUGIN_SOURCES) >= 8 and {"_pending", "_closed"} <= CORE_PRIVATE


def test_no_plugin_uses_an_underscore_name_of_core():
    offenders = [use for path in PLUGIN_SOURCES for use in uses_of_core_private(path)]
    assert offenders == [], "plugins use core's private names:\n" + "\n".join(offenders)


def test_every_public_name_of_core_imports_from_the_package():
    """``genlm_core`` imports its public names on first use (nothing heavy at import): each one still
    imports from the package, is the object its module defines, and is listed by ``dir``."""
    import importlib

    import genlm_core

    namespace: dict = {}
    exec("from genlm_core import *", namespace)
    assert set(genlm_core.__all__) <= set(namespace) and len(genlm_core.__all__) >= 35
    for name in genlm_core.__all__:
        homes = [m for m in CORE_MODULES if getattr(importlib.import_module(m), name, None) is namespace[name]]
        assert homes, f"genlm_core.{name} is no module's {name}"
    assert set(genlm_core.__all__) <= set(dir(genlm_core))
    assert not hasattr(genlm_core, "NoSuchName")


#: The modules whose names ``genlm_core`` re-exports.
CORE_MODULES = [
    f"genlm_core.{p.stem}" for p in (ROOT / "genlm_core").glob("*.py") if p.stem not in ("__init__", "cli")
] + ["genlm_core.tokenization"]
