#!/usr/bin/env bash
# Multi-rank NCCL checks for a machine with two or more GPUs (never run yet:
# the machines lent so far have one GPU; docs/launching.md, "What has run on
# hardware"). Each check prints PASS or FAIL and the script exits non-zero if
# any failed.
#
#   bash bench/gpu/multi_gpu.sh [NGPUS]      (default: every visible GPU, at least 2)
#
# Needs the nnstrain binary (NNSTRAIN_BIN, default build/nnstrain, built with
# CUDA) and data/shakespeare_char (build/nnstrain prepare shakespeare_char).
# Writes runs/multi_gpu/<check>/ and runs/multi_gpu/summary.txt.
#
#   parity       dp N over NCCL (ZeRO 0-3) and tp 2 x dp N/2 with sequence
#                parallelism, 20 steps, fp32 and TF32 off: losses and grad norms
#                within 1e-4 of one GPU
#   graphs       dp N over NCCL, ZeRO 0 and 1, with cuda_graphs auto (the default:
#                the step, its collectives included, captured after 3 eager steps
#                and replayed) against cuda_graphs false: losses and grad norms
#                bitwise equal over 20 steps, and every rank's log says it captured
#   resume       a dp N ZeRO-3 checkpoint resumes at tp 2 and at one GPU
#   shutdown     no "destroy_process_group() was not called" in any NCCL log
#   pipeline     pp 2 over NCCL, 1f1b and zbv, the tied GPT at real sizes (hidden
#                4096, sequence 4096, 4 layers, 4 micro-batches of 1): every
#                activation is 64 MiB (fp32), far above NCCL's connection buffer,
#                so a transfer order that breaks NCCL's rules hangs here
#                (collective_timeout_s 120); losses and grad norms within 1e-4 of
#                one GPU over 6 steps, fp32 and TF32 off
#   rank_lost    SIGKILL to rank 1 mid-run: every other rank exits non-zero within
#                collective_timeout_s + 30 s, naming the collective and rank 1 (dp N
#                ZeRO-0 captures its step by default, so this is a replay hung on a
#                lost peer: the monitor's watch of each replay must end it)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=${NNSTRAIN_BIN:-$root/build/nnstrain}
n=${1:-$(nvidia-smi -L 2>/dev/null | wc -l)}
out=$root/runs/multi_gpu
data=$root/data/shakespeare_char
if ((n < 2)); then echo "multi_gpu.sh: needs 2 or more GPUs, found $n" >&2; exit 2; fi
[ -x "$bin" ] || { echo "multi_gpu.sh: no nnstrain binary at $bin" >&2; exit 2; }
rm -rf "$out"; mkdir -p "$out"
failed=0
result() { echo "$1: $2" | tee -a "$out/summary.txt"; [ "$2" = PASS ] || failed=1; }
common=(--config "$root/configs/shakespeare_char.yaml" --vars.data_dir "$data" --max_train_steps 20
        --val_every_n_train_steps 0 --log_progress_every_n_train_steps 1 --model.args.dropout 0.0
        --precision 32-true --compute_config.allow_tf32 false --compute_config.device cuda
        --compute_config.backend nccl --global_batch_size "$((4 * n))"
        --grad_accumulation_steps 1 --checkpoint.every_n_train_steps 10)
train() {  # name nproc tp overrides...: global batch 4 x N, split over the data-parallel ranks
  local name=$1 np=$2 tp=$3; shift 3
  local mb=$((4 * n / (np / tp)))
  "$bin" launch --nproc-per-node "$np" -- "${common[@]}" --micro_batch_size "$mb" --run_dir "$out/$name" \
    --checkpoint.save_dir "$out/$name/ckpt" "$@" > "$out/$name.log" 2>&1
}
compare() {  # run reference -> prints the largest relative loss / grad-norm difference
  python3 - "$out/$1/metrics.jsonl" "$out/$2/metrics.jsonl" <<'PY'
import json, sys
def load(p):
    return {r["step"]: r for r in map(json.loads, open(p)) if "loss" in r}
a, b = load(sys.argv[1]), load(sys.argv[2])
common = sorted(set(a) & set(b))
if not common:
    print("inf"); sys.exit()
print(max(max(abs(a[s][k] - b[s][k]) / abs(b[s][k]) for k in ("loss", "grad_norm")) for s in common))
PY
}

# parity
train one 1 1 || result "one GPU" FAIL
for z in 0 1 2 3; do
  if train "dp${n}_zero$z" "$n" 1 --pas_policy dp --compute_config.use_zero "$z"; then
    d=$(compare "dp${n}_zero$z" one); python3 -c "import sys; sys.exit(0 if $d < 1e-4 else 1)" \
      && result "parity dp$n ZeRO-$z ($d)" PASS || result "parity dp$n ZeRO-$z ($d)" FAIL
  else result "parity dp$n ZeRO-$z (exit)" FAIL; fi
done
if train "tp2_dp$((n / 2))" "$n" 2 --pas_policy hybrid --compute_config.plan_ngpus 2; then
  d=$(compare "tp2_dp$((n / 2))" one); python3 -c "import sys; sys.exit(0 if $d < 1e-4 else 1)" \
    && result "parity tp2 x dp$((n / 2)) SP ($d)" PASS || result "parity tp2 x dp$((n / 2)) SP ($d)" FAIL
else result "parity tp2 x dp$((n / 2)) (exit)" FAIL; fi

# graphs: the same runs eagerly and as replayed CUDA graphs (Runtime::watch_replay watches each replay)
bitwise() {  # run reference -> "equal" or the largest relative loss / grad-norm difference
  python3 - "$out/$1/metrics.jsonl" "$out/$2/metrics.jsonl" <<'PY'
import json, sys
def load(p):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if "loss" in r}
a, b = load(sys.argv[1]), load(sys.argv[2])
if sorted(a) != list(range(1, 21)) or sorted(b) != list(range(1, 21)):
    print("steps missing"); sys.exit()
print("equal" if a == b else max(abs(x - y) / abs(y) for s in a for x, y in zip(a[s], b[s])))
PY
}
for z in 0 1; do
  name="graphs dp$n ZeRO-$z"
  if train "dp${n}_z${z}_eager" "$n" 1 --pas_policy dp --compute_config.use_zero "$z" --compute_config.cuda_graphs false &&
     train "dp${n}_z${z}_graphs" "$n" 1 --pas_policy dp --compute_config.use_zero "$z" --compute_config.cuda_graphs auto; then
    d=$(bitwise "dp${n}_z${z}_graphs" "dp${n}_z${z}_eager")
    captured=$(grep -l "cuda_graphs: step 4 captured with its nccl collectives" "$out/dp${n}_z${z}_graphs"/logs/rank*.log | wc -l)
    [ "$d" = equal ] && [ "$captured" = "$n" ] && result "$name: bitwise equal to eager, $captured ranks captured" PASS \
      || result "$name: losses $d, $captured of $n ranks captured" FAIL
  else result "$name (exit)" FAIL; fi
done

# resume under another plan
ck=$out/dp${n}_zero3/ckpt/step-00000010
for target in "tp2:$n:2:--pas_policy hybrid --compute_config.plan_ngpus 2" "one1:1:1:"; do
  IFS=: read -r name np tp extra <<< "$target"
  # shellcheck disable=SC2086
  if train "resume_$name" "$np" "$tp" $extra --resume "$ck"; then
    d=$(compare "resume_$name" one); python3 -c "import sys; sys.exit(0 if $d < 1e-4 else 1)" \
      && result "resume ZeRO-3 dp$n -> $name ($d)" PASS || result "resume ZeRO-3 dp$n -> $name ($d)" FAIL
  else result "resume ZeRO-3 dp$n -> $name (exit)" FAIL; fi
done

# shutdown
if grep -l "destroy_process_group() was not called" "$out"/*.log "$out"/*/logs/*.log 2>/dev/null; then
  result "NCCL shutdown (no warning)" FAIL
else result "NCCL shutdown (no warning)" PASS; fi

# pipeline: pp 2 at real sizes (two ranks; the rest of the GPUs idle)
big=(--vars.block_size 4096 --model.args.n_embd 4096 --model.args.n_head 32 --model.args.n_layer 4
     --model.args.block_size 4096 --max_train_steps 6 --global_batch_size 4 --checkpoint.save_dir=
     --compute_config.collective_timeout_s 120)
"$bin" launch --nproc-per-node 1 -- "${common[@]}" "${big[@]}" --micro_batch_size 1 --grad_accumulation_steps 4 \
  --run_dir "$out/pp_one" > "$out/pp_one.log" 2>&1 || result "pipeline reference on one GPU (exit)" FAIL
for sched in 1f1b zbv; do
  name="pipeline pp2 $sched, hidden 4096, sequence 4096"
  if timeout 900 "$bin" launch --nproc-per-node 2 -- "${common[@]}" "${big[@]}" --micro_batch_size 1 \
       --grad_accumulation_steps 4 --compute_config.pas_config.pp_size 2 \
       --compute_config.pas_config.pipeline_scheduler "$sched" --run_dir "$out/pp2_$sched" > "$out/pp2_$sched.log" 2>&1; then
    d=$(compare "pp2_$sched" pp_one); python3 -c "import sys; sys.exit(0 if $d < 1e-4 else 1)" \
      && result "$name ($d)" PASS || result "$name ($d)" FAIL
  else result "$name (exit or hang)" FAIL; fi
done

# rank lost
"$bin" launch --nproc-per-node "$n" -- "${common[@]}" --micro_batch_size 4 --max_train_steps 100000 --run_dir "$out/rank_lost" \
  --checkpoint.save_dir= --compute_config.collective_timeout_s 20 > "$out/rank_lost.log" 2>&1 &
launcher=$!
for _ in $(seq 120); do grep -q "step 5/" "$out/rank_lost.log" 2>/dev/null && break; sleep 1; done
victim=$(pgrep -P "$launcher" | while read -r p; do tr '\0' '\n' < "/proc/$p/environ" | grep -qx RANK=1 && echo "$p"; done | head -1)
t0=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
wait "$launcher"; rc=$?
took=$(($(date +%s) - t0))
if [ -n "$victim" ] && [ "$rc" != 0 ] && ((took <= 50)) && grep -q "ranks not answering.*1\|rank 1" "$out/rank_lost.log"; then
  result "rank lost: every rank out in ${took}s, rank 1 named" PASS
else result "rank lost (rc $rc, ${took}s, victim '${victim}')" FAIL; fi

cat "$out/summary.txt"
exit $failed
