#!/usr/bin/env bash
# The README's first command: set up, prepare tiny Shakespeare, and train the
# bundled default (configs/shakespeare_char.yaml) on CUDA, or its CPU variant
# when no GPU is present. Extra arguments go to nnstrain (overrides, --resume).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The binary only, and only what training needs: the test suite and its reference
# packages are scripts/test.sh's to build and install.
NNSTRAIN_SETUP=train NNSTRAIN_BUILD_TARGET=nnstrain "$root/scripts/setup.sh"
cd "$root"
build=${NNSTRAIN_BUILD_DIR:-$root/build}
"$build/nnstrain" prepare shakespeare_char
config=configs/shakespeare_char.yaml
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[train] no CUDA device: training the CPU variant configs/shakespeare_char_cpu.yaml" >&2
  config=configs/shakespeare_char_cpu.yaml
fi
"$build/nnstrain" --config "$config" "$@"

# What the model learned: a short sample from the checkpoint the run saved last
# (save_on_end), as nanoGPT's sample.py draws it (temperature 0.8, top-k 200).
# The save_dir is read from the resolved config, so overrides of it are followed.
save_dir=$("$build/nnstrain" --config "$config" "$@" --print-config |
           sed -n 's/^  save_dir: *//p' | head -n 1 | sed "s/^[\"']//; s/[\"']\$//")
if [ -n "$save_dir" ] && [ -d "$save_dir" ]; then
  echo "[train] a sample from $save_dir (nnstrain generate $save_dir --max-new-tokens 200):" >&2
  "$build/nnstrain" generate "$save_dir" --prompt $'\n' --max-new-tokens 200 --temperature 0.8 --top-k 200
else
  echo "[train] no checkpoint folder to sample from (checkpoint.save_dir: '$save_dir')" >&2
fi
