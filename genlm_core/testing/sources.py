"""A package release's own Python sources, read without importing them: for contract checks of the
internals a plugin relies on (a class, a method's parameters, the attributes its instances carry).

A plugin that reaches into an engine's internals declares each one it uses and checks the declaration
against the installed release and against the newest release of its tested range, whose wheel
:func:`wheel_sources` downloads once (``pip download --no-deps``; only the ``.py`` files are kept, in the
genlm cache). Nothing of the release is imported or run, so a release that cannot run here (a CUDA
build, a newer torch) can still be checked::

    sources = Sources(wheel_sources("transformers", "transformers>=5.19,<5.20"))
    params = sources.parameters("cache_utils.py", "DynamicCache.__init__")
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from genlm_core.assets import cache_dir


def wheel_sources(package: str, requirement: str, cache: Path | None = None) -> Path:
    """The ``package`` folder of the wheel pip picks for ``requirement`` (``"transformers>=5.19,<5.20"``:
    the newest in that range): downloaded once with ``pip download --no-deps``, its ``.py`` files kept
    in the genlm cache under the wheel's name, the wheel removed. Needs the package index the first time."""
    root = cache or cache_dir() / "sources"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "-d",
            tmp,
            requirement,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {requirement!r}: {done.stderr.strip()[-500:]}")
        target = root / wheels[0].name.removesuffix(".whl")
        if (target / package / "__init__.py").exists():
            return target / package
        out = Path(tmp) / "out"
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(out, [n for n in zf.namelist() if n.startswith(f"{package}/") and n.endswith(".py")])
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)  # atomic: a concurrent run sees all of it or none
    return target / package


def installed_sources(package: str) -> Path:
    """The folder of ``package`` as installed here."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{package} is not installed")
    return Path(spec.origin).parent


def release_version(root: Path) -> str | None:
    """The version a package folder's ``__init__.py`` declares (``__version__ = "..."``), if any."""
    init = root / "__init__.py"
    if not init.exists():
        return None
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
            continue
        if any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return str(node.value.value)
    return None


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Sources:
    """A package's sources, parsed on demand; names are looked up along base classes within the package."""

    root: Path  #: the package folder (``.../transformers``)
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)

    @property
    def package(self) -> str:
        return self.root.name

    def tree(self, path: str) -> ast.Module | None:
        """The parsed file ``path`` (relative to the package folder), or None when there is none."""
        if path not in self._trees:
            file = self.root / path
            self._trees[path] = ast.parse(file.read_text(encoding="utf-8"), str(file)) if file.exists() else None
        return self._trees[path]

    def find(self, path: str, qualname: str) -> Definition | None:
        """``"Class"``, ``"function"`` or ``"Class.member"`` (a method or property, looked up along the
        class's bases) as defined for file ``path``, following imports within the package."""
        head, _, rest = qualname.partition(".")
        found = self._top_level(path, head)
        if found is None:
            return None
        where, node = found
        if not rest:
            return node
        if not isinstance(node, ast.ClassDef):
            return None
        for _, cls in self.mro(where, node):
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == rest:
                    return item
        return None

    def parameters(self, path: str, qualname: str) -> list[str] | None:
        """The parameter names of a function or method (without ``self``; ``*args`` as ``*``, ``**kwargs``
        as ``**``), or None when it is not defined."""
        node = self.find(path, qualname)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        a = node.args
        names = [p.arg for p in [*a.posonlyargs, *a.args]]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        names += ["*"] if a.vararg else []
        names += [p.arg for p in a.kwonlyargs]
        names += ["**"] if a.kwarg else []
        return names

    def required_parameters(self, path: str, qualname: str) -> list[str] | None:
        """The parameters a call must pass (no default, not ``*args``/``**kwargs``), or None when undefined."""
        node = self.find(path, qualname)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return None
        a = node.args
        positional = [*a.posonlyargs, *a.args]
        required = [p.arg for p in positional[: len(positional) - len(a.defaults)]]
        required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
        return [n for n in required if n not in ("self", "cls")]

    def attributes(self, path: str, qualname: str) -> set[str]:
        """What instances of class ``qualname`` carry: names assigned as ``self.X`` in its methods or its
        bases', declared in a class body (fields of a dataclass), or defined as properties."""
        found = self._top_level(path, qualname)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return set()
        names: set[str] = set()
        for _, cls in self.mro(found[0], found[1]):
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    if any(_name(d) == "property" for d in item.decorator_list):
                        names.add(item.name)
                    names |= _self_assignments(item)
        return names

    def mro(self, path: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        """``cls`` and its bases defined in the package, depth first (each once)."""
        seen: set[tuple[str, str]] = set()
        todo = [(path, cls)]
        while todo:
            where, node = todo.pop(0)
            if (where, node.name) in seen:
                continue
            seen.add((where, node.name))
            yield where, node
            for base in node.bases:
                name = _name(base)
                found = None if name is None else self._top_level(where, name)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    todo.append((found[0], found[1]))

    # ---- name lookup -------------------------------------------------------------------------------

    def _top_level(self, path: str, name: str, depth: int = 0) -> tuple[str, Definition] | None:
        """Where ``name`` is defined as seen from file ``path`` (following ``from .x import name`` and
        ``name = Other`` aliases within the package), and its definition."""
        tree = self.tree(path)
        if tree is None or depth > 8:
            return None
        for node in _statements(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return path, node
        for node in _statements(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return self._top_level(path, node.value.id, depth + 1)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = self._module_path(self._absolute(node, path))
                        if source is not None:
                            return self._top_level(source, alias.name, depth + 1)
        return None

    def _absolute(self, node: ast.ImportFrom, path: str) -> str:
        """The dotted module an import names, from the package root (``"models.llama.modeling_llama"``)."""
        if node.level == 0:
            module = node.module or ""
            prefix = self.package + "."
            return module[len(prefix) :] if module.startswith(prefix) else f"<outside>.{module}"
        package = list(Path(path).with_suffix("").parts[:-1])  # the package the file is in
        base = package[: max(0, len(package) - (node.level - 1))]
        return ".".join([*base, *(node.module.split(".") if node.module else [])])

    def _module_path(self, module: str) -> str | None:
        if module.startswith("<outside>"):
            return None
        parts = [p for p in module.split(".") if p]
        for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
            if (self.root / candidate).exists():
                return candidate
        return None


def _statements(tree: ast.Module) -> Iterator[ast.stmt]:
    """A module's top-level statements, and those inside top-level ``if`` / ``try`` blocks."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []), *getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return None


def _self_assignments(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names
