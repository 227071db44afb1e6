"""genlm-vllm's layout holds: its parts import one way, the tools stay apart from the runtime, and the
runtime imports no test kit and no undeclared plugin.

Read from the sources (every import counts, function-level ones too), so these run without vLLM.
Each check is also run on a planted offence, so that it is seen to fail.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "genlm_vllm" / "genlm_vllm"

#: The parts of the package, in the one order their imports may run (a part imports only parts after
#: it). Top-level modules are parts of their own.
ORDER = [
    "__init__",
    "lm",
    "drivers",
    "live",
    "start",
    "plugin",
    "options",
    "layout",
    "in_engine",
    "transport",
    "vllm_api",
]
#: What no runtime module may import: the developer tools, core's test kits, other plugins.
NOT_AT_RUNTIME = ("genlm_vllm.tools", "genlm_core.testing", "genlm_hf", "genlm_llamacpp", "genlm_mlx", "genlm_compat")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` imports (``from a import b`` counts as ``a.b``; relative imports resolved)."""
    found: set[str] = set()
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def package_imports(sources: dict[str, tuple[str, bool]] | None = None) -> dict[str, set[str]]:
    """Module -> what it imports, for every module of the package (or of ``sources``)."""
    if sources is None:
        sources = {
            module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")
        }
    return {m: imports(src, m, pkg) for m, (src, pkg) in sources.items()}


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a part by a part before it in :data:`ORDER` (a circle's way back)."""
    rank = {name: i for i, name in enumerate(ORDER)}
    wrong = []
    for module, targets in graph.items():
        for target in targets:
            if not target.startswith("genlm_vllm.") and target != "genlm_vllm":
                continue
            a, b = part(module), part(target)
            if target == "genlm_vllm" or a == b or a not in rank or b not in rank:
                continue
            if rank[b] <= rank[a]:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def runtime_offences(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if part(m) != "tools"
        for t in targets
        if any(t == bad or t.startswith(bad + ".") for bad in NOT_AT_RUNTIME)
    )


def test_every_part_is_placed():
    parts = {part(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts - {"tools"} == set(ORDER), "place a new part of genlm_vllm in ORDER"


def test_parts_import_one_way():
    assert backward_imports(package_imports()) == []


def test_a_planted_circle_is_found():
    graph = package_imports()
    graph["genlm_vllm.transport.keys"] = graph["genlm_vllm.transport.keys"] | {"genlm_vllm.live"}
    assert backward_imports(graph) == ["genlm_vllm.transport.keys -> genlm_vllm.live"]


def test_the_runtime_imports_no_tool_test_kit_or_other_plugin():
    assert runtime_offences(package_imports()) == []


def test_a_planted_runtime_import_of_a_test_kit_is_found():
    planted = {"genlm_vllm.live": ("def f():\n    from genlm_core.testing import bounds\n", False)}
    assert "genlm_vllm.live -> genlm_core.testing" in runtime_offences(package_imports(planted))


def test_modules_import_in_no_circle():
    graph = package_imports()
    modules = set(graph)
    edges = {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}
    state: dict[str, int] = collections.defaultdict(int)
    circles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in edges[m]:
            if state[t] == 1:
                circles.append([*path[path.index(t) :], t])
            elif state[t] == 0:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(edges):
        if state[m] == 0:
            visit(m, [m])
    assert circles == []


def test_the_self_test_declares_genlm_hf():
    """The self-test compares against genlm-hf: an extra of genlm-vllm's, not a runtime dependency."""
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert not any(d.startswith("genlm-hf") for d in project["dependencies"])
    assert any(d.startswith("genlm-hf") for d in project["optional-dependencies"]["selftest"])
