#!/usr/bin/env bash
# Runs bench_mlx.py (or the benchmark script given first) with Debian's OpenBLAS preloaded (extracted into
# .openblas/, no system install).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -e .openblas/lib ]; then
  mkdir -p .openblas/debs && (cd .openblas/debs && apt-get download libopenblas0-pthread libgfortran5 >/dev/null)
  for deb in .openblas/debs/*.deb; do dpkg-deb -x "$deb" .openblas; done
  ln -sfn "$PWD/$(dirname "$(find .openblas -name 'libopenblas.so.0' -path '*openblas-pthread*' | head -1)")" .openblas/lib
fi
export LD_LIBRARY_PATH="$PWD/.openblas/lib:$PWD/$(dirname "$(find .openblas -name 'libgfortran.so.5' | head -1)")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# OpenBLAS detects the CPU; set OPENBLAS_CORETYPE only where detection is wrong (SkylakeX needs AVX-512).
script=benchmarks/bench_mlx.py
case "${1:-}" in *.py) script=$1; shift ;; esac
LD_PRELOAD="$PWD/.openblas/lib/libopenblas.so.0" exec .venv/bin/python "$script" "$@"
