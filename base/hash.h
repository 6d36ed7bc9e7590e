// Small, stable, non-cryptographic hashes: the same value on every machine and
// build (seeds derived from names, plan and config fingerprints).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace nnstrain::base {

// SplitMix64's finaliser: mixes a 64-bit value (for deriving seeds).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// FNV-1a, 64 bits.
inline uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ULL;
  return h;
}

// fnv1a as 16 hex digits.
inline std::string fnv1a_hex(const std::string& s) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(fnv1a(s)));
  return buf;
}

}  // namespace nnstrain::base
