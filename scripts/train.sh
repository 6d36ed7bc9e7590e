#!/usr/bin/env bash
# The README's first command: set up, prepare tiny Shakespeare, and train the
# bundled default (configs/shakespeare_char.yaml) on CUDA, or its CPU variant
# when no GPU is present. Extra arguments go to nnstrain (overrides, --resume).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The binary only: the test suite is scripts/test.sh's to build.
NNSTRAIN_BUILD_TARGET=nnstrain "$root/scripts/setup.sh"
cd "$root"
build=${NNSTRAIN_BUILD_DIR:-$root/build}
"$build/nnstrain" prepare shakespeare_char
config=configs/shakespeare_char.yaml
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[train] no CUDA device: training the CPU variant configs/shakespeare_char_cpu.yaml" >&2
  config=configs/shakespeare_char_cpu.yaml
fi
exec "$build/nnstrain" --config "$config" "$@"
