# Sourced by prepare.sh and battery.sh: the library path a bundled binary runs with.
#
#   bundle_library_path SITE BUNDLE    prints LD_LIBRARY_PATH's new head
#
# SITE: the site-packages folder holding the machine's torch (and the wheel's nvidia/*
# libraries); BUNDLE: .gpu_bundle. The bundle's binaries carry no RPATH, so they load
# LibTorch from wherever that machine has it: torch/lib, then the wheel's CUDA
# libraries (the binary needs libcudart itself; libtorch_cuda finds the rest through its
# own $ORIGIN rpath), then the bundle's Debian libraries, last the bundle's copy of
# libcudart (a torch without the nvidia wheels, e.g. one built against /usr/local/cuda).
# lib/compat (libstdc++, libgcc_s) is not on it: battery.sh adds it only when the
# machine's own libstdc++ is too old for the binary (newer than this one elsewhere).
bundle_library_path() {
  local site=$1 bundle=$2 dirs=() d
  [ -d "$site/torch/lib" ] && dirs+=("$site/torch/lib")
  for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && dirs+=("$d"); done
  dirs+=("$bundle/lib")
  [ -d "$bundle/lib/cuda" ] && dirs+=("$bundle/lib/cuda")
  (IFS=:; echo "${dirs[*]}")
}
