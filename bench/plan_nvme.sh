#!/usr/bin/env bash
# What the planner chooses for Llama 3 70B (configs/llama3_70b.yaml) on one
# node of 8 x H100 (80 GB) with 1 TB of host memory: without a disk the host
# tier cannot hold the optimizer state (18 bytes a parameter), so no plan
# fits; with the disk under DIR probed (`--probe-disk`, its measured rates
# enter the cost model), autodist falls back to ZeRO-3 with the optimizer and
# the parameters on NVMe (ZeRO-Infinity). Estimates, not measurements (the
# disk's rates excepted): docs/parallelism.md.
#
#   bench/plan_nvme.sh DIR [NNSTRAIN_BIN]     (default: build/nnstrain)
#
# Writes bench/results/plan_nvme_llama3_70b.txt.
set -u
cd "$(dirname "$0")/.."
DIR=${1:?a folder on the disk to probe}
BIN=${2:-${NNSTRAIN_BIN:-build/nnstrain}}
[ -x "$BIN" ] || { echo "no nnstrain binary at $BIN (build it, or pass its path)" >&2; exit 2; }
out=bench/results/plan_nvme_llama3_70b.txt
{
  echo "# nnstrain plan: Llama 3 70B (configs/llama3_70b.yaml, seq 8192, bf16-mixed) on one node of 8 x H100, 1 TB host memory"
  echo "# date $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "# estimates from the planner's cost model (docs/parallelism.md), not measurements; the disk is this machine's ($DIR)"
  for extra in "" "--probe-disk $DIR"; do
    echo
    echo "================================================================================"
    echo "\$ nnstrain plan --config configs/llama3_70b.yaml --runtime-ngpus 8 --device H100 --host-memory-gb 1024 $extra"
    echo "================================================================================"
    # shellcheck disable=SC2086
    "$BIN" plan --config configs/llama3_70b.yaml --runtime-ngpus 8 --device H100 --host-memory-gb 1024 $extra 2>&1 |
      grep -v '^  [a-z].*\(replicate\|column\|row\|vocab\) *\['
    echo "(exit status ${PIPESTATUS[0]})"
  done
} > "$out"
echo "wrote $out"
