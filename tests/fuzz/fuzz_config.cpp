// libFuzzer target: the YAML config loader. Contract: load_trainer_args either
// returns or throws ConfigError (never a yaml-cpp or other exception), fast and
// in bounded memory whatever the text, with a short message.
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <string>

#include "base/config/load.h"
#include "data/indexed/config_check.h"
#include "trainer/pipeline/config_check.h"

using namespace nnstrain::config;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The loader's own in-memory entry (load_trainer_args reads the file, then calls it):
  // no temporary file written and reread per input (about 8% of the time per input).
  static const LoadOptions opts = [] {
    LoadOptions o;
    o.check_files = false;
    o.checks = {nnstrain::parallel::pipeline::check_config_schedule, nnstrain::indexed::check_config_datasets};
    o.models.names = {"gpt", "llama"};
    return o;
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    (void)load_trainer_args_from_text(text, "fuzz.yaml", opts);
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
