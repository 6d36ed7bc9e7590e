// libFuzzer target: the safetensors reader on arbitrary bytes. Contract: it either
// validates the file or throws SafetensorsError; a file it accepts can be read
// whole and sliced without touching a byte outside the mapping.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "trainer/checkpoint/safetensors.h"

using namespace nnstrain::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The reader maps a file: an anonymous in-memory one, named through /proc.
  static const int fd = ::memfd_create("fuzz.safetensors", 0);
  if (fd < 0) std::abort();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    SafetensorsReader r(path);
    uint64_t sum = 0;
    std::vector<uint8_t> buf;
    for (const auto& t : r.tensors()) {
      const uint8_t* p = r.data(t);
      for (uint64_t i = 0; i < t.nbytes(); ++i) sum += p[i];
      if (r.find(t.name) != &t) std::abort();
      // The whole tensor as a slice must equal its bytes.
      std::vector<int64_t> zeros(t.shape.size(), 0);
      buf.assign(t.nbytes(), 0);
      r.read_slice(t, zeros, t.shape, buf.data());
      for (uint64_t i = 0; i < t.nbytes(); ++i)
        if (buf[i] != p[i]) std::abort();
    }
    (void)sum;
  } catch (const SafetensorsError&) {
  }
  return 0;
}
