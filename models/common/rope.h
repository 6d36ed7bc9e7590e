// Rotary position embeddings' frequencies, every scaling kind transformers'
// ROPE_INIT_FUNCTIONS computes (default, linear, dynamic, yarn, longrope,
// llama3), with its op sequence so the frequencies match it bit for bit in
// fp32. Declared once here; the decoders read it from their config
// (`rope_scaling` in model.args, config.json's `rope_scaling` or `rope_parameters`).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/config/arg_map.h"

namespace nnstrain::models::common {

struct RopeScaling {
  std::string rope_type = "default";  // default | linear | dynamic | yarn | longrope | llama3
  double factor = 8.0;                // linear, dynamic, yarn, llama3 (longrope: 0 = max / original)
  // llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;  // llama3, yarn, longrope
  // yarn
  double beta_fast = 32.0, beta_slow = 1.0, mscale = 0.0, mscale_all_dim = 0.0;
  bool truncate = true;
  double attention_factor = 0.0;  // yarn, longrope: 0 = derived from factor
  // longrope: per-frequency divisors at and below original_max_position_embeddings, and beyond
  std::vector<double> short_factor, long_factor;
  bool scaled() const { return rope_type != "default"; }
};

// Frequencies [dim / 2] fp32 and the factor cos and sin are multiplied by.
struct RopeFrequencies {
  at::Tensor inv_freq;
  double attention_scaling = 1.0;
};
// `seq_len`: the sequence (the largest position + 1) they are for: longrope
// takes its long factors beyond original_max_position_embeddings (transformers
// chooses per forward call); dynamic scales only beyond max_position_embeddings,
// which nnstrain never runs, so it is the plain frequencies.
RopeFrequencies rope_frequencies(const RopeScaling& s, double theta, int64_t dim, int64_t max_position_embeddings,
                                 int64_t seq_len = 0);
// Whether the frequencies depend on seq_len (longrope).
inline bool rope_depends_on_length(const RopeScaling& s) { return s.rope_type == "longrope"; }

// model.args.rope_scaling (a child mapping); `max_position_embeddings` fills what it defaults.
RopeScaling parse_rope_scaling(config::ArgMap& a, int64_t max_position_embeddings, int64_t dim);
// config.json: `rope` is rope_scaling or rope_parameters (transformers 5), `key` its name for
// messages; `j` the whole config (Phi-3 keeps original_max_position_embeddings at the top).
// Throws std::runtime_error naming the key on a type it does not know or a missing value.
RopeScaling rope_scaling_from_hf(const nlohmann::json& rope, const std::string& key, const nlohmann::json& j,
                                 int64_t max_position_embeddings, int64_t dim);
// As config.json's rope_scaling (null for the default), with exactly the keys parse_rope_scaling reads.
nlohmann::json rope_scaling_to_hf(const RopeScaling& s);

}  // namespace nnstrain::models::common
