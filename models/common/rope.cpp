#include "models/common/rope.h"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

namespace nnstrain::models::common {

namespace {

// theta^(2i / dim) for i < dim / 2, as transformers forms it (int64 arange, then float).
torch::Tensor pos_freqs(double theta, int64_t dim) {
  return torch::pow(theta, torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / dim);
}

double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

}  // namespace

RopeFrequencies rope_frequencies(const RopeScaling& s, double theta, int64_t dim, int64_t max_pos, int64_t seq_len) {
  const auto& t = s.rope_type;
  if (t == "default" || t == "dynamic") return {pos_freqs(theta, dim).reciprocal(), 1.0};
  if (t == "linear") return {pos_freqs(theta, dim).reciprocal() / s.factor, 1.0};
  if (t == "llama3") {
    // Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
    const auto inv_freq = pos_freqs(theta, dim).reciprocal();
    const double old_context_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_context_len / s.low_freq_factor;
    const double high_freq_wavelen = old_context_len / s.high_freq_factor;
    const auto wavelen = inv_freq.reciprocal() * (2 * M_PI);
    auto inv_freq_llama = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
    const auto smooth_factor =
        (wavelen.reciprocal() * old_context_len - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const auto smoothed_inv_freq =
        torch::rsub(smooth_factor, 1) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama;
    const auto is_medium_freq =
        (wavelen < high_freq_wavelen).logical_not().logical_and((wavelen > low_freq_wavelen).logical_not());
    return {torch::where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0};
  }
  if (t == "yarn") {
    const double factor = s.factor;
    double attention = s.attention_factor;
    if (attention == 0)
      attention = s.mscale != 0 && s.mscale_all_dim != 0
                      ? yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
                      : yarn_mscale(factor, 1.0);
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return (dim * std::log(orig / (rotations * 2 * M_PI))) / (2 * std::log(theta));
    };
    double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
    if (s.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
    const auto freqs = pos_freqs(theta, dim);
    const auto extrapolation = freqs.reciprocal();
    const auto interpolation = (freqs * factor).reciprocal();
    const auto ramp = ((torch::arange(dim / 2, torch::kFloat) - low) / (high - low)).clamp(0, 1);
    const auto extrapolation_factor = torch::rsub(ramp, 1);
    return {interpolation * torch::rsub(extrapolation_factor, 1) + extrapolation * extrapolation_factor, attention};
  }
  if (t == "longrope") {
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    const double factor = s.factor > 0 ? s.factor : static_cast<double>(max_pos) / orig;
    double attention = s.attention_factor;
    if (attention == 0) attention = factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(orig));
    const auto& ext = seq_len > s.original_max_position_embeddings ? s.long_factor : s.short_factor;
    const auto ext_t = torch::tensor(ext, torch::kDouble).to(torch::kFloat);
    return {(ext_t * pos_freqs(theta, dim)).reciprocal(), attention};
  }
  throw std::invalid_argument("rope_scaling.rope_type '" + t + "' is not supported");
}

RopeScaling parse_rope_scaling(config::ArgMap& a, int64_t max_pos, int64_t dim) {
  RopeScaling s;
  s.rope_type = a.get_string("rope_type", std::nullopt, {"default", "linear", "dynamic", "yarn", "longrope", "llama3"});
  const auto& t = s.rope_type;
  if (t == "linear" || t == "dynamic") s.factor = a.get_float("factor", std::nullopt, 1.0);
  if (t == "llama3") {
    s.factor = a.get_float("factor", s.factor, 1.0);
    s.low_freq_factor = a.get_float("low_freq_factor", s.low_freq_factor, 0.0);
    s.high_freq_factor = a.get_float("high_freq_factor", s.high_freq_factor, 0.0);
    s.original_max_position_embeddings =
        a.get_int("original_max_position_embeddings", s.original_max_position_embeddings, 1);
    if (!(s.high_freq_factor > s.low_freq_factor) || s.low_freq_factor <= 0)
      a.fail("high_freq_factor", "need 0 < low_freq_factor < high_freq_factor, got " +
                                     std::to_string(s.low_freq_factor) + " and " + std::to_string(s.high_freq_factor));
  }
  if (t == "yarn" || t == "longrope")
    s.original_max_position_embeddings = a.get_int("original_max_position_embeddings", max_pos, 1);
  if (t == "yarn") {
    s.factor = a.get_float("factor", std::nullopt, 1.0);
    s.beta_fast = a.get_float("beta_fast", 32.0, 0.0);
    s.beta_slow = a.get_float("beta_slow", 1.0, 0.0);
    s.mscale = a.get_float("mscale", 0.0, 0.0);
    s.mscale_all_dim = a.get_float("mscale_all_dim", 0.0, 0.0);
    s.truncate = a.get_bool("truncate", true);
    s.attention_factor = a.get_float("attention_factor", 0.0, 0.0);
  }
  if (t == "longrope") {
    s.factor = a.get_float("factor", 0.0, 0.0);
    s.attention_factor = a.get_float("attention_factor", 0.0, 0.0);
    s.short_factor = a.get_float_list("short_factor");
    s.long_factor = a.get_float_list("long_factor");
    for (const char* k : {"short_factor", "long_factor"}) {
      const auto& f = std::string(k) == "short_factor" ? s.short_factor : s.long_factor;
      if (static_cast<int64_t>(f.size()) != dim / 2)
        a.fail(k, "has " + std::to_string(f.size()) + " factors; the rotary dimension " + std::to_string(dim) +
                      " needs " + std::to_string(dim / 2));
    }
  }
  return s;
}

RopeScaling rope_scaling_from_hf(const nlohmann::json& rope, const std::string& key, const nlohmann::json& j,
                                 int64_t max_pos, int64_t dim) {
  RopeScaling s;
  auto str = [&](const char* k, const std::string& def) {
    if (!rope.contains(k) || rope.at(k).is_null()) return def;
    if (!rope.at(k).is_string()) throw std::runtime_error("config.json: " + key + "." + k + " is not a string");
    return rope.at(k).get<std::string>();
  };
  auto num = [&](const char* k, std::optional<double> def) -> double {
    if (!rope.contains(k) || rope.at(k).is_null()) {
      if (!def) throw std::runtime_error("config.json: " + key + "." + k + " is missing");
      return *def;
    }
    if (!rope.at(k).is_number()) throw std::runtime_error("config.json: " + key + "." + k + " is not a number");
    return rope.at(k).get<double>();
  };
  auto list = [&](const char* k) {
    if (!rope.contains(k) || !rope.at(k).is_array())
      throw std::runtime_error("config.json: " + key + "." + k + " is missing (a list of numbers)");
    std::vector<double> v;
    for (const auto& x : rope.at(k)) {
      if (!x.is_number()) throw std::runtime_error("config.json: " + key + "." + k + " holds a non-number");
      v.push_back(x.get<double>());
    }
    if (static_cast<int64_t>(v.size()) != dim / 2)
      throw std::runtime_error("config.json: " + key + "." + k + " has " + std::to_string(v.size()) +
                               " factors; the rotary dimension " + std::to_string(dim) + " needs " +
                               std::to_string(dim / 2));
    return v;
  };
  s.rope_type = str("rope_type", str("type", "default"));
  const auto& t = s.rope_type;
  // Phi-3 keeps it at the top; transformers moves it into the rope parameters.
  const double top_orig = j.contains("original_max_position_embeddings") && j.at("original_max_position_embeddings").is_number()
                              ? j.at("original_max_position_embeddings").get<double>()
                              : static_cast<double>(max_pos);
  if (t == "default") return s;
  if (t == "linear" || t == "dynamic") {
    s.factor = num("factor", std::nullopt);
  } else if (t == "llama3") {
    s.factor = num("factor", std::nullopt);
    s.low_freq_factor = num("low_freq_factor", std::nullopt);
    s.high_freq_factor = num("high_freq_factor", std::nullopt);
    s.original_max_position_embeddings = static_cast<int64_t>(num("original_max_position_embeddings", max_pos));
  } else if (t == "yarn") {
    s.original_max_position_embeddings = static_cast<int64_t>(num("original_max_position_embeddings", top_orig));
    s.factor = num("factor", static_cast<double>(max_pos) / s.original_max_position_embeddings);
    s.beta_fast = num("beta_fast", 32.0);
    s.beta_slow = num("beta_slow", 1.0);
    s.mscale = num("mscale", 0.0);
    s.mscale_all_dim = num("mscale_all_dim", 0.0);
    s.attention_factor = num("attention_factor", 0.0);
    if (rope.contains("truncate") && rope.at("truncate").is_boolean()) s.truncate = rope.at("truncate").get<bool>();
  } else if (t == "longrope") {
    s.original_max_position_embeddings = static_cast<int64_t>(num("original_max_position_embeddings", top_orig));
    s.factor = num("factor", 0.0);
    s.attention_factor = num("attention_factor", 0.0);
    s.short_factor = list("short_factor");
    s.long_factor = list("long_factor");
  } else {
    throw std::runtime_error("config.json: " + key + ".rope_type '" + t +
                             "' is not supported (default, linear, dynamic, yarn, longrope, llama3)");
  }
  if (s.original_max_position_embeddings < 1)
    throw std::runtime_error("config.json: " + key + ".original_max_position_embeddings must be at least 1");
  return s;
}

nlohmann::json rope_scaling_to_hf(const RopeScaling& s) {
  const auto& t = s.rope_type;
  if (t == "default") return nullptr;
  nlohmann::json r = {{"rope_type", t}};
  if (t != "longrope" || s.factor > 0) r["factor"] = s.factor;
  if (t == "llama3") {
    r["low_freq_factor"] = s.low_freq_factor;
    r["high_freq_factor"] = s.high_freq_factor;
  }
  if (t == "llama3" || t == "yarn" || t == "longrope")
    r["original_max_position_embeddings"] = s.original_max_position_embeddings;
  if (t == "yarn") {
    r["beta_fast"] = s.beta_fast;
    r["beta_slow"] = s.beta_slow;
    if (s.mscale != 0) r["mscale"] = s.mscale;
    if (s.mscale_all_dim != 0) r["mscale_all_dim"] = s.mscale_all_dim;
    if (!s.truncate) r["truncate"] = false;
  }
  if ((t == "yarn" || t == "longrope") && s.attention_factor != 0) r["attention_factor"] = s.attention_factor;
  if (t == "longrope") {
    r["short_factor"] = s.short_factor;
    r["long_factor"] = s.long_factor;
  }
  return r;
}

}  // namespace nnstrain::models::common
