#include "models/moe/gpt_oss.h"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "base/config/arg_map.h"

namespace nnstrain::models::moe {
// A named namespace so a unity batch holding moe_lm.cpp (its own Parsed, finish) still compiles.
namespace gpt_oss_detail {

struct Parsed : MoeLmConfig {
  bool mixture_of_experts() const override { return true; }
};

const char* const kSliding = "sliding_attention";
const char* const kFull = "full_attention";

// GptOssConfig's defaults where they are not LlamaConfig's.
void gpt_oss_defaults(MoeLmConfig& c) {
  c.model_type = "gpt_oss";
  c.attention_bias = true;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 150000.0;
  c.sliding_window = 128;
}

// The first key whose value the model cannot take, and why (none: fine).
std::optional<std::pair<std::string, std::string>> problem(const MoeLmConfig& c, const common::MoeOptions& o) {
  const auto n = [](auto v) { return std::to_string(v); };
  if (!c.layer_types.empty() && int64_t(c.layer_types.size()) != c.num_hidden_layers)
    return {{"layer_types", "has " + n(c.layer_types.size()) + " entries for num_hidden_layers " + n(c.num_hidden_layers)}};
  for (const auto& k : c.layer_types)
    if (k != kSliding && k != kFull) return {{"layer_types", "'" + k + "' is not full_attention or sliding_attention"}};
  if (o.top_k > o.num_experts)
    return {{"num_experts_per_tok", n(o.top_k) + " is more than num_local_experts " + n(o.num_experts)}};
  if (!(o.swiglu_limit > 0)) return {{"swiglu_limit", n(o.swiglu_limit) + " must be positive"}};
  if (c.mlp_bias) return {{"mlp_bias", "true: gpt_oss's experts have biases of their own (always)"}};
  return std::nullopt;
}

// What follows from the keys: each layer's window (GptOssConfig's default
// layer_types: even layers sliding), sinks, every layer sparse, the experts' form.
void finish(MoeLmConfig& c, common::MoeOptions o) {
  if (c.layer_types.empty())
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.layer_types.push_back((i + 1) % 2 ? kSliding : kFull);
  c.layer_windows.assign(c.num_hidden_layers, 0);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (c.layer_types[i] == kSliding) c.layer_windows[i] = c.sliding_window;  // 0: null, full
  c.attention_sinks = true;
  o.hidden_size = c.hidden_size;
  o.initializer_range = c.initializer_range;
  o.moe_intermediate_size = c.intermediate_size;
  o.norm_topk_prob = true;  // softmax of the top-k logits = the top-k probabilities renormalised
  o.router_name = "router";
  o.router_bias = o.expert_bias = o.interleaved_gate_up = true;
  o.activation = common::ExpertActivation::ClampedSwiglu;
  c.moe_module = "mlp";
  c.sparse_layers.assign(c.num_hidden_layers, true);
  o.moe_layers = c.num_hidden_layers;
  c.moe = std::make_shared<const common::MoeOptions>(o);
}

std::shared_ptr<const config::ModelConfig> parse_args(config::ArgMap& a) {
  auto c = std::make_shared<Parsed>();
  gpt_oss_defaults(*c);
  llama::parse_llama_args(a, c.get());
  c->sliding_window = a.get_int("sliding_window", 128, 0);  // 0: none (config.json's null)
  c->layer_types = a.get_string_list("layer_types", std::vector<std::string>{});
  common::MoeOptions o;
  o.num_experts = a.get_int("num_local_experts", 128, 1);
  o.top_k = a.get_int("num_experts_per_tok", 4, 1);
  o.swiglu_alpha = a.get_float("swiglu_alpha", 1.702);
  o.swiglu_limit = a.get_float("swiglu_limit", 7.0, 0.0);
  o.router_aux_loss_coef = a.get_float("router_aux_loss_coef", 0.001, 0.0);
  o.router_z_loss_coef = a.get_float("router_z_loss_coef", 0.0, 0.0);
  const auto form = a.get_string("router_aux_loss_form", "per_sequence", {"per_sequence", "global_batch"});
  o.aux_loss_form = form == "global_batch" ? common::AuxLossForm::GlobalBatch : common::AuxLossForm::PerSequence;
  o.capacity_factor = a.get_float("capacity_factor", 0.0, 0.0);
  if (a.get_float("attention_dropout", 0.0, 0.0, 1.0) != 0.0)
    a.fail("attention_dropout", "gpt_oss's sink attention is trained here without dropout; set it to 0");
  if (const auto p = problem(*c, o)) a.fail(p->first, p->second);
  finish(*c, o);
  return c;
}

}  // namespace gpt_oss_detail

using llama::hf_get_or;

std::shared_ptr<const MoeLmConfig> gpt_oss_config_from_hf(const nlohmann::json& j_in) {
  auto j = j_in;
  // GptOssConfig's defaults for what a folder leaves out.
  const std::pair<const char*, nlohmann::json> defaults[] = {
      {"head_dim", 64},          {"num_key_value_heads", 8},  {"rms_norm_eps", 1e-5},
      {"attention_bias", true},  {"sliding_window", 128},     {"max_position_embeddings", 131072}};
  for (const auto& [k, v] : defaults)
    if (!j.contains(k)) j[k] = v;
  if (!j.contains("rope_parameters") && !j.contains("rope_scaling")) {
    j["rope_parameters"] = {{"rope_type", "yarn"},  {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                            {"truncate", false}, {"original_max_position_embeddings", 4096}};
    if (!j.contains("rope_theta")) j["rope_theta"] = 150000.0;
  }
  const auto base = llama::config_from_hf(j);
  auto c = std::make_shared<gpt_oss_detail::Parsed>();
  static_cast<llama::LlamaConfig&>(*c) = *base;
  c->model_type = "gpt_oss";
  c->sliding_window = j.at("sliding_window").is_null() ? 0 : hf_get_or<int64_t>(j, "sliding_window", 128);
  if (c->sliding_window < 0) throw std::runtime_error("config.json: sliding_window must be at least 1 (or null)");
  c->layer_types = hf_get_or<std::vector<std::string>>(j, "layer_types", {});
  common::MoeOptions o;
  o.num_experts = hf_get_or<int64_t>(j, "num_local_experts", 128);
  o.top_k = hf_get_or<int64_t>(j, "num_experts_per_tok", 4);
  if (o.num_experts < 1 || o.top_k < 1) throw std::runtime_error("config.json: num_local_experts and num_experts_per_tok must be at least 1");
  o.swiglu_alpha = hf_get_or<double>(j, "swiglu_alpha", 1.702);
  o.swiglu_limit = hf_get_or<double>(j, "swiglu_limit", 7.0);
  // transformers adds its load_balancing_loss_func (our global_batch) only with output_router_logits.
  o.router_aux_loss_coef = hf_get_or<double>(j, "router_aux_loss_coef", 0.001);
  const auto form = hf_get_or<std::string>(j, "router_aux_loss_form", "global_batch");
  if (form != "global_batch" && form != "per_sequence")
    throw std::runtime_error("config.json: router_aux_loss_form '" + form + "' is not global_batch or per_sequence");
  o.aux_loss_form = form == "global_batch" ? common::AuxLossForm::GlobalBatch : common::AuxLossForm::PerSequence;
  if (o.aux_loss_form == common::AuxLossForm::GlobalBatch && !hf_get_or<bool>(j, "output_router_logits", false))
    o.router_aux_loss_coef = 0.0;
  if (hf_get_or<double>(j, "attention_dropout", 0.0) != 0.0)
    throw std::runtime_error("config.json: attention_dropout is not 0: gpt_oss's sink attention is trained here without dropout");
  if (const auto p = gpt_oss_detail::problem(*c, o)) throw std::runtime_error("config.json: " + p->first + " " + p->second);
  gpt_oss_detail::finish(*c, o);
  return c;
}

std::vector<HfTensor> GptOss::hf_tensors() const {
  std::vector<HfTensor> t;
  const std::string sinks = ".self_attn.sinks.weight";
  for (const auto& p : named_parameters()) {
    const auto& ours = p.key();
    auto theirs = ours == "lm_head.weight" ? ours : "model." + ours;
    // transformers' sinks are a parameter of the attention itself.
    if (theirs.size() > sinks.size() && theirs.compare(theirs.size() - sinks.size(), sinks.size(), sinks) == 0)
      theirs.resize(theirs.size() - std::string(".weight").size());
    t.push_back({ours, theirs, false});
  }
  return t;
}

nlohmann::json GptOss::hf_config() const {
  auto j = llama::Llama::hf_config();
  const auto& c = config();
  const auto& o = *moe_config().moe;
  j["architectures"] = {"GptOssForCausalLM"};
  j["model_type"] = "gpt_oss";
  for (const char* k : {"mlp_bias", "pretraining_tp", "rope_theta", "rope_scaling"}) j.erase(k);
  // transformers 5's form: GptOssConfig fills in its own YaRN when rope_parameters is missing.
  auto rope = common::rope_scaling_to_hf(c.rope_scaling);
  if (rope.is_null()) rope = {{"rope_type", "default"}};
  rope["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = rope;
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  j["layer_types"] = c.layer_types;
  j["num_local_experts"] = o.num_experts;
  j["num_experts_per_tok"] = o.top_k;
  j["swiglu_alpha"] = o.swiglu_alpha;
  j["swiglu_limit"] = o.swiglu_limit;
  j["router_aux_loss_coef"] = o.router_aux_loss_coef;
  const bool global = o.aux_loss_form == common::AuxLossForm::GlobalBatch;
  j["output_router_logits"] = global && o.router_aux_loss_coef > 0;
  // nnstrain's keys (transformers keeps and ignores them).
  j["router_aux_loss_form"] = global ? "global_batch" : "per_sequence";
  if (o.router_z_loss_coef > 0) j["router_z_loss_coef"] = o.router_z_loss_coef;
  if (o.capacity_factor > 0) j["capacity_factor"] = o.capacity_factor;
  return j;
}

ModelEntry gpt_oss_entry() {
  ModelEntry e{"gpt_oss", gpt_oss_detail::parse_args,
               nullptr,  // registry: build_sharded + fresh initialisation
               [](const config::ModelConfig& c, const common::ShardingContext& ctx) -> std::shared_ptr<CausalLM> {
                 return std::make_shared<GptOss>(dynamic_cast<const MoeLmConfig&>(c), ctx);
               },
               [](const nlohmann::json& j) -> std::shared_ptr<const config::ModelConfig> {
                 return gpt_oss_config_from_hf(j);
               }};
  // model.args: rope_theta and rope_scaling (Llama's keys), the null window as 0.
  e.args_of_hf = [](nlohmann::json j) {
    auto rope = j.at("rope_parameters");
    j.erase("rope_parameters");
    j["rope_theta"] = rope.at("rope_theta");
    rope.erase("rope_theta");
    if (rope.value("rope_type", std::string("default")) != "default") j["rope_scaling"] = rope;
    if (j.value("sliding_window", nlohmann::json()).is_null()) j["sliding_window"] = 0;
    return j;
  };
  return e;
}

}  // namespace nnstrain::models::moe
