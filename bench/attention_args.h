// The attention benches' shared command line (cp_ring.cpp, doc_attention.cpp):
// device, dtype, shape and timing. A bench sets its own defaults in the struct it
// passes and takes its own options through `extra`; anything else is refused.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace nnstrain::bench {

struct AttentionArgs {
  std::string device = "cuda", dtype = "bf16";
  int64_t seq = 8192, heads = 32, kv_heads = 8, dim = 128, batch = 1;
  int repeats = 5, warmup = 2;
  bool check = false;
};

// extra(key, value): whether the bench took `key`; value() reads the option's value.
using ExtraOption = std::function<bool(const std::string& key, const std::function<std::string()>& value)>;

inline void parse_attention_args(int argc, char** argv, AttentionArgs& a, const ExtraOption& extra = {}) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const std::function<std::string()> v = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--device") a.device = v();
    else if (k == "--dtype") a.dtype = v();
    else if (k == "--seq") a.seq = std::stoll(v());
    else if (k == "--batch") a.batch = std::stoll(v());
    else if (k == "--heads") a.heads = std::stoll(v());
    else if (k == "--kv-heads") a.kv_heads = std::stoll(v());
    else if (k == "--dim") a.dim = std::stoll(v());
    else if (k == "--repeats") a.repeats = std::stoi(v());
    else if (k == "--warmup") a.warmup = std::stoi(v());
    else if (k == "--check") a.check = true;
    else if (!extra || !extra(k, v)) throw std::invalid_argument("unknown option '" + k + "'");
  }
  if (a.dtype != "bf16" && a.dtype != "fp32") throw std::invalid_argument("--dtype: bf16 or fp32, got '" + a.dtype + "'");
  if (a.repeats < 1) throw std::invalid_argument("--repeats must be at least 1");
  if (a.kv_heads < 1 || a.heads % a.kv_heads) throw std::invalid_argument("--heads must be a multiple of --kv-heads");
}

}  // namespace nnstrain::bench
