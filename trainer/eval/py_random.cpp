#include "trainer/eval/py_random.h"

#include <cmath>
#include <set>
#include <stdexcept>

namespace nnstrain::eval {

namespace {
constexpr int kN = 624, kM = 397;
constexpr uint32_t kMatrixA = 0x9908b0dfU, kUpper = 0x80000000U, kLower = 0x7fffffffU;
}  // namespace

PyRandom::PyRandom(uint64_t seed) {
  // init_genrand(19650218), then init_by_array over the seed's 32-bit words, low first.
  std::vector<uint32_t> key;
  for (uint64_t s = seed; s; s >>= 32) key.push_back(static_cast<uint32_t>(s & 0xffffffffU));
  if (key.empty()) key.push_back(0);
  mt_[0] = 19650218U;
  for (int i = 1; i < kN; ++i) mt_[i] = 1812433253U * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + static_cast<uint32_t>(i);
  int i = 1;
  size_t j = 0;
  for (size_t k = std::max<size_t>(kN, key.size()); k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] + static_cast<uint32_t>(j);
    ++i, ++j;
    if (i >= kN) mt_[0] = mt_[kN - 1], i = 1;
    if (j >= key.size()) j = 0;
  }
  for (int k = kN - 1; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) - static_cast<uint32_t>(i);
    if (++i >= kN) mt_[0] = mt_[kN - 1], i = 1;
  }
  mt_[0] = 0x80000000U;
  index_ = kN;
}

uint32_t PyRandom::next_u32() {
  if (index_ >= kN) {
    for (int k = 0; k < kN; ++k) {
      const uint32_t y = (mt_[k] & kUpper) | (mt_[(k + 1) % kN] & kLower);
      mt_[k] = mt_[(k + kM) % kN] ^ (y >> 1) ^ ((y & 1U) ? kMatrixA : 0U);
    }
    index_ = 0;
  }
  uint32_t y = mt_[index_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  y ^= y >> 18;
  return y;
}

uint64_t PyRandom::getrandbits(int k) {
  if (k <= 0) return 0;
  if (k <= 32) return next_u32() >> (32 - k);
  // Words low first; the last one keeps its top bits (random_getrandbits).
  const uint64_t low = next_u32();
  const uint64_t high = next_u32() >> (64 - k);
  return low | (high << 32);
}

uint64_t PyRandom::randbelow(uint64_t n) {
  int k = 0;
  for (uint64_t v = n; v; v >>= 1) ++k;  // n.bit_length()
  uint64_t r = getrandbits(k);
  while (r >= n) r = getrandbits(k);
  return r;
}

std::vector<size_t> PyRandom::sample(size_t n, size_t k) {
  if (k > n) throw std::invalid_argument("sample larger than population");
  std::vector<size_t> out(k);
  size_t setsize = 21;  // CPython's threshold between a pool copy and a set of picks
  if (k > 5) setsize += static_cast<size_t>(std::pow(4.0, std::ceil(std::log(double(k) * 3) / std::log(4.0))));
  if (n <= setsize) {
    std::vector<size_t> pool(n);
    for (size_t i = 0; i < n; ++i) pool[i] = i;
    for (size_t i = 0; i < k; ++i) {
      const size_t j = randbelow(n - i);
      out[i] = pool[j];
      pool[j] = pool[n - i - 1];
    }
  } else {
    std::set<size_t> selected;
    for (size_t i = 0; i < k; ++i) {
      size_t j = randbelow(n);
      while (selected.count(j)) j = randbelow(n);
      selected.insert(j);
      out[i] = j;
    }
  }
  return out;
}

}  // namespace nnstrain::eval
