#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan, no LibTorch) in BUILD_DIR and
# runs each on its seeds and past crashes, then on new inputs:
#   tests/fuzz/run_fuzzers.sh BUILD_DIR SECONDS        # SECONDS split over the targets (CI: 60)
#   FUZZ_RUNS=1000000 tests/fuzz/run_fuzzers.sh BUILD_DIR 0   # a fixed number of inputs each
#   FUZZ_TARGETS="manifest config" ...                     # some targets only
#   FUZZ_BUILD_ONLY=1 tests/fuzz/run_fuzzers.sh BUILD_DIR    # build, run nothing (scripts/setup.sh:
#                                                            # the build is the build's, not the test's)
# Exits non-zero on any crash, leak, timeout or sanitizer report; the input that
# caused it is left in BUILD_DIR/artifacts/ (add it to regressions/<target> once fixed).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:?usage: run_fuzzers.sh BUILD_DIR SECONDS}
seconds=${2:-60}
read -r -a targets <<< "${FUZZ_TARGETS:-safetensors manifest config}"

cxx=${NNSTRAIN_FUZZ_CXX:-$(command -v clang++ || true)}
if [ -z "$cxx" ]; then
  echo "run_fuzzers.sh: clang++ not found (scripts/setup.sh installs clang and libclang-rt-dev)" >&2
  exit 1
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DNNSTRAIN_FUZZ=ON -DNNSTRAIN_BUILD_TESTS=OFF \
        -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build "$build" --target "${targets[@]/#/fuzz_}" >/dev/null
[ -n "${FUZZ_BUILD_ONLY:-}" ] && exit 0

mkdir -p "$build/artifacts"
# No allocation/free stacks recorded per malloc (~16% of an input's time under ASan):
# detection is unchanged; replay an artifact without this to see those stacks.
export ASAN_OPTIONS=${ASAN_OPTIONS:-malloc_context_size=0}
status=0
for t in "${targets[@]}"; do
  work="$build/corpus-work/$t"
  mkdir -p "$work"
  limit=(-max_total_time=$((seconds / ${#targets[@]})))
  [ -n "${FUZZ_RUNS:-}" ] && limit=(-runs="$FUZZ_RUNS")
  log="$build/fuzz_$t.log"
  start=$(date +%s.%N)
  # -timeout/-rss_limit_mb: one slow or memory-hungry input (an alias bomb) is a failure too.
  if "$build/fuzz_$t" "${limit[@]}" -timeout=5 -rss_limit_mb=2048 -max_len=8192 -print_final_stats=1 \
       -artifact_prefix="$build/artifacts/$t-" "$work" "$here/corpus/$t" "$here/regressions/$t" >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
    tail -40 "$log" >&2
  fi
  end=$(date +%s.%N)
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  printf 'fuzz_%-12s %s  %s inputs in %.1f s  (log %s)\n' "$t" "$result" "$runs" "$(awk "BEGIN{print $end - $start}")" "$log"
done
exit $status
