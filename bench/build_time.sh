#!/usr/bin/env bash
# Back-to-back: the nnstrain target from an empty build folder, file by file then in unity batches.
# Usage: bash bench/build_time.sh (about 15 min on 2 cores); ccache off, so both start cold.
set -e
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${NNSTRAIN_VENV:-$HOME/.cache/nnstrain/venv}
tp=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
for mode in OFF ON; do
  d=${TMPDIR:-/tmp}/nnstrain_build_time_$mode; rm -rf $d
  cmake -S "$root" -B $d -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$tp" \
    -DNNSTRAIN_PYTHON="$venv/bin/python" -DNNSTRAIN_UNITY_BUILD=$mode >/dev/null 2>&1
  echo "unity $mode start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -f "unity $mode: wall %e s, user %U s, sys %S s" env CCACHE_DISABLE=1 ninja -C $d -j2 nnstrain >/dev/null
  echo "unity $mode end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
