#!/usr/bin/env bash
# The GPU battery (issues 11, 37): on a fresh GPU machine with only what it has
# (python3 with PyTorch, cmake, ninja, nvcc, a compiler; no package registry),
# runs the device-aware tests on CUDA and the benchmarks, and writes one results
# folder. What it runs is built here beforehand: bench/gpu/prepare.sh packs the
# binaries, the Debian libraries they load and the data into .gpu_bundle/ (carry
# it); they run against the GPU machine's own LibTorch, with no build step there.
# Without a bundle the `build` phase builds on the GPU machine (carry .debs/).
#
#   bash bench/gpu/battery.sh [PHASE ...]        (from the repository root or anywhere)
#
# Phases, run in the order given. The default, in the issue's priority order:
#   (a) tests startup_oom  (b) gpt2 llama  (c) shakespeare  (d) cp_ring  (e) parallel_cuda,
#   then doc_attention tests_more moe muon shakespeare_full (`build` first when there is no bundle).
#   build             configure (once; an existing build dir is reused) and build everything;
#                     with a bundle: nothing to build, says so
#   tests             issue 37 (a)'s device checks on CUDA (bundle.py FIRST: device paths, fused loss,
#                     kernels, the NCCL graph check and hang, the unit binary's [device] cases);
#                     NNSTRAIN_BATTERY_TESTS (a CTest -R regex) picks others. With a bundle its
#                     device_tests.json becomes a CTest file pointing at the bundle's binaries
#   tests_more        the rest of `ctest -L device` on CUDA (checkpoint, tp, dp, precision, resume,
#                     offload, NVMe offload): long parity suites, after the benchmarks
#   matmul            the bf16 matmul rate (MFU denominator; benchmarks measure it anyway)
#   shakespeare       nanoGPT shakespeare_char timing: nnstrain vs PyTorch eager vs compile
#   gpt2              GPT-2 124M, largest micro-batch, MFU, vs eager / compile; each run's
#                     kernel table from 2 profiled steps after its timed ones (gpt2/kernels.md)
#   muon              issue 41: the optimizer step of Muon + AdamW vs AdamW alone on GPT-2 124M
#                     (bf16 Newton-Schulz, time_optimizer_ms), vs torch.optim.Muon / AdamW (~30 s)
#   moe               issue 38: a Qwen3-MoE (64 experts, top-8) with grouped expert GEMMs vs the
#                     per-expert loop (NNSTRAIN_KERNELS=composite): tokens/s, MFU on active parameters
#   doc_attention     issue 40: packed documents' attention forward + backward by flash's varlen
#                     kernel, the tiles and the dense mask, 2 x 8192 tokens, Llama 3 8B heads (~30 s)
#   llama             Llama 3.2 1B shape at seq 4096, MFU, memory, vs eager / compile, kernel
#                     tables as gpt2's (llama/kernels.md)
#   shakespeare_full  the full 5000-step shakespeare_char run: best val loss, wall time
#   zero              ZeRO stages 0-3 at one rank (NCCL): GPT-2 124M losses vs stage 0,
#                     allocator peak vs the planner's estimate, ms/step; stages 2 and 3
#                     with gradient accumulation 4 (peak within 5% of accumulation 1)
#   startup_oom       memory_snapshot: true on a model whose state cannot fit: exit 1,
#                     the message names the snapshot, the snapshot exists
#   offload           optimizer / parameter offload on one GPU (issue 23): GPT-2 124M with
#                     a ~1 s step, with and without offload: tokens/s ratio, step split,
#                     device bytes held between steps vs the planner, host bytes, losses
#   profile           issue 20's "Measured first": a profiler trace of GPT-2 124M (64 x 1024)
#                     and the Llama 3.2 1B shape (seq 4096), bf16-mixed, for nnstrain, PyTorch
#                     eager and torch.compile at one batch; per trace the 15 most expensive
#                     kernels with their share, time by kind, and the attention kernel that
#                     ran (profile/kernels.md, bench/gpu/kernel_table.py)
#   parallel_cuda     issue 37 (e): pp 2 and cp 2 over Gloo on CUDA tensors (two ranks sharing the
#                     GPU) and optimizer offload on CUDA, each against one process on the GPU
#   cp_ring           issue 22's GPU goal: one rank's share of a 128K sequence at cp 8 (Llama 3
#                     8B heads, bf16, causal zigzag) forward + backward against one plain SDPA
#                     call of the same unmasked FLOPs (bench/cp_ring.cpp; no communication)
# A benchmark phase builds only the nnstrain binary if there is none (or uses
# NNSTRAIN_BIN, or runs/battery_bin/nnstrain carried from an earlier call).
#
# Needs, carried next to the checkout: .gpu_bundle/ (bench/gpu/prepare.sh), or for a
# build there .debs/ (bench/gpu/fetch_deps.sh) and data/shakespeare_char/.
#
# Every phase is logged and time-boxed; the whole call keeps inside
# NNSTRAIN_BATTERY_BUDGET_S (default 560 s, one 10-minute device command):
# a phase that would start with too little time left is skipped and says so.
# After every phase the results are packed into $OUT (5 files at most):
#   summary.md, results.json, battery.log, gpu_<stamp>.tar.gz (the folder
#   bench/results/gpu_<stamp>/ with every log and metrics file), and nnstrain
#   (the binary, after a build, to carry into a second call as runs/battery_bin/).
#
# Environment: NNSTRAIN_BATTERY_SMOKE=1 (tiny shapes on the CPU, for a dry run
# on a machine without a GPU), NNSTRAIN_BATTERY_PYTHON (python3),
# NNSTRAIN_BUILD_DIR (build), NNSTRAIN_BIN, NNSTRAIN_BATTERY_PRECISION
# (override every config's precision), NNSTRAIN_BATTERY_TARGETS (build only
# these), NNSTRAIN_BATTERY_CMAKE_ARGS (extra configure arguments),
# NNSTRAIN_BATTERY_RESULTS (the results folder), NNSTRAIN_COMMIT,
# NNSTRAIN_BATTERY_SKIP_COMPILE=1 (leave out the torch.compile references),
# NNSTRAIN_BUNDLE (.gpu_bundle; a smoke run uses one only when this is set), NNSTRAIN_BATTERY_DATA
# (shakespeare_char's folder: the bundle's, else data/shakespeare_char).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# A bundle named relative to where the battery was started (before the cd below).
[ -n "${NNSTRAIN_BUNDLE:-}" ] && [ -d "$NNSTRAIN_BUNDLE" ] && NNSTRAIN_BUNDLE=$(cd "$NNSTRAIN_BUNDLE" && pwd)
cd "$root"
t_start=$(date +%s)
budget=${NNSTRAIN_BATTERY_BUDGET_S:-560}
smoke=${NNSTRAIN_BATTERY_SMOKE:-0}
py=${NNSTRAIN_BATTERY_PYTHON:-python3}
build=${NNSTRAIN_BUILD_DIR:-$root/build}
prefix=${NNSTRAIN_DEPS_PREFIX:-/tmp/nnstrain_deps}
stamp=$(date -u +%Y%m%d-%H%M%S)
if [ "$smoke" = 1 ]; then
  res=${NNSTRAIN_BATTERY_RESULTS:-$root/runs/battery_smoke/gpu_smoke_$stamp}
else
  res=${NNSTRAIN_BATTERY_RESULTS:-$root/bench/results/gpu_$stamp}
fi
out=${OUT:-$root/runs/battery_out}
mkdir -p "$res" "$out"
exec > >(tee -a "$res/battery.log") 2>&1

# The bundle prepare.sh made here (a smoke run on the CPU uses one only when asked to).
if [ -n "${NNSTRAIN_BUNDLE:-}" ] || [ "$smoke" != 1 ]; then bundle=${NNSTRAIN_BUNDLE:-$root/.gpu_bundle}; else bundle=""; fi
if [ -n "$bundle" ] && [ -f "$bundle/manifest.json" ]; then bundle=$(cd "$bundle" && pwd)  # LD_LIBRARY_PATH: absolute
elif [ -n "${NNSTRAIN_BUNDLE:-}" ]; then
  echo "[battery] FATAL: NNSTRAIN_BUNDLE=$NNSTRAIN_BUNDLE has no manifest.json (bench/gpu/prepare.sh makes one)" >&2; exit 1
else bundle=""; fi
phases=("$@")
if ((${#phases[@]} == 0)); then
  phases=(tests startup_oom gpt2 llama shakespeare cp_ring parallel_cuda doc_attention tests_more moe muon
          shakespeare_full)
  [ -z "$bundle" ] && phases=(build "${phases[@]}")
fi

say() { echo "[battery $(date -u +%H:%M:%S) +$(($(date +%s) - t_start))s] $*"; }
left() { echo $((budget - ($(date +%s) - t_start))); }

# Results into $OUT after every phase: what a killed call leaves still comes back.
# The device tool brings back files of at most 16 MiB: a folder packed larger
# leaves its profiler traces to a tarball of their own (dropped if that is too
# large too), so the logs and tables always come back.
pack() {
  cp -f "$res/summary.md" "$res/results.json" "$out/" 2>/dev/null
  cp -f "$res/battery.log" "$out/" 2>/dev/null
  local tgz="$out/$(basename "$res").tar.gz" max=$((15 << 20))
  tar czf "$tgz" -C "$(dirname "$res")" "$(basename "$res")" 2>/dev/null
  rm -f "$out/traces.tar.gz"
  if [ "$(stat -c %s "$tgz" 2>/dev/null || echo 0)" -gt "$max" ]; then
    tar czf "$tgz" --exclude='*trace*' -C "$(dirname "$res")" "$(basename "$res")" 2>/dev/null
    (cd "$(dirname "$res")" && find "$(basename "$res")" -type f -name '*trace*' -print0 |
       tar czf "$out/traces.tar.gz" --null -T -) 2>/dev/null
    if [ "$(stat -c %s "$out/traces.tar.gz" 2>/dev/null || echo 0)" -gt "$max" ]; then
      rm -f "$out/traces.tar.gz"
      say "the profiler traces packed exceed 15 MiB: left on the machine (their tables are in the results)"
    fi
  fi
}

# ---------------------------------------------------------------- the machine
say "results: $res; phases: ${phases[*]}; budget ${budget}s; smoke=$smoke"
{
  echo "## machine"; uname -a; nproc
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for t in cmake ninja c++ g++ nvcc; do printf '%s: ' "$t"; command -v "$t" >/dev/null && "$t" --version 2>&1 | head -1 || echo MISSING; done
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} 2>&1 | sed 's/^/  /'

# The python device tests need these beside torch (the H100 machine of 2026-11-22 had them):
# said once here, so a wall of identical test failures is not the first sign.
lacking=$("$py" -c 'import importlib.util as u; print(" ".join(m for m in ("pytest", "numpy", "safetensors") if u.find_spec(m) is None))' 2>&1)
[ -n "$lacking" ] && say "WARNING: $py lacks $lacking: the python device tests that import them will fail"

# ---------------------------------------------------------------- the Debian packages
# Unpacked into a private prefix (never into /); found by find_package through
# CMAKE_PREFIX_PATH and at run time through LD_LIBRARY_PATH.
if compgen -G "$root/.debs/*.deb" >/dev/null; then
  mkdir -p "$prefix"
  for d in "$root"/.debs/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$d" "$prefix" || say "dpkg -x $d failed"
    else  # a .deb is an ar archive holding data.tar.*
      (t=$(mktemp -d) && cd "$t" && ar x "$d" && tar xf data.tar.* -C "$prefix"; rm -rf "$t") || say "unpacking $d failed"
    fi
  done
  libdir=$(dirname "$(find "$prefix" -name 'libyaml-cpp.so*' | head -1)")
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "unpacked $(ls "$root"/.debs/*.deb | wc -l) packages into $prefix (libraries: $libdir)"
elif [ -z "$bundle" ]; then
  say "no .debs/ carried: the build relies on packages installed on this machine"
fi
[ -f "$root/.debs/commit.txt" ] && [ -z "${NNSTRAIN_COMMIT:-}" ] && export NNSTRAIN_COMMIT="$(cat "$root/.debs/commit.txt")"

# ---------------------------------------------------------------- the bundle
# prepare.sh's binaries against this machine's own torch (bench/gpu/bundle_env.sh):
# nothing is built here. A bundle that does not match its manifest or does not start
# ends the call at once, saying why (no silent build instead).
if [ -n "$bundle" ]; then
  source "$root/bench/gpu/bundle_env.sh"
  "$py" "$root/bench/gpu/bundle.py" verify --bundle "$bundle" \
    || { say "FATAL: $bundle does not match its manifest.json: run bench/gpu/prepare.sh again and carry .gpu_bundle"; pack; exit 1; }
  site=$("$py" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).resolve().parent.parent)')
  export LD_LIBRARY_PATH="$(bundle_library_path "$site" "$bundle")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! version=$("$bundle/bin/nnstrain" --version 2>&1) && grep -q "GLIBCXX\|CXXABI" <<<"$version"; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$bundle/lib/compat"  # this machine's libstdc++ is older than the build's
    say "this machine's libstdc++ is too old for the bundle: using its lib/compat"
    version=$("$bundle/bin/nnstrain" --version 2>&1)
  fi
  if ! "$bundle/bin/nnstrain" --version >/dev/null 2>&1; then
    say "FATAL: the bundled nnstrain does not start here: $(head -n 2 <<<"$version" | tr '\n' ' ')"
    pack; exit 1
  fi
  built_with=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["torch"])' "$bundle/manifest.json")
  here=$("$py" -c 'import torch; print(torch.__version__)')
  [ "${built_with%%+*}" = "${here%%+*}" ] \
    || say "WARNING: the bundle was built against torch $built_with, this machine has $here: a LibTorch ABI difference may show as crashes"
  export NNSTRAIN_BIN=${NNSTRAIN_BIN:-$bundle/bin/nnstrain}
  [ -z "${NNSTRAIN_COMMIT:-}" ] && export NNSTRAIN_COMMIT="$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["commit"])' "$bundle/manifest.json")"
  export NNSTRAIN_BATTERY_DATA=${NNSTRAIN_BATTERY_DATA:-$bundle/data/shakespeare_char}  # read there, not copied
  say "bundle $bundle (commit $NNSTRAIN_COMMIT): $(grep -m1 '^cuda:' <<<"$version"); libraries: $LD_LIBRARY_PATH"
fi

# ---------------------------------------------------------------- build
configure() {
  if [ -f "$build/CMakeCache.txt" ] && ! grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$root\$" "$build/CMakeCache.txt"; then
    say "build dir $build was configured for another checkout: starting it afresh"
    rm -rf "$build"
  fi
  [ -f "$build/CMakeCache.txt" ] && return 0
  local torch_prefix cuda_args=()
  torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || return 1
  if [ "$smoke" != 1 ]; then
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    cuda_args=(-DNNSTRAIN_WITH_CUDA=ON)
  fi
  say "configuring $build"
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$prefix/usr" -DNNSTRAIN_PYTHON="$(command -v "$py")" \
    "${cuda_args[@]}" ${NNSTRAIN_BATTERY_CMAKE_ARGS:-}
}

build_targets() {  # targets... (none: all)
  configure || return 1
  local t=()
  for x in "$@"; do t+=(--target "$x"); done
  say "building ${*:-everything}"
  cmake --build "$build" -j "$(nproc)" "${t[@]}"
}

nnstrain_bin() {  # prints the binary to benchmark, building it if need be
  if [ -n "${NNSTRAIN_BIN:-}" ]; then echo "$NNSTRAIN_BIN"; return 0; fi
  local carried=$root/runs/battery_bin/nnstrain  # built by an earlier call (its $OUT/nnstrain)
  if [ ! -f "$build/CMakeCache.txt" ] && [ -f "$carried" ]; then
    chmod +x "$carried"
    say "using the carried binary $carried (built by an earlier call; check it matches this commit)" >&2
    echo "$carried"; return 0
  fi
  build_targets nnstrain >&2 || return 1
  echo "$build/nnstrain"
}

# ---------------------------------------------------------------- phases
run_phase() {  # name cap_seconds command...
  local name=$1 cap=$2; shift 2
  local l; l=$(left)
  if ((l < 45)); then
    say "SKIPPED $name: ${l}s left of the ${budget}s budget"
    echo "$name: skipped (${l}s left)" >> "$res/phases.txt"
    return 0
  fi
  local t=$((cap < l - 15 ? cap : l - 15))
  say "phase $name (at most ${t}s)"
  local t0; t0=$(date +%s)
  PHASE_LIMIT=$t timeout --kill-after=10 "$t" "$@"
  local rc=$?
  say "phase $name: rc $rc in $(($(date +%s) - t0))s$([ $rc = 124 ] && echo ' (timed out)')"
  echo "$name: rc $rc, $(($(date +%s) - t0))s" >> "$res/phases.txt"
  pack
}

phase_build() {
  if [ -n "$bundle" ]; then say "bundle $bundle: nothing to build"; return 0; fi
  build_targets ${NNSTRAIN_BATTERY_TARGETS:-} || return 1
  if [ "$smoke" != 1 ] && [ -x "$build/nnstrain" ]; then
    cp -f "$build/nnstrain" "$out/nnstrain"  # carry into a second call as runs/battery_bin/nnstrain
    ldd "$build/nnstrain" | grep -E "not found|torch_cuda|yaml|spdlog|fmt" | sed 's/^/  /'
  fi
}

phase_tests() {  # first: issue 37 (a)'s checks (bundle.py FIRST); more: the rest of the label
  local part=$1 tdir=$build sel first out=$res/tests.json
  first=$("$py" "$root/bench/gpu/bundle.py" first) || return 1
  if [ "$part" = first ]; then sel=(-R "${NNSTRAIN_BATTERY_TESTS:-$first}")
  else sel=(-E "$first"); out=$res/tests_more.json; fi
  if [ -n "$bundle" ]; then  # the bundle's device tests, pointed at its binaries and this checkout
    tdir=$root/runs/battery_device_tests
    rm -rf "$tdir"
    "$py" "$root/bench/gpu/bundle.py" ctest --bundle "$bundle" --root "$root" --python "$(command -v "$py")" \
      --dir "$tdir" || return 1
  else
    build_targets ${NNSTRAIN_BATTERY_TARGETS:-} || return 1  # a no-op after the build phase
  fi
  local dev=cuda; [ "$smoke" = 1 ] && dev=cpu
  local n; n=$(cd "$tdir" && ctest -N -L device "${sel[@]}" | sed -n 's/^Total Tests: //p')
  if [ "${n:-0}" = 0 ]; then
    say "no test labelled 'device' matches ${sel[*]}: nothing to run"
    printf '{"summary": "no tests labelled device match", "rc": 0}\n' > "$out"
    return 0
  fi
  local jobs=$(($(nproc) / 2)); ((jobs < 4)) && jobs=4  # the tests share the one GPU; half the cores
  say "running $n device tests on $dev, $jobs at a time"
  # Stopped inside the phase's limit, so what finished is still summarised.
  (cd "$tdir" && NNSTRAIN_TEST_DEVICE=$dev timeout --kill-after=5 $((PHASE_LIMIT - 20)) \
     ctest -L device "${sel[@]}" -j "$jobs" --output-on-failure) > "${out%.json}.log" 2>&1
  local rc=$?
  "$py" - "${out%.json}.log" "$rc" "$dev" "$n" > "$out" <<'PY'
import json, re, sys
log, rc, dev, n = open(sys.argv[1], errors="replace").read(), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
done = re.findall(r"Test +#\d+: (\S+) \.+\W*(Passed|\*+Skipped|\*+Failed|\*+Timeout|\*+Exception|Not Run)\s+([\d.]+) sec", log)
ok = [t for t, r, _ in done if r == "Passed"]
skipped = [t for t, r, _ in done if r.strip("*") == "Skipped"]  # a CUDA-only check on a CPU run
bad = [f"{t} ({r.strip('*')})" for t, r, _ in done if r != "Passed" and t not in skipped]
summary = f"{len(ok)} of {n} passed on {dev}" + (f", {len(skipped)} skipped" if skipped else "") + (f"; {n - len(done)} did not finish (stopped at the phase's limit)"
                                                   if rc == 124 or len(done) < n else "")
print(json.dumps({"summary": summary, "rc": rc, "failed": "; ".join(bad),
                  "seconds": {t: float(s) for t, _, s in done}}))
PY
  tail -n 25 "${out%.json}.log"
  return $rc
}

phase_startup_oom() {
  # shakespeare_char widened to ~80 B parameters: its state (18 bytes each under
  # bf16-mixed) cannot fit one GPU, so the first big allocation fails at start-up.
  local bin d=$res/startup_oom
  if [ "$smoke" = 1 ]; then say "startup_oom: needs CUDA (a CPU cannot run out of device memory): nothing to do in a smoke run"; return 0; fi
  bin=$(nnstrain_bin) || return 1
  mkdir -p "$d"
  "$bin" --config "$root/bench/gpu/configs/shakespeare_char.yaml" --vars.data_dir "${NNSTRAIN_BATTERY_DATA:-$root/data/shakespeare_char}" \
    --run_dir "$d/run" --model.args.n_embd 4096 --model.args.n_head 32 --model.args.n_layer 400 \
    --compute_config.memory_budget_gb 100000 --memory_snapshot true --max_train_steps 1 > "$d/nnstrain.log" 2>&1
  local rc=$? snap=$d/run/memory/rank0_oom.pickle
  tail -n 3 "$d/nnstrain.log"
  say "startup_oom: rc $rc (want 1); snapshot $(ls -l "$snap" 2>/dev/null | awk '{print $5 " bytes"}' || echo MISSING)"
  [ "$rc" = 1 ] && grep -q "out of memory" "$d/nnstrain.log" && grep -q "memory snapshot $snap" "$d/nnstrain.log" \
    && [ -s "$snap" ]
}

phase_bench() {  # driver phases...
  local bin
  bin=$(nnstrain_bin) || { say "no nnstrain binary (the build failed): PyTorch references only"; bin=$build/nnstrain; }
  local args=(--results "$res" --nnstrain "$bin" --python "$(command -v "$py")" --time-limit $((PHASE_LIMIT - 10)))
  [ "$smoke" = 1 ] && args+=(--smoke)
  [ -n "${NNSTRAIN_BATTERY_PRECISION:-}" ] && args+=(--precision "$NNSTRAIN_BATTERY_PRECISION")
  [ -n "${NNSTRAIN_BATTERY_SKIP_COMPILE:-}" ] && args+=(--skip-compile)
  "$py" "$root/bench/gpu/driver.py" "$@" "${args[@]}"
}
phase_bench_binary() {  # PHASE TARGET: builds a bench binary (EXCLUDE_FROM_ALL) if need be, then the driver
  local phase=$1 target=$2 bin
  if [ -n "$bundle" ]; then bin=$bundle/bin/$target
  else build_targets "$target" >&2 || return 1; bin=$build/$target; fi
  local args=(--results "$res" --nnstrain "${NNSTRAIN_BIN:-$build/nnstrain}" --python "$(command -v "$py")"
              --time-limit $((PHASE_LIMIT - 10)) "--${phase//_/-}-bin" "$bin")
  [ "$smoke" = 1 ] && args+=(--smoke)
  "$py" "$root/bench/gpu/driver.py" "$phase" "${args[@]}"
}
export -f say left configure build_targets nnstrain_bin phase_build phase_tests phase_bench phase_startup_oom \
  phase_bench_binary
export root build prefix py smoke res out t_start budget bundle

for p in "${phases[@]}"; do
  case $p in
    build)            run_phase build 420 bash -c phase_build ;;
    tests)            run_phase tests 150 bash -c 'phase_tests first' ;;
    tests_more)       run_phase tests_more 240 bash -c 'phase_tests more' ;;
    matmul)           run_phase matmul 90 bash -c 'phase_bench matmul' ;;
    shakespeare)      run_phase shakespeare 330 bash -c 'phase_bench shakespeare' ;;
    gpt2)             run_phase gpt2 330 bash -c 'phase_bench gpt2' ;;
    muon)             run_phase muon 90 bash -c 'phase_bench muon' ;;
    parallel_cuda)    run_phase parallel_cuda 150 bash -c 'phase_bench parallel_cuda' ;;
    moe)              run_phase moe 120 bash -c 'phase_bench moe' ;;
    llama)            run_phase llama 420 bash -c 'phase_bench llama' ;;
    shakespeare_full) run_phase shakespeare_full 330 bash -c 'phase_bench shakespeare_full' ;;
    zero)             run_phase zero 300 bash -c 'phase_bench zero' ;;
    startup_oom)      run_phase startup_oom 120 bash -c phase_startup_oom ;;
    offload)          run_phase offload 420 bash -c 'phase_bench offload' ;;
    profile)          run_phase profile 540 bash -c 'phase_bench profile' ;;
    cp_ring)          run_phase cp_ring 360 bash -c 'phase_bench_binary cp_ring nnstrain_bench_cp_ring' ;;
    doc_attention)    run_phase doc_attention 120 bash -c 'phase_bench_binary doc_attention nnstrain_bench_doc_attention' ;;
    *) say "unknown phase '$p' (build tests matmul shakespeare gpt2 muon moe llama shakespeare_full zero startup_oom offload" \
         "profile cp_ring doc_attention parallel_cuda tests_more)" ;;
  esac
done
# The summary reads tests.json too; rewrite it once all phases are done.
"$py" "$root/bench/gpu/driver.py" summary --results "$res" --nnstrain "${NNSTRAIN_BIN:-$build/nnstrain}" \
  $([ "$smoke" = 1 ] && echo --smoke) >/dev/null 2>&1
pack
say "done in $(($(date +%s) - t_start))s; results in $res and $out"
cat "$res/summary.md" 2>/dev/null
