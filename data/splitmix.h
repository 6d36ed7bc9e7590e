// The counter-based arithmetic behind the data streams, torch-free:
// splitmix64's finaliser (token_bin's window starts, the indexed datasets'
// permutations; the one in base/hash.h, named in data's namespace) and the
// base-2 van der Corput sequence that spreads validation batches over a file.
#pragma once

#include <cstdint>

#include "base/hash.h"

namespace nnstrain::data {

using base::splitmix64;

// floor(radical_inverse_2(k) * n): where validation batch k starts among n
// windows (0, n/2, n/4, 3n/4, ...), exact in 64-bit fixed point.
inline uint64_t van_der_corput_index(uint64_t k, uint64_t n) {
  uint64_t r = 0;  // k's bits reversed: its radical inverse as a 64-bit fraction of 1
  for (int i = 0; i < 64; ++i, k >>= 1) r = (r << 1) | (k & 1);
  return uint64_t((unsigned __int128)r * n >> 64);
}

}  // namespace nnstrain::data
