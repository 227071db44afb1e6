#!/usr/bin/env bash
# Creates .seedvenv with the seed libraries (genlm-backend 0.3.1, genlm-bytes 0.2.0) for side-by-side benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .seedvenv/bin/python ] || python3 -m venv .seedvenv
.seedvenv/bin/python -m pip install -q --upgrade pip
.seedvenv/bin/python -m pip install -q torch==2.13.0
.seedvenv/bin/python -m pip install -q genlm-backend==0.3.1 genlm-bytes==0.2.0 'transformers>=5.16.1,<5.20' tiktoken
