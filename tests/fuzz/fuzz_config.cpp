// libFuzzer target: the YAML config loader. Contract: load_trainer_args either
// returns or throws ConfigError (never a yaml-cpp or other exception), fast and
// in bounded memory whatever the text, with a short message.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <string>

#include "trainer/config/load.h"

using namespace nnstrain::config;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The loader reads a file: one per process, rewritten for every input.
  static const std::string path = "/tmp/nnstrain_fuzz_config_" + std::to_string(::getpid()) + ".yaml";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) std::abort();
  LoadOptions opts;
  opts.check_files = false;
  opts.models.names = {"gpt", "llama"};
  try {
    (void)load_trainer_args(path, opts);
  } catch (const ConfigError& e) {
    // Messages quote at most a short prefix of what they complain about: no line is long.
    const std::string msg = e.what();
    size_t start = 0;
    while (start <= msg.size()) {
      const size_t end = std::min(msg.find('\n', start), msg.size());
      if (end - start > 4096) std::abort();
      start = end + 1;
    }
  }
  return 0;
}
