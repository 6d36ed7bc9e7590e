#!/usr/bin/env bash
# The planner's plans for the long-context and 70B configs at scale (issues 21
# and 22), on paper: Llama 3.1 8B at 128K tokens on 8 H100 (nnScaler's example:
# 41.12 s per step), at 1M tokens on 8 and 32, and Llama 3 70B on 64 and 128.
# Each as `nnstrain plan --explain` text and as --json, into docs/plans/.
# These are the cost model's estimates, not measurements (docs/parallelism.md).
#
#   bench/plan_scale.sh [NNSTRAIN_BIN]     (default: build/nnstrain)
set -u
cd "$(dirname "$0")/.."
BIN=${1:-${NNSTRAIN_BIN:-build/nnstrain}}
[ -x "$BIN" ] || { echo "no nnstrain binary at $BIN (build it, or pass its path)" >&2; exit 2; }
mkdir -p docs/plans
stamp="date $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"

plan() {  # name, config, ranks, extra overrides...
  local name=$1 config=$2 ranks=$3
  shift 3
  local cmd=("$BIN" plan --config "$config" --runtime-ngpus "$ranks" --device H100 "$@")
  {
    echo "# \$ nnstrain plan --config $config --runtime-ngpus $ranks --device H100 $* --explain"
    echo "# $stamp; estimates of the planner's cost model, not measurements"
    echo
    "${cmd[@]}" --explain 2>&1
    echo "(exit status $?)"
  } > "docs/plans/$name.txt"
  "${cmd[@]}" --json > "docs/plans/$name.json" 2>&1
  echo "wrote docs/plans/$name.{txt,json}"
}

plan llama3_8b_128k_8xH100 configs/llama3_8b_128k.yaml 8
plan llama3_8b_1m_8xH100 configs/llama3_8b_128k.yaml 8 --vars.seq_len 1048576
plan llama3_8b_1m_8xH100_78GiB configs/llama3_8b_128k.yaml 8 --vars.seq_len 1048576 --memory-budget-gb 78
plan llama3_8b_1m_32xH100 configs/llama3_8b_128k.yaml 32 --vars.seq_len 1048576
plan llama3_70b_64xH100 configs/llama3_70b.yaml 64
plan llama3_70b_128xH100 configs/llama3_70b.yaml 128
