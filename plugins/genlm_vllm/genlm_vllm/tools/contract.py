"""Check a vLLM release's own Python sources against what genlm-vllm relies on, without running it.

    python -m genlm_vllm.tools.contract 0.33.0 0.32.0     # CUDA wheels from PyPI (sources kept, wheel dropped)
    python -m genlm_vllm.tools.contract --installed       # the vLLM installed here

The CUDA build cannot run on a machine without a GPU, but its sources can be read. Checked, with
:mod:`ast` (nothing of the release is imported):

1. every name :mod:`genlm_vllm.vllm_api` imports from ``vllm`` (lazy imports too) exists there;
2. every :data:`~genlm_vllm.vllm_api.manifest.INTERFACES` entry exists (classes, functions, methods,
   settings in ``envs.py``), accepts the parameters we pass by name (or, for a method we override, those
   our override takes), and has the attributes we read (along its bases, wherever they are defined);
3. each vLLM class we subclass (both logits-processor interfaces, the KV-connector base) has no
   abstract method our class leaves out, and every method we override takes the parameters the
   release's base declares, in its order.

Some supported releases lack a part of vLLM's internals (:data:`~genlm_vllm.vllm_api.manifest.FEATURES`:
vLLM 0.26 has no logits-processor interface in Model Runner V2, for one). Whether a release has
each feature is read from its sources; what genlm-vllm uses with the feature is checked where the
release has it, and what it uses instead where it does not. The report names the features a release
lacks and what genlm-vllm does there.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from genlm_vllm.transport.keys import CONNECTOR, CONNECTOR_MODULE, PROCESSORS

#: vLLM classes genlm-vllm subclasses (source file, class) -> (our class, "module:Class" as vLLM loads
#: it; the feature it needs, "" for none).
SUBCLASSES = {
    ("v1/sample/logits_processor/interface.py", "LogitsProcessor"): (PROCESSORS["v1"], ""),
    ("v1/worker/gpu/sample/logits_processor/interface.py", "LogitsProcessor"): (
        PROCESSORS["v2"],
        "v2-logits-processors",
    ),
    ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1"): (f"{CONNECTOR_MODULE}:{CONNECTOR}", ""),
    ("distributed/kv_transfer/kv_connector/v1/base.py", "SupportsHMA"): (f"{CONNECTOR_MODULE}:{CONNECTOR}", ""),
}


def release_sources(requirement: str, cache: Path | None = None) -> Path:
    """The ``vllm`` package folder of a release's wheel (``"vllm==0.33.0"``): downloaded once with
    ``pip download --no-deps``, its ``.py`` files kept in the genlm cache, the wheel removed."""
    from genlm_core.testing.tokenizers import cache_dir

    target = (cache or cache_dir() / "vllm-sources") / requirement.replace("==", "-")
    if (target / "vllm" / "__init__.py").exists():
        return target / "vllm"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {requirement}: {done.stderr.strip()[-500:]}")
        out = Path(tmp) / "out"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(out, [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        wheels[0].unlink()
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)  # atomic: a concurrent run sees all of it or none
    return target / "vllm"


def installed_sources() -> Path:
    """The ``vllm`` package folder installed here."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vllm is not installed")
    return Path(spec.origin).parent


@dataclass
class Release:
    """A release's sources, parsed on demand."""

    root: Path  #: the ``vllm`` package folder
    _trees: dict[Path, ast.Module | None] = field(default_factory=dict)

    def tree(self, path: str) -> ast.Module | None:
        file = self.root / path
        if file not in self._trees:
            self._trees[file] = ast.parse(file.read_text(encoding="utf-8"), str(file)) if file.exists() else None
        return self._trees[file]

    def module_path(self, module: str) -> str | None:
        """``"vllm.v1.request"`` -> ``"v1/request.py"`` (or its package ``__init__.py``), if it exists."""
        parts = module.split(".")[1:]
        for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
            if (self.root / candidate).exists():
                return candidate
        return None

    def definition(self, path: str, name: str, depth: int = 0) -> ast.AST | str | None:
        """The top-level definition of ``name`` in a source file, following re-exports within vLLM;
        a submodule's path for a module; None if the file lacks it."""
        tree = self.tree(path)
        if tree is None or depth > 8:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return node
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                for alias in node.names:
                    if (alias.asname or alias.name) != name:
                        continue
                    source = _absolute(node, path)
                    if not source.startswith("vllm"):
                        return node  # defined outside vLLM (e.g. a typing name): it exists
                    found = self.module_path(source)
                    if found is not None and (hit := self.definition(found, alias.name, depth + 1)) is not None:
                        return hit
                    return self.module_path(f"{source}.{alias.name}")
        return self.module_path(_module_of(path) + "." + name)  # a submodule of a package

    def member(self, path: str, qualname: str) -> ast.AST | str | None:
        """``"Class.method"`` (looked up along base classes in vLLM) or a top-level name."""
        head, _, rest = qualname.partition(".")
        node = self.definition(path, head)
        if not rest:
            return node
        if not isinstance(node, ast.ClassDef):
            return None
        found = _class_member(node, rest)
        if found is not None:
            return found
        path = self._origin(path, head) or path  # bases are named as the class's own file imports them
        for base in node.bases:
            base_name = (
                base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            )
            if base_name is None:
                continue
            origin = self._origin(path, base_name)
            if origin is not None and (hit := self.member(origin, f"{base_name}.{rest}")) is not None:
                return hit
        return None

    def _origin(self, path: str, name: str) -> str | None:
        """The source file that defines ``name`` as seen from ``path``."""
        tree = self.tree(path)
        if tree is None:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return path
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = self.module_path(_absolute(node, path))
                        return None if source is None else (self._origin(source, alias.name) or source)
        return None

    def class_members(self, path: str, name: str) -> dict[str, ast.AST]:
        """Every member of a class along its vLLM bases (nearest first wins)."""
        node = self.definition(path, name)
        if not isinstance(node, ast.ClassDef):
            return {}
        path = self._origin(path, name) or path  # bases are named as the class's own file imports them
        members: dict[str, ast.AST] = {}
        for base in node.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            origin = self._origin(path, base_name) if base_name else None
            if origin is not None and base_name is not None:
                members.update(self.class_members(origin, base_name))
        members.update(_own_members(node))
        return members


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Top-level statements, including those under ``if``/``try`` (TYPE_CHECKING imports, fallbacks)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.If | ast.Try):
            stack[:0] = [
                *node.body,
                *getattr(node, "orelse", []),
                *[s for h in getattr(node, "handlers", []) for s in h.body],
            ]
        else:
            yield node


def _module_of(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["vllm", *parts])


def _absolute(node: ast.ImportFrom, path: str) -> str:
    if not node.level:
        return node.module or ""
    package = _module_of(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join([*package, node.module] if node.module else package)


def _own_members(node: ast.ClassDef) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            members[item.name] = item
            for sub in ast.walk(item):  # self.x = ... in any method
                targets = (
                    sub.targets
                    if isinstance(sub, ast.Assign)
                    else [sub.target]
                    if isinstance(sub, ast.AnnAssign)
                    else []
                )
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        members.setdefault(t.attr, sub)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members[item.target.id] = item
        elif isinstance(item, ast.Assign):
            for t in item.targets:
                if isinstance(t, ast.Name):
                    members[t.id] = item
    return members


def _class_member(node: ast.ClassDef, name: str) -> ast.AST | None:
    return _own_members(node).get(name)


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], bool]:
    """(parameter names in order, without self/cls; whether it takes ``**kwargs``)."""
    args = node.args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names, args.kwarg is not None


def _is_abstract(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        (isinstance(d, ast.Name) and d.id == "abstractmethod")
        or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
        for d in node.decorator_list
    )


def _vllm_imports() -> list[tuple[str, str]]:
    """Every ``from vllm... import name`` in :mod:`genlm_vllm.vllm_api`, lazy imports included."""
    from genlm_vllm.vllm_api import release

    trees = [ast.parse(p.read_text(encoding="utf-8")) for p in sorted(Path(release.__file__).parent.glob("*.py"))]
    found: list[tuple[str, str]] = []
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names if alias.name.split(".")[0] == "vllm")
    return found


def features(root: Path) -> dict[str, bool]:
    """Which of :data:`~genlm_vllm.vllm_api.manifest.FEATURES` the release whose ``vllm`` folder is ``root`` has."""
    from genlm_vllm.vllm_api.manifest import FEATURES

    release = Release(root)
    return {name: release.member(f.path, f.marker) is not None for name, f in FEATURES.items()}


def _needed(feature: str, has: dict[str, bool]) -> bool:
    """Whether an interface tagged ``feature`` ("", "name" or "!name") is used with this release."""
    if not feature:
        return True
    return not has[feature[1:]] if feature.startswith("!") else has[feature]


def check(root: Path) -> list[str]:
    """Every way the release whose ``vllm`` package folder is ``root`` breaks genlm-vllm's use of it."""
    from genlm_vllm.vllm_api.manifest import FEATURES, INTERFACES

    release = Release(root)
    has = features(root)
    optional = {module: name for name, f in FEATURES.items() for module in f.modules}
    problems: list[str] = []
    for module, name in _vllm_imports():
        if module in optional and not has[optional[module]]:
            continue  # imported only where the release has the feature
        path = release.module_path(module)
        if path is None:
            problems.append(f"module {module} is missing")
        elif name and release.definition(path, name) is None:
            problems.append(f"{module} has no {name}")
    for interface in INTERFACES:
        if not _needed(interface.feature, has):
            continue
        where = f"{interface.path}: {interface.name}"
        node = release.member(interface.path, interface.name)
        if node is None:
            problems.append(f"{where} is missing")
            continue
        if interface.parameters:
            if isinstance(node, ast.ClassDef):
                node = _class_member(node, "__init__") or node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names, _ = _parameters(node)
                missing = [p for p in interface.parameters if p not in names]
                if missing:
                    problems.append(f"{where} takes no parameter {', '.join(missing)} (it takes {names})")
        if interface.attributes:
            head = interface.name.split(".")[0]
            members = release.class_members(interface.path, head)
            missing = [a for a in interface.attributes if a not in members]
            if missing:
                problems.append(f"{where} has no attribute {', '.join(missing)}")
    for (path, name), (ours, feature) in SUBCLASSES.items():
        if _needed(feature, has):
            problems += _check_subclass(release, path, name, ours)
    return problems


def _check_subclass(release: Release, path: str, name: str, ours: str) -> list[str]:
    import importlib

    module, _, cls_name = ours.partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    base = release.class_members(path, name)
    if not base:
        return [f"{path}: {name} (subclassed by {cls_name}) is missing"]
    problems = []
    own = {k: v for klass in cls.__mro__ if klass.__module__.startswith("genlm_vllm") for k, v in vars(klass).items()}
    for method, node in base.items():
        if _is_abstract(node) and method not in own:
            problems.append(f"{cls_name} does not implement {name}.{method}, abstract in {path}")
        if method in own and callable(own[method]) and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            theirs, _ = _parameters(node)
            signature = inspect.signature(own[method])
            mine = [p for p in signature.parameters if p not in ("self", "cls")]
            takes_more = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values())
            wanted = [p for p in theirs if p not in ("args", "kwargs")]
            if mine[: len(wanted)] != wanted and not (takes_more and set(mine) <= set(wanted)):
                problems.append(f"{cls_name}.{method}{tuple(mine)} does not match {name}.{method}{tuple(theirs)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="vLLM (CUDA) releases to check, e.g. 0.33.0")
    parser.add_argument("--installed", action="store_true", help="check the vLLM installed here")
    args = parser.parse_args(argv)
    roots = [(f"vllm {v}", release_sources(f"vllm=={v}")) for v in args.versions]
    if args.installed or not roots:
        roots.append(("installed vllm", installed_sources()))
    from genlm_vllm.vllm_api.manifest import FEATURES

    failed = False
    for label, root in roots:
        problems = check(root)
        failed |= bool(problems)
        print(f"{label}: " + ("OK" if not problems else f"{len(problems)} problems"))
        for problem in problems:
            print(f"  {problem}")
        for name, present in features(root).items():
            if not present:
                print(f"  without {name}: {FEATURES[name].without}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
