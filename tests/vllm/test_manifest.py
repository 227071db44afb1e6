"""Every vLLM name genlm-vllm uses is reached through the adapter (:mod:`genlm_vllm.vllm_api`) and listed
once in :data:`~genlm_vllm.vllm_api.manifest.INTERFACES`, which :mod:`genlm_vllm.tools.contract` checks
against each supported release's sources (``tests/vllm/test_contract.py``).

Read from the sources with :mod:`ast`, so these run without vLLM (where vLLM is installed, the classes of
the files the manifest names add their members to the names looked for outside the adapter). Each check
is also run on a planted offence, so that it is seen to fail.

What counts as a vLLM name, and where the checks stop:

- outside the adapter, an attribute (``x.name``, ``getattr(x, "name")``) whose name vLLM's classes use
  (a manifest entry's attribute, method or parameter, or a member of a class in a file the manifest
  names) and that nothing of genlm (genlm-core, genlm-vllm), Python's built-in types, torch or numpy
  defines; a keyword argument to one of vLLM's classes; a ``"VLLM_..."`` setting or a ``"vllm...."``
  module name as a string. A vLLM attribute that shares its name with one of ours (``block_size``,
  ``request_id``) is not told apart: the accessors of :mod:`genlm_vllm.vllm_api` are the rule there;
- inside the adapter, every attribute read, written or patched on anything but our own objects
  (``self`` in our classes), non-vLLM modules, the namespace of :func:`~genlm_vllm.vllm_api.release.loaded`
  and names that Python's built-in types, torch, numpy or the standard library objects the adapter uses
  define; keywords passed to vLLM's callables; names imported from ``vllm``; class names compared with
  ``type(x).__name__``; settings and module names as strings: each must be listed;
- the other way: every attribute and method the manifest lists is read, written, passed or overridden
  somewhere (a stale entry is an error), each entry is listed once, and every method our subclasses of
  vLLM's classes override is listed with the parameters it takes.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import contextvars
import functools
import importlib.util
import logging
import multiprocessing.context
import random
import re
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest
import torch
from packaging.version import Version

from genlm_vllm.vllm_api import manifest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "plugins" / "genlm_vllm" / "genlm_vllm"
CORE = ROOT / "genlm_core"
ADAPTER = "vllm_api"
#: Python's and torch's types whose attribute names are not vLLM's (what the package's code calls on them).
NOT_VLLM_TYPES = (
    object,
    type,
    types.FunctionType,
    dict,
    list,
    tuple,
    set,
    frozenset,
    str,
    bytes,
    int,
    float,
    bool,
    BaseException,
    ImportError,
    torch.Tensor,
    torch.device,
    numpy.ndarray,
    numpy.random.Generator,
    random.Random,
    logging.Logger,
    multiprocessing.context.BaseContext,
    Version,
    concurrent.futures.Future,
    asyncio.AbstractEventLoop,
    threading.Thread,
    contextvars.ContextVar,
    ast.AST,
    *(cls for cls in vars(ast).values() if isinstance(cls, type) and issubclass(cls, ast.AST)),
)
SETTING = re.compile(r"VLLM_[A-Z0-9_]+")
MODULE = re.compile(r"vllm(\.\w+)+")
GETATTR = ("getattr", "hasattr", "setattr", "delattr")


def package_sources() -> dict[str, str]:
    """``"part/module.py"`` -> source, for every module of genlm_vllm."""
    return {p.relative_to(PACKAGE).as_posix(): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def in_adapter(name: str) -> bool:
    return name.split("/")[0] == ADAPTER


# ---- what the manifest lists ---------------------------------------------------------------------


def listed_heads() -> set[str]:
    """Classes, functions and settings the manifest names (``"Class"`` of ``"Class.method"``)."""
    return {i.name.split(".")[0] for i in manifest.INTERFACES}


def listed_members() -> set[str]:
    """Attributes, methods and parameters the manifest lists."""
    names: set[str] = set()
    for i in manifest.INTERFACES:
        names.update(i.attributes, i.parameters, i.name.split(".")[1:])
    return names


def listed_modules() -> set[str]:
    """The modules (``"vllm.v1.request"``) whose files the manifest names."""
    found = set()
    for i in manifest.INTERFACES:
        parts = i.path.removesuffix(".py").split("/")
        found.add(".".join(["vllm", *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return found


def vllm_members() -> set[str]:
    """Names vLLM's classes use: the manifest's, and, where vLLM is installed, every member of every class
    defined in the files the manifest names."""
    names = listed_members()
    for path in {i.path for i in manifest.INTERFACES}:
        names |= installed_members(path)
    return names


@functools.cache
def installed_members(path: str) -> frozenset[str]:
    """The members of the classes in a file of the vLLM installed here (none without vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None or not (file := Path(spec.origin).parent / path).exists():
        return frozenset()
    return frozenset(defined_members(ast.parse(file.read_text(encoding="utf-8"))))


# ---- what a source defines and uses ------------------------------------------------------------------


def class_members(cls: ast.ClassDef) -> set[str]:
    """A class's own members: methods, class-level names and fields, ``self.x = ...`` in its methods."""
    members: set[str] = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            members.add(item.name)
            for sub in ast.walk(item):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    if isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
                        members.add(sub.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def defined_members(tree: ast.Module) -> set[str]:
    """Every member of every class in a module."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found |= class_members(node)
    return found


def defined_names(tree: ast.Module) -> set[str]:
    """What a module defines that code reads as an attribute: its classes' members, its functions,
    classes and module-level names, and the keywords of namespaces it builds."""
    found = defined_members(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
    for node in tree.body:
        if isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return found


@functools.cache
def ours() -> frozenset[str]:
    """Names that are not only vLLM's: defined by genlm-core or genlm-vllm, or by the types in
    :data:`NOT_VLLM_TYPES`."""
    names = {name for cls in NOT_VLLM_TYPES for name in dir(cls)}
    for base in (CORE, PACKAGE):
        for path in base.rglob("*.py"):
            names |= defined_names(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


@functools.cache
def genlm_classes() -> frozenset[str]:
    """The classes genlm-core and genlm-vllm define outside the adapter (whose classes stand for vLLM's)."""
    paths = [*CORE.rglob("*.py"), *(p for p in PACKAGE.rglob("*.py") if p.parent.name != ADAPTER)]
    return frozenset(
        node.name
        for path in paths
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
    )


def module_names(tree: ast.Module) -> set[str]:
    """Local names bound to modules other than vLLM's (``import os``; ``from genlm_vllm.vllm_api import
    client``); a vLLM module's attributes are vLLM names."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.asname or a.name.split(".")[0] for a in node.names if not a.name.startswith("vllm"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("vllm"):
            found.update(a.asname or a.name for a in node.names if is_module(f"{node.module}.{a.name}"))
    return found


@functools.cache
def is_module(dotted: str) -> bool:
    if dotted.split(".")[0] == "vllm":
        return False
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (head := dotted(node.value)) is not None:
        return f"{head}.{node.attr}"
    return None


def accesses(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.expr, str]]:
    """(node, object, attribute name) of every ``x.name`` and ``getattr(x, "name")`` (hasattr, setattr too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in GETATTR
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            yield node, node.args[0], node.args[1].value


def own_objects(tree: ast.Module) -> dict[int, set[str]]:
    """id of each ``self``/``cls`` name in a method of a class defined here -> that class's members."""
    found: dict[int, set[str]] = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        members = class_members(cls)
        for item in cls.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.args.args:
                first = item.args.args[0].arg
                for sub in ast.walk(item):
                    if isinstance(sub, ast.Name) and sub.id == first:
                        found[id(sub)] = members
    return found


def not_vllm_object(value: ast.expr, modules: set[str], own: dict[int, set[str]], attr: str) -> bool:
    """Whether ``value.attr`` is certainly not a vLLM name: on a non-vLLM module, on our own object, on
    the namespace of ``loaded()``, or Python's."""
    if attr.startswith("__") or attr.startswith(("genlm", "_genlm")):  # Python's; our marks on vLLM's objects
        return True
    name = dotted(value)
    if name is not None and (name in modules or (name.split(".")[0] in modules and is_module(name))):
        return True
    if isinstance(value, ast.Name) and attr in own.get(id(value), ()):
        return True
    func = value.func if isinstance(value, ast.Call) else None
    return func is not None and (getattr(func, "id", None) == "loaded" or getattr(func, "attr", None) == "loaded")


def strings(tree: ast.Module) -> Iterator[ast.Constant]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node


# ---- the checks ------------------------------------------------------------------------------------


def outside_offences(sources: dict[str, str]) -> list[str]:
    """Every use of a vLLM name in a module outside the adapter: ``"path:line: code"``."""
    vllm, mine = vllm_members(), ours()
    classes = {n for n in listed_heads() if n[:1].isupper()} - genlm_classes()  # genlm_core's Request is ours
    found = []
    for path, source in sources.items():
        if in_adapter(path):
            continue
        tree = ast.parse(source)
        modules, own = module_names(tree), own_objects(tree)
        for node, value, attr in accesses(tree):
            if attr in vllm and attr not in mine and not not_vllm_object(value, modules, own, attr):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] in classes:
                found += [f"{path}:{node.lineno}: {k.arg}= to {ast.unparse(node.func)}" for k in node.keywords if k.arg]
        for const in strings(tree):
            if SETTING.fullmatch(const.value) or MODULE.fullmatch(const.value):
                found.append(f"{path}:{const.lineno}: {const.value!r}")
    return sorted(found)


def adapter_unlisted(sources: dict[str, str]) -> list[str]:
    """Every vLLM name the adapter uses that the manifest does not list: ``"path:line: code"``."""
    members, heads, modules_listed = listed_members(), listed_heads(), listed_modules()
    callables = heads | members
    found = []
    for path, source in sources.items():
        if not in_adapter(path) or path.endswith("manifest.py"):
            continue
        tree = ast.parse(source)
        modules, own, python = module_names(tree), own_objects(tree), {n for c in NOT_VLLM_TYPES for n in dir(c)}
        for node, value, attr in accesses(tree):
            if attr not in members | heads and attr not in python and not not_vllm_object(value, modules, own, attr):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] in callables:
                found += [
                    f"{path}:{node.lineno}: {k.arg}= to {ast.unparse(node.func)}"
                    for k in node.keywords
                    if k.arg and k.arg not in members
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                for alias in node.names:
                    if alias.name not in heads and f"{node.module}.{alias.name}" not in modules_listed:
                        found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "__name__" for side in [node.left, *node.comparators]
            ):
                for side in [node.left, *node.comparators]:
                    if isinstance(side, ast.Constant) and isinstance(side.value, str) and side.value not in heads:
                        found.append(f"{path}:{node.lineno}: class {side.value!r}")
        for const in strings(tree):
            if SETTING.fullmatch(const.value) and const.value not in heads:
                found.append(f"{path}:{const.lineno}: setting {const.value!r}")
            if MODULE.fullmatch(const.value) and const.value not in modules_listed:
                found.append(f"{path}:{const.lineno}: module {const.value!r}")
    return sorted(found)


def engine_argument_names(source: str) -> set[str]:
    """The engine arguments :mod:`genlm_vllm.start.engine_args` names: its dicts' string keys, the
    strings it subscripts and ``get``s, and the keywords of its ``update`` calls."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            found.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            found.add(str(node.slice.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "update":
                found.update(k.arg for k in node.keywords if k.arg)
            elif node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
                found.add(str(node.args[0].value))
    return found


def unused_entries(sources: dict[str, str]) -> list[str]:
    """Attributes and methods the manifest lists that nothing in genlm-vllm reads, writes, passes or
    overrides (stale entries)."""
    used: set[str] = set()
    for path, source in sources.items():
        tree = ast.parse(source)
        if in_adapter(path):
            used.update(attr for _, _, attr in accesses(tree))
            used.update(k.arg for node in ast.walk(tree) if isinstance(node, ast.Call) for k in node.keywords if k.arg)
            used.update(
                k.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Dict)
                for k in n.keys
                if isinstance(k, ast.Constant)
            )
        elif path.split("/")[0] == "in_engine":  # what our subclasses of vLLM's classes override
            used.update(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    used |= engine_argument_names(sources["start/engine_args.py"])
    stale = []
    for i in manifest.INTERFACES:
        stale += [f"{i.path}: {i.name}.{a}" for a in i.attributes if a not in used]
        method = i.name.split(".")[1:]
        if method and method[0] not in used:
            stale.append(f"{i.path}: {i.name}")
    return stale


#: The adapter's names of vLLM's bases (both runners' processor interfaces are ``LogitsProcessor``).
BASES = {
    "V1LogitsProcessor": ("v1/sample/logits_processor/interface.py", "LogitsProcessor"),
    "V2LogitsProcessor": ("v1/worker/gpu/sample/logits_processor/interface.py", "LogitsProcessor"),
}


def overrides(sources: dict[str, str]) -> list[tuple[tuple[tuple[str, str], ...], str, tuple[str, ...]]]:
    """``(vLLM bases as (path, class), method, parameters)`` of every method our classes in
    :mod:`genlm_vllm.in_engine` define on a vLLM base class taken from the adapter (our own helpers,
    ``_named``, left out)."""
    heads = {(i.path, i.name) for i in manifest.INTERFACES if "." not in i.name}
    found = []
    for path, source in sources.items():
        if path.split("/")[0] != "in_engine":
            continue
        for cls in ast.walk(ast.parse(source)):
            if not isinstance(cls, ast.ClassDef):
                continue
            bases = tuple(
                head
                for b in cls.bases
                if isinstance(b, ast.Name)
                for head in sorted(heads)
                if head == BASES.get(b.id) or (b.id not in BASES and head[1] == b.id)
            )
            for item in cls.body:
                if not bases or not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                if item.name.startswith("_") and item.name != "__init__":
                    continue
                params = tuple(a.arg for a in [*item.args.posonlyargs, *item.args.args, *item.args.kwonlyargs])
                found.append((bases, item.name, params[1:]))
    return found


def unlisted_overrides(sources: dict[str, str]) -> list[str]:
    """Every overridden method that no manifest entry lists, for one of its class's vLLM bases, with the
    parameters it takes: ``"Base.method(parameters)"``."""
    entries = {(i.path, i.name, i.parameters) for i in manifest.INTERFACES}
    wrong = []
    for bases, method, params in overrides(sources):
        if not any((path, f"{cls}.{method}", params) in entries for path, cls in bases):
            wrong.append(f"{'|'.join(cls for _, cls in bases)}.{method}{params}")
    return sorted(wrong)


# ---- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def parsed() -> None:
    """genlm's and the installed vLLM's sources, parsed once for every test here."""
    ours()
    genlm_classes()
    vllm_members()


def test_no_vllm_name_is_used_outside_the_adapter():
    assert outside_offences(package_sources()) == []


def test_a_planted_vllm_read_outside_the_adapter_is_found():
    """``ctx.idx_mapping_np`` and ``request.num_tokens`` written back into the capture processor and the
    fork connector, a keyword to vLLM's ``SamplingParams`` and one of its settings into live sessions."""
    sources = package_sources()
    capture = sources["in_engine/capture.py"]
    planted = "worker.step_slots(ctx)"
    assert planted in capture
    sources["in_engine/capture.py"] = capture.replace(planted, "ctx.idx_mapping_np")
    forks = sources["in_engine/forks.py"]
    assert "end = length - 1" in forks
    sources["in_engine/forks.py"] = forks.replace("end = length - 1", "end = request.num_tokens - 1")
    sources["live.py"] += "\n\ndef planted(SamplingParams):\n    return SamplingParams(max_tokens=1), 'VLLM_HOST_IP'\n"
    found = "\n".join(outside_offences(sources))
    assert "in_engine/capture.py" in found and "ctx.idx_mapping_np" in found
    assert "request.num_tokens" in found
    assert "max_tokens= to SamplingParams" in found and "'VLLM_HOST_IP'" in found
    assert len(found.splitlines()) == 4


def test_every_vllm_name_the_adapter_uses_is_listed():
    assert adapter_unlisted(package_sources()) == []


def test_an_unlisted_vllm_name_in_the_adapter_is_found(monkeypatch):
    """A read the manifest does not list, and the manifest without ``finish_reason``, a class compared by
    name, a setting and a module."""
    sources = package_sources()
    sources["vllm_api/worker.py"] += (
        "\n\ndef planted(request, group):\n"
        "    if type(group).__name__ == 'PyNcclCommunicator':\n"
        "        return request.num_output_placeholders, 'VLLM_PLANTED', 'vllm.v1.planted'\n"
    )
    stripped = tuple(
        manifest.Interface(i.path, i.name, i.parameters, tuple(a for a in i.attributes if a != "finish_reason"))
        if i.name == "EngineCoreOutput"
        else i
        for i in manifest.INTERFACES
    )
    monkeypatch.setattr(manifest, "INTERFACES", stripped)
    found = "\n".join(adapter_unlisted(sources))
    assert "request.num_output_placeholders" in found
    assert "out.finish_reason" in found
    assert "class 'PyNcclCommunicator'" in found
    assert "setting 'VLLM_PLANTED'" in found and "module 'vllm.v1.planted'" in found
    assert len(found.splitlines()) == 5


def test_every_listed_attribute_and_method_is_used():
    assert unused_entries(package_sources()) == []


def test_a_stale_entry_is_found(monkeypatch):
    stale = manifest.Interface("v1/request.py", "Request", attributes=("num_output_placeholders",))
    monkeypatch.setattr(manifest, "INTERFACES", (*manifest.INTERFACES, stale))
    assert unused_entries(package_sources()) == ["v1/request.py: Request.num_output_placeholders"]


def test_every_name_is_listed_once():
    entries = [(i.path, i.name, i.feature) for i in manifest.INTERFACES]
    assert len(entries) == len(set(entries))
    attributes: dict[tuple[str, str, str], list[str]] = {}
    for i in manifest.INTERFACES:
        attributes.setdefault((i.path, i.name.split(".")[0], i.feature), []).extend(i.attributes)
    assert {k: v for k, v in attributes.items() if len(v) != len(set(v))} == {}


def test_every_override_is_listed_with_its_parameters():
    found = {(tuple(c for _, c in bases), method) for bases, method, _ in overrides(package_sources())}
    assert (("KVConnectorBase_V1", "SupportsHMA"), "get_num_new_matched_tokens") in found  # the connector's
    assert (("LogitsProcessor",), "update_state") in found and (("LogitsProcessor",), "add_request") in found
    assert len(overrides(package_sources())) == 19  # 4 + 3 methods of the processors, 12 of the connector
    assert unlisted_overrides(package_sources()) == []


def test_an_unlisted_override_is_found():
    sources = package_sources()
    forks = sources["in_engine/forks.py"]
    planted = "    def wait_for_save(self) -> None:"
    assert planted in forks
    sources["in_engine/forks.py"] = forks.replace(
        planted, "    def get_finished(self, finished_req_ids: set[str]) -> None:\n        return\n\n" + planted
    )
    sources["in_engine/capture.py"] = sources["in_engine/capture.py"].replace(
        "def apply(self, logits: torch.Tensor) -> torch.Tensor:", "def apply(self, rows: torch.Tensor) -> torch.Tensor:"
    )
    assert unlisted_overrides(sources) == [
        "KVConnectorBase_V1|SupportsHMA.get_finished('finished_req_ids',)",
        "LogitsProcessor.apply('rows',)",
    ]


def test_engine_arguments_are_listed():
    """What genlm-vllm passes to vLLM's ``EngineArgs`` by name (checked in each release by the contract)."""
    (engine_args,) = [i for i in manifest.INTERFACES if i.name == "EngineArgs"]
    names = engine_argument_names(package_sources()["start/engine_args.py"])
    assert {"model", "logits_processors", "kv_transfer_config", "additional_config", "max_lora_rank"} <= names
    assert names - set(engine_args.attributes) == set()
