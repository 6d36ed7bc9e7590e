#!/usr/bin/env bash
# What the planner chooses for GPT-2 124M and a 1.3B GPT on 1, 2, 4 and 8
# ranks with 80 GiB and 16 GiB per rank (and 8 GiB for the 124M model, which
# fits 16 GiB without help) (H100 figures; plan_ngpus = ranks, so
# autodist may use tensor parallelism up to the whole world). These are the
# cost model's estimates, not measurements: see docs/parallelism.md.
#
#   bench/plan_examples.sh [NNSTRAIN_BIN]     (default: build/nnstrain)
#
# Writes bench/results/plan_gpt2_124m.txt and bench/results/plan_gpt2_large.txt,
# and bench/results/plan_offload_llama3_8b.txt: Llama 3 8B on one H100, where
# only offload fits (autodist), against a fixed policy that may not offload.
set -u
cd "$(dirname "$0")/.."
BIN=${1:-${NNSTRAIN_BIN:-build/nnstrain}}
DEVICE=${DEVICE:-H100}
[ -x "$BIN" ] || { echo "no nnstrain binary at $BIN (build it, or pass its path)" >&2; exit 2; }

run_all() {  # config, output file, title, budgets (GiB)
  local config=$1 out=$2 title=$3 budgets=$4
  {
    echo "# nnstrain plan: $title"
    echo "# config $config, device table entry $DEVICE, pas_policy autodist, plan_ngpus = ranks"
    echo "# date $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "# estimates from the planner's cost model (docs/parallelism.md), not measurements"
    for budget in $budgets; do
      for ranks in 1 2 4 8; do
        echo
        echo "================================================================================"
        echo "\$ nnstrain plan --config $config --runtime-ngpus $ranks --compute_config.plan_ngpus $ranks" \
             "--device $DEVICE --memory-budget-gb $budget --explain"
        echo "================================================================================"
        "$BIN" plan --config "$config" --runtime-ngpus "$ranks" --compute_config.plan_ngpus "$ranks" \
          --device "$DEVICE" --memory-budget-gb "$budget" --explain 2>&1
        echo "(exit status $?)"
      done
    done
  } > "$out"
  echo "wrote $out"
}

run_all configs/gpt2_124m.yaml bench/results/plan_gpt2_124m.txt "GPT-2 124M (12 layers, 768 wide, 12 heads, seq 1024, bf16-mixed)" "80 16 8"
run_all configs/gpt_1p3b.yaml bench/results/plan_gpt2_large.txt "GPT 1.3B (24 layers, 2048 wide, 16 heads, seq 2048, bf16-mixed)" "80 16"

{
  echo "# nnstrain plan: Llama 3 8B (configs/llama3_8b.yaml, seq 8192, bf16-mixed) on ONE rank, device $DEVICE"
  echo "# date $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "# estimates from the planner's cost model (docs/parallelism.md), not measurements"
  for policy in autodist dp; do
    echo
    echo "================================================================================"
    echo "\$ nnstrain plan --config configs/llama3_8b.yaml --runtime-ngpus 1 --compute_config.plan_ngpus 1" \
         "--compute_config.use_zero 0 --pas_policy $policy --device $DEVICE"
    echo "================================================================================"
    "$BIN" plan --config configs/llama3_8b.yaml --runtime-ngpus 1 --compute_config.plan_ngpus 1 \
      --compute_config.use_zero 0 --pas_policy "$policy" --device "$DEVICE" 2>&1 | grep -v '^  [a-z].*\(replicate\|column\|row\|vocab\) *\['
    echo "(exit status ${PIPESTATUS[0]})"
  done
} > bench/results/plan_offload_llama3_8b.txt
echo "wrote bench/results/plan_offload_llama3_8b.txt"
