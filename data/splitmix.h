// splitmix64's finaliser: the counter-based hash behind the data streams
// (token_bin's window starts, the indexed datasets' permutations). Torch-free.
#pragma once

#include <cstdint>

namespace nnstrain::data {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace nnstrain::data
