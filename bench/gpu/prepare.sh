#!/usr/bin/env bash
# Run HERE (the CPU dev machine: CUDA toolkit, the setup's venv) before a GPU call.
# Builds everything the battery runs and packs it into .gpu_bundle/ (ignored,
# under 60 MiB), which the device tool carries; on the GPU machine battery.sh
# runs it against that machine's own PyTorch with no build step.
#
#   bash bench/gpu/prepare.sh             # build_gpu/ -> .gpu_bundle/, then the check
#   bash bench/gpu/prepare.sh --check     # the check alone, on an existing bundle
#
# then:  run(command="bash bench/gpu/battery.sh", carry=[".gpu_bundle"])
#
# .gpu_bundle/
#   bin/        nnstrain, nnstrain_tests (unit), nnstrain_nccl_graph_check (device check),
#               nnstrain_bench_cp_ring, nnstrain_bench_doc_attention: stripped, no RPATH
#   lib/        the Debian libraries they load (yaml-cpp, spdlog, fmt, zstd, liburing)
#   lib/cuda/   libcudart, used only where the machine's torch has no nvidia wheels
#   lib/compat/ libstdc++ and libgcc_s, used only where the machine's are too old
#   data/shakespeare_char/, device_tests.json (bundle.py export), manifest.json
#
# The build: CUDA on (NNSTRAIN_WITH_CUDA=ON: a toolkit-less configure fails instead of
# silently bundling a CPU-only binary), Release, CMAKE_SKIP_RPATH (nothing may point at
# this machine's venv). nnstrain has no device code of its own (its CUDA side is host
# C++ over ATen, cuBLAS, cuDNN and NCCL), so no kernel is compiled for an architecture:
# the kernels come from the GPU machine's LibTorch; TORCH_CUDA_ARCH_LIST="9.0;10.0"
# (H100/H200, B200) is set for LibTorch's CMake all the same.
#
# The check simulates a fresh CPU-only machine in a private mount namespace: the
# venv's site-packages is bind-mounted elsewhere and the venv, the build folders and
# /usr/local/cuda are hidden under empty tmpfs mounts; every binary must then resolve
# each library to the bundle, the moved torch or the C library (ldd), and run: nnstrain
# --version names this commit, the unit binary lists its [device] cases, the device
# check skips (no CUDA), nnstrain trains 3 CPU steps of the bundled shakespeare_char.
# A missing library shows here, before a GPU is lent.
#
# Environment: NNSTRAIN_VENV, NNSTRAIN_GPU_BUILD_DIR (build_gpu), NNSTRAIN_BUNDLE
# (.gpu_bundle), NNSTRAIN_BUNDLE_FROM (take the binaries from this existing build folder
# instead of building; CI's smoke test: its RPATHs are then only reported).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${NNSTRAIN_VENV:-$HOME/.cache/nnstrain/venv}
py=$venv/bin/python
build=${NNSTRAIN_BUNDLE_FROM:-${NNSTRAIN_GPU_BUILD_DIR:-$root/build_gpu}}
bundle=$(realpath -m "${NNSTRAIN_BUNDLE:-$root/.gpu_bundle}")
limit_mib=60
mode=${1:-build}
case $mode in build|--check) ;; *) echo "usage: prepare.sh [--check]" >&2; exit 2 ;; esac
source "$root/bench/gpu/bundle_env.sh"

say() { echo "[prepare] $*" >&2; }
die() { echo "[prepare] error: $*" >&2; exit 1; }
[ -x "$py" ] || die "no Python at $py (run scripts/setup.sh, or set NNSTRAIN_VENV)"
site=$("$py" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).resolve().parent.parent)')
libpath=$(bundle_library_path "$site" "$bundle")
# bundle.py's binaries, as (path in the build folder) -> bin/<name>
targets=(nnstrain nnstrain_tests nnstrain_nccl_graph_check nnstrain_bench_cp_ring nnstrain_bench_doc_attention)
in_build=(nnstrain tests/nnstrain_tests tests/nnstrain_nccl_graph_check nnstrain_bench_cp_ring
          nnstrain_bench_doc_attention)

build_binaries() {
  if [ -z "${NNSTRAIN_BUNDLE_FROM:-}" ]; then
    if [ ! -f "$build/CMakeCache.txt" ]; then
      command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
      local torch_prefix
      torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
      say "configuring $build (CUDA on, Release, no RPATH)"
      mkdir -p "$build"
      TORCH_CUDA_ARCH_LIST="9.0;10.0" cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$torch_prefix" -DNNSTRAIN_PYTHON="$py" -DNNSTRAIN_WITH_CUDA=ON \
        -DCMAKE_SKIP_RPATH=ON > "$build/configure.log" || die "configure failed: $build/configure.log"
    fi
    say "building ${targets[*]} in $build"
    cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" > "$build/bundle_build.log" \
      || { tail -n 30 "$build/bundle_build.log" >&2; die "build failed: $build/bundle_build.log"; }
  fi
  grep -q "nnstrain: CUDA on" "$build/configure.log" 2>/dev/null || grep -q "^NNSTRAIN_WITH_CUDA.*=ON" "$build/CMakeCache.txt" \
    || say "warning: $build may not be a CUDA build (its configure.log does not say 'CUDA on')"
}

# The libraries a binary loads, as "soname path" lines (ldd, with the venv's torch on the path).
libraries_of() { LD_LIBRARY_PATH=$libpath ldd "$1" | awk '$2 == "=>" {print $1, $3}'; }

pack() {
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib/cuda" "$bundle/lib/compat" "$bundle/data"
  local i soname path
  for i in "${!targets[@]}"; do
    if [ ! -x "$build/${in_build[$i]}" ]; then
      # An existing build need not have the benches (EXCLUDE_FROM_ALL); a bundle built here has all.
      [ -n "${NNSTRAIN_BUNDLE_FROM:-}" ] && [[ ${targets[$i]} == nnstrain_bench_* ]] \
        && { say "note: $build has no ${in_build[$i]}: left out"; continue; }
      die "$build/${in_build[$i]} missing"
    fi
    strip --strip-unneeded -o "$bundle/bin/${targets[$i]}" "$build/${in_build[$i]}"
  done
  while read -r soname path; do
    [ "$path" = "not" ] && die "${soname} not found for a bundled binary (ldd)"
    case $path in "$site"/*) continue ;; esac  # the GPU machine's torch provides it
    case $soname in
      libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|libutil.so.*|ld-linux*) continue ;;
      libstdc++.so.*|libgcc_s.so.*) cp -L "$path" "$bundle/lib/compat/$soname" ;;
      libcudart.so.*) cp -L "$path" "$bundle/lib/cuda/$soname" ;;
      *) cp -L "$path" "$bundle/lib/$soname" ;;
    esac
  done < <(for b in "$bundle"/bin/*; do libraries_of "$b"; done | sort -u)
  # From the checkout: prepare finds tiny Shakespeare in ../shared beside it (no download).
  (cd "$root" && LD_LIBRARY_PATH=$libpath "$bundle/bin/nnstrain" prepare shakespeare_char \
     --out "$bundle/data/shakespeare_char" >&2) || die "nnstrain prepare shakespeare_char failed"
  rm -f "$bundle/data/shakespeare_char/input.txt"
  "$py" "$root/bench/gpu/bundle.py" export --build "$build" --bundle "$bundle" >&2
  local commit nvcc_bin
  commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
  git -C "$root" diff --quiet HEAD -- 2>/dev/null || commit="$commit-dirty"
  nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  "$py" "$root/bench/gpu/bundle.py" manifest --bundle "$bundle" --commit "$commit" \
    --torch "$("$py" -c 'import torch; print(torch.__version__)')" \
    --toolkit "$("$nvcc_bin" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')" >&2
  local mib
  mib=$(du -sm "$bundle" | cut -f1)
  ((mib < limit_mib)) || die "$bundle is ${mib} MiB, over the ${limit_mib} MiB the device tool carries"
  say "$bundle: ${mib} MiB"
}

# The check (run_check calls it in a private mount namespace): system python3 only, the venv may be hidden.
check_here() {
  set +e  # every failure is counted and reported, none ends the check
  local moved=$1 bundle_copy=$2 fails=0 b
  local site_moved=$moved/site-packages
  local lp
  lp=$(bundle_library_path "$site_moved" "$bundle_copy")
  python3 "$root/bench/gpu/bundle.py" verify --bundle "$bundle_copy" >&2 || fails=1
  for b in "$bundle_copy"/bin/*; do
    local rp
    rp=$(readelf -d "$b" | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]/\2/p')
    if [ -n "$rp" ]; then
      if [ -n "${NNSTRAIN_BUNDLE_FROM:-}" ]; then say "note: $(basename "$b") keeps the RPATH $rp (NNSTRAIN_BUNDLE_FROM)"
      else say "FAIL $(basename "$b"): RPATH/RUNPATH $rp points at this machine"; fails=1; fi
    fi
    local bad
    bad=$(LD_LIBRARY_PATH=$lp ldd "$b" | awk -v ok1="$bundle_copy/" -v ok2="$site_moved/" '
      /not found/ {print; next}
      $2 == "=>" && index($3, ok1) != 1 && index($3, ok2) != 1 && $1 !~ /^(libc|libm|libdl|libpthread|librt|libutil)\.so|^ld-linux|^libstdc\+\+|^libgcc_s/ {print}')
    if [ -n "$bad" ]; then say "FAIL $(basename "$b") resolves outside the bundle and the moved torch:"; echo "$bad" >&2; fails=1; fi
  done
  local work out
  work=$(mktemp -d)
  out=$(cd "$work" && env -i PATH=/usr/bin:/bin HOME="$work" LD_LIBRARY_PATH="$lp" "$bundle_copy/bin/nnstrain" --version 2>&1) \
    || { say "FAIL nnstrain --version: $out"; fails=1; }
  say "nnstrain --version: $out"
  local want
  want=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["commit"][:12])' "$bundle_copy/manifest.json")
  case $out in *"${want%-dirty}"*) ;; *) say "FAIL nnstrain --version does not name the bundle's commit $want"; fails=1 ;; esac
  # (Catch2 v2's --list-* exits with the number of cases listed)
  out=$(env -i PATH=/usr/bin:/bin HOME="$work" LD_LIBRARY_PATH="$lp" "$bundle_copy/bin/nnstrain_tests" "[device]" --list-test-names-only 2>&1)
  case $out in *"error while loading"*|"") say "FAIL nnstrain_tests: $out"; fails=1 ;; esac
  say "nnstrain_tests [device]: $(echo "$out" | grep -c .) cases"
  env -i PATH=/usr/bin:/bin HOME="$work" LD_LIBRARY_PATH="$lp" "$bundle_copy/bin/nnstrain_nccl_graph_check" > "$work/check.log" 2>&1
  local rc=$?
  if [ "$rc" != 77 ]; then say "FAIL nnstrain_nccl_graph_check: exit $rc, want 77 (skipped without CUDA): $(tail -n 3 "$work/check.log")"; fails=1; fi
  for b in nnstrain_bench_cp_ring nnstrain_bench_doc_attention; do
    [ -e "$bundle_copy/bin/$b" ] || continue  # left out of a bundle taken from an existing build
    env -i PATH=/usr/bin:/bin HOME="$work" LD_LIBRARY_PATH="$lp" "$bundle_copy/bin/$b" --help > "$work/$b.log" 2>&1
    grep -q "error while loading shared libraries" "$work/$b.log" && { say "FAIL $b: $(head -n 1 "$work/$b.log")"; fails=1; }
  done
  (cd "$work" && env -i PATH=/usr/bin:/bin HOME="$work" OMP_NUM_THREADS=2 LD_LIBRARY_PATH="$lp" \
     "$bundle_copy/bin/nnstrain" --config "$root/configs/shakespeare_char.yaml" \
     --vars.data_dir "$bundle_copy/data/shakespeare_char" --run_dir "$work/run" --compute_config.device cpu \
     --model.args.n_layer 1 --model.args.n_embd 64 --model.args.n_head 2 --micro_batch_size 2 --global_batch_size 2 \
     --max_train_steps 3 --log_progress_every_n_train_steps 1 --val_every_n_train_steps 0 > "$work/train.log" 2>&1) \
    || { say "FAIL a 3-step CPU run from the bundle: $(tail -n 3 "$work/train.log")"; fails=1; }
  local steps
  steps=$(grep -c '"ms_per_step"' "$work/run/metrics.jsonl" 2>/dev/null || echo 0)
  [ "$steps" -ge 1 ] || { say "FAIL the CPU run logged no step"; fails=1; }
  say "a CPU run from the bundle: $steps logged steps"
  rm -rf "$work"
  return $fails
}

run_check() {
  local moved copy rc=0 isolated=0
  moved=$(mktemp -d /tmp/nnstrain_moved.XXXXXX)
  copy=$moved/bundle
  cp -a "$bundle" "$copy"
  if unshare -m --propagation private true 2>/dev/null; then
    say "check: a private mount namespace; the venv ($venv), the build folders and /usr/local/cuda hidden, torch moved to $moved"
    isolated=1
    mkdir -p "$moved/site-packages"
    local hide=("$venv" "$build" "$root/build")
    [ -d /usr/local/cuda ] && hide+=(/usr/local/cuda)
    export -f check_here say bundle_library_path
    export root NNSTRAIN_BUNDLE_FROM
    # From outside the folders about to be hidden (a working directory under one would vanish).
    (cd "$moved" && NNSTRAIN_CHECK_HIDE="${hide[*]}" unshare -m --propagation private bash -c '
      mount --bind "$1" "$2/site-packages" || exit 3
      for d in $NNSTRAIN_CHECK_HIDE; do if [ -d "$d" ]; then mount -t tmpfs none "$d" || exit 3; fi; done
      check_here "$2" "$3"' check "$site" "$moved" "$copy") || rc=$?
  else
    say "check: no mount namespace here (unshare -m refused): the libraries' resolution and the runs only, venv in place"
    mkdir -p "$moved/site-packages"
    ln -s "$site/torch" "$moved/site-packages/torch"
    ln -s "$site/nvidia" "$moved/site-packages/nvidia"
    (cd "$moved" && check_here "$moved" "$copy") || rc=$?
  fi
  rm -rf "$moved"
  if [ $rc = 0 ] && [ "$isolated" = 1 ]; then say "check passed: $bundle loads and runs without this machine's paths"
  elif [ $rc = 0 ]; then say "check passed, venv in place: $bundle resolves its libraries to itself and torch, and runs"
  else say "check FAILED"; fi
  return $rc
}

if [ "$mode" = build ]; then
  build_binaries
  pack
fi
run_check
