// Python's random.Random, as far as lm-evaluation-harness's few-shot sampler
// uses it: seeding from an integer (MT19937, init_by_array over the seed's
// 32-bit words) and sample() of k positions out of n, so that the same seed
// draws the same few-shot examples as the harness. Torch-free.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace nnstrain::eval {

class PyRandom {
 public:
  explicit PyRandom(uint64_t seed);
  uint32_t next_u32();                 // genrand_uint32
  uint64_t getrandbits(int k);         // k <= 64
  uint64_t randbelow(uint64_t n);      // _randbelow_with_getrandbits, n >= 1
  // random.sample(range(n), k): the chosen indices in draw order.
  std::vector<size_t> sample(size_t n, size_t k);

 private:
  std::array<uint32_t, 624> mt_{};
  int index_ = 625;
};

}  // namespace nnstrain::eval
