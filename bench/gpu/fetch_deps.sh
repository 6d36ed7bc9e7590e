#!/usr/bin/env bash
# The fallback for a GPU call without .gpu_bundle/ (bench/gpu/prepare.sh, the usual
# way: nothing is built there). Run HERE (the dev machine, Debian with apt):
# downloads the Debian packages nnstrain's build needs that the GPU machine
# lacks (it has cmake, ninja, nvcc, a compiler and PyTorch, but no package
# registry) into .debs/ at the repository root, for the lead to carry.
# battery.sh unpacks them into a private prefix there (never into /).
#
# Also records the commit being measured in .debs/commit.txt: the GPU machine
# gets a copy of the working tree without .git.
#
#   bash bench/gpu/fetch_deps.sh          # then carry .debs (and data/shakespeare_char)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$root/.debs
mkdir -p "$out"

# scripts/setup.sh's C++ dependencies (third_party/dependencies.cmake), with the
# runtime libraries the -dev packages point at, and libgloo-dev: c10d's
# ProcessGroupGloo.hpp includes <gloo/...>, which the torch wheel does not ship
# (the GPU machine's first build failed on it). Build tools (cmake, ninja, g++) are there.
# libzstd-dev, liburing-dev, libxxhash-dev: optional features (.zst corpora, NVMe offload's io_uring
# engine and checksums) that a build without them leaves out, so the GPU build matches this one.
pkgs=(libyaml-cpp-dev libyaml-cpp0.7 nlohmann-json3-dev libspdlog-dev libspdlog1.10
      libfmt-dev libfmt9 catch2 libcxxopts-dev libgloo-dev libzstd-dev liburing-dev liburing2 libxxhash-dev)

missing=()
for p in "${pkgs[@]}"; do
  compgen -G "$out/${p}_*.deb" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[fetch_deps] downloading: ${missing[*]}" >&2
  (cd "$out" && apt-get download "${missing[@]}") || {
    echo "[fetch_deps] apt-get download failed; try 'apt-get update' first" >&2; exit 1; }
fi
for p in "${pkgs[@]}"; do
  compgen -G "$out/${p}_*.deb" >/dev/null || { echo "[fetch_deps] missing $p in $out" >&2; exit 1; }
done

commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
git -C "$root" diff --quiet HEAD -- 2>/dev/null || commit="$commit-dirty"
echo "$commit" > "$out/commit.txt"

echo "[fetch_deps] $out: $(ls "$out"/*.deb | wc -l) packages, $(du -sh "$out" | cut -f1) (commit $commit)" >&2
