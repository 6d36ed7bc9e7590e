#include "models/moe/moe_lm.h"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "base/config/arg_map.h"

namespace nnstrain::models::moe {
namespace {

using common::MoeOptions;
using common::RouterKind;

// The config as a model type reads it (the ModelConfig the registry hands out).
struct Parsed : MoeLmConfig {
  bool mixture_of_experts() const override { return true; }
};

bool is_qwen(const std::string& type) { return type == "qwen3_moe"; }
bool is_deepseek(const std::string& type) { return type == "deepseek_v3"; }
const char* experts_key(const std::string& type) {
  return is_qwen(type) ? "num_experts" : is_deepseek(type) ? "n_routed_experts" : "num_local_experts";
}

common::AuxLossForm aux_form(const std::string& name) {
  return name == "global_batch" ? common::AuxLossForm::GlobalBatch : common::AuxLossForm::PerSequence;
}

// The first key whose value the model cannot take, and why (none: fine).
std::optional<std::pair<std::string, std::string>> problem(const MoeLmConfig& c) {
  const auto& o = *c.moe;
  const auto n = [](int64_t v) { return std::to_string(v); };
  const std::string experts_key = moe::experts_key(c.model_type);
  if (o.top_k > o.num_experts)
    return {{"num_experts_per_tok", n(o.top_k) + " is more than " + experts_key + " " + n(o.num_experts)}};
  if (o.router == RouterKind::DeepseekV3) {
    if (o.num_experts % o.n_group != 0)
      return {{"n_group", n(o.n_group) + " does not divide " + experts_key + " " + n(o.num_experts)}};
    if (o.topk_group > o.n_group) return {{"topk_group", n(o.topk_group) + " is more than n_group " + n(o.n_group)}};
    if (o.top_k > o.topk_group * (o.num_experts / o.n_group))
      return {{"num_experts_per_tok", n(o.top_k) + " is more than the " + n(o.topk_group * (o.num_experts / o.n_group)) +
                                          " experts of topk_group " + n(o.topk_group) + " groups"}};
  }
  if (o.n_shared_experts > 0 && o.shared_expert_intermediate_size > 0)
    return {{"shared_expert_intermediate_size", "is for one gated shared expert; n_shared_experts " +
                                                    n(o.n_shared_experts) + " is set too (use one)"}};
  for (const auto l : c.mlp_only_layers)
    if (l < 0 || l >= c.num_hidden_layers)
      return {{"mlp_only_layers", n(l) + " is not a layer (0 to num_hidden_layers - 1 = " + n(c.num_hidden_layers - 1) + ")"}};
  if (c.first_k_dense_replace > c.num_hidden_layers)
    return {{"first_k_dense_replace", n(c.first_k_dense_replace) + " is more than num_hidden_layers " +
                                          n(c.num_hidden_layers)}};
  return std::nullopt;
}

// Fills what follows from the keys: the sparse layers, names, the options' copies.
void finish(MoeLmConfig& c, MoeOptions o) {
  o.hidden_size = c.hidden_size;
  o.initializer_range = c.initializer_range;
  const bool mixtral = c.model_type == "mixtral";
  if (mixtral) o.gate_name = "w1", o.up_name = "w3", o.down_name = "w2";
  c.qk_norm = is_qwen(c.model_type);
  c.moe_module = mixtral ? "block_sparse_moe" : "mlp";
  c.sparse_layers = sparse_layers(c.num_hidden_layers, c.decoder_sparse_step, c.mlp_only_layers, c.first_k_dense_replace);
  o.moe_layers = std::max<int64_t>(1, std::count(c.sparse_layers.begin(), c.sparse_layers.end(), true));
  c.moe = std::make_shared<const MoeOptions>(o);
}

// DeepSeek-V3's multi-head latent attention from its keys (l's ranks and head parts), on c's
// widths and rope (the softmax scale takes yarn's mscale_all_dim as transformers does).
void finish_latent(MoeLmConfig& c, common::LatentAttentionOptions l) {
  l.hidden_size = c.hidden_size;
  l.num_heads = c.num_attention_heads;
  l.attention_bias = c.attention_bias;
  l.rms_norm_eps = c.rms_norm_eps;
  l.initializer_range = c.initializer_range;
  const auto& r = c.rope_scaling;
  l.scale = common::latent_attention_scale(l.qk_head_dim(), r.rope_type, r.factor, r.mscale_all_dim);
  c.latent = std::make_shared<const common::LatentAttentionOptions>(l);
}

// What latent attention fixes in the Llama keys (none: fine).
std::optional<std::pair<std::string, std::string>> latent_problem(const MoeLmConfig& c,
                                                                  const common::LatentAttentionOptions& l) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (l.qk_rope_head_dim % 2 != 0) return {{"qk_rope_head_dim", n(l.qk_rope_head_dim) + " must be even for rotary embeddings"}};
  if (c.head_dim != l.qk_rope_head_dim)
    return {{"head_dim", n(c.head_dim) + " is not qk_rope_head_dim " + n(l.qk_rope_head_dim) +
                             " (DeepseekV3Config sets head_dim to the rotary part)"}};
  if (c.num_key_value_heads != c.num_attention_heads)
    return {{"num_key_value_heads", n(c.num_key_value_heads) + " is not num_attention_heads " +
                                        n(c.num_attention_heads) + ": latent attention expands one K/V per head"}};
  return std::nullopt;
}

std::shared_ptr<const config::ModelConfig> parse_args(config::ArgMap& a, const std::string& type) {
  auto c = std::make_shared<Parsed>();
  c->model_type = type;
  const bool qwen = is_qwen(type), deepseek = is_deepseek(type);
  if (deepseek) c->head_dim = a.get_int("qk_rope_head_dim", 64, 2);  // DeepseekV3Config's head_dim: the rope part
  llama::parse_llama_args(a, c.get());
  MoeOptions o;
  // DeepseekV3Config's defaults (the 671B model's) where it has the key.
  o.num_experts = a.get_int(experts_key(type), deepseek ? 256 : 8, 1);
  o.top_k = a.get_int("num_experts_per_tok", deepseek ? 8 : 2, 1);
  o.moe_intermediate_size =
      qwen || deepseek ? a.get_int("moe_intermediate_size", deepseek ? 2048 : 768, 1) : c->intermediate_size;
  const auto scoring = deepseek ? a.get_string("scoring_func", "sigmoid", {"sigmoid"})
                                : a.get_string("scoring_func", "softmax", {"softmax", "sigmoid"});
  // Mixtral always renormalises; DeepSeek-V3's router does by default (its config's true); Qwen3's softmax not.
  o.norm_topk_prob = a.get_bool("norm_topk_prob", !qwen || scoring == "sigmoid");
  if (!qwen && !o.norm_topk_prob && scoring == "softmax")
    a.fail("norm_topk_prob", "false: Mixtral's softmax router always renormalises its top-k weights");
  if (scoring == "sigmoid") {
    o.router = RouterKind::DeepseekV3;
    o.n_group = a.get_int("n_group", deepseek ? 8 : 1, 1);
    o.topk_group = a.get_int("topk_group", deepseek ? 4 : 1, 1);
    o.routed_scaling_factor = a.get_float("routed_scaling_factor", deepseek ? 2.5 : 1.0, 0.0);
    o.bias_update_speed = a.get_float("bias_update_speed", 0.0, 0.0);
  } else {
    for (const char* k : {"n_group", "topk_group", "routed_scaling_factor", "bias_update_speed"})
      if (a.has(k)) a.fail(k, "is an option of DeepSeek-V3's router: set scoring_func: sigmoid");
  }
  o.n_shared_experts = a.get_int("n_shared_experts", deepseek ? 1 : 0, 0);
  o.shared_expert_intermediate_size = a.get_int("shared_expert_intermediate_size", 0, 0);
  o.router_aux_loss_coef = a.get_float("router_aux_loss_coef", 0.001, 0.0);
  o.router_z_loss_coef = a.get_float("router_z_loss_coef", 0.0, 0.0);
  o.aux_loss_form = aux_form(a.get_string("router_aux_loss_form", "per_sequence", {"per_sequence", "global_batch"}));
  o.capacity_factor = a.get_float("capacity_factor", 0.0, 0.0);
  if (!qwen && a.get_float("router_jitter_noise", 0.0, 0.0) > 0)
    a.fail("router_jitter_noise", "is not supported (0 only)");
  if (qwen) {
    c->decoder_sparse_step = a.get_int("decoder_sparse_step", 1, 1);
    for (const double l : a.get_float_list("mlp_only_layers", std::vector<double>{})) {
      if (l != static_cast<double>(static_cast<int64_t>(l))) a.fail("mlp_only_layers", "holds a non-integer layer");
      c->mlp_only_layers.push_back(static_cast<int64_t>(l));
    }
  }
  c->first_k_dense_replace = a.get_int("first_k_dense_replace", deepseek ? 3 : 0, 0);
  finish(*c, o);
  if (const auto p = problem(*c)) a.fail(p->first, p->second);
  if (deepseek) {
    common::LatentAttentionOptions l;
    l.q_lora_rank = a.get_int("q_lora_rank", 1536, 0);  // 0: q_proj (config.json's null)
    l.kv_lora_rank = a.get_int("kv_lora_rank", 512, 1);
    l.qk_nope_head_dim = a.get_int("qk_nope_head_dim", 128, 0);
    l.qk_rope_head_dim = a.get_int("qk_rope_head_dim", 64, 2);
    l.v_head_dim = a.get_int("v_head_dim", 128, 1);
    l.rope_interleave = a.get_bool("rope_interleave", true);
    if (const auto p = latent_problem(*c, l)) a.fail(p->first, p->second);
    finish_latent(*c, l);
  }
  return c;
}


ModelEntry entry(const std::string& type) {
  return {type, [type](config::ArgMap& a) { return parse_args(a, type); },
          nullptr,  // registry: build_sharded + fresh initialisation
          [](const config::ModelConfig& c, const common::ShardingContext& ctx) -> std::shared_ptr<CausalLM> {
            return std::make_shared<MoeLm>(dynamic_cast<const MoeLmConfig&>(c), ctx);
          },
          [type](const nlohmann::json& j) -> std::shared_ptr<const config::ModelConfig> {
            return config_from_hf(j, type);
          }};
}

}  // namespace

std::vector<bool> sparse_layers(int64_t layers, int64_t step, const std::vector<int64_t>& mlp_only, int64_t first_dense) {
  std::vector<bool> s(layers);
  for (int64_t i = 0; i < layers; ++i)
    s[i] = (i + 1) % step == 0 && i >= first_dense && std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end();
  return s;
}

MoeLm::MoeLm(const MoeLmConfig& cfg, const common::ShardingContext& ctx) : llama::Llama(cfg, ctx), mcfg_(cfg) {}

ModelDims MoeLm::dims() const {
  auto d = Llama::dims();
  const auto& c = config();
  const auto& o = *mcfg_.moe;
  d.experts = o.num_experts;
  d.experts_per_token = o.top_k;
  d.expert_ffn = o.moe_intermediate_size;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) d.moe_layers += c.sparse(i) ? 1 : 0;
  d.shared_expert_ffn = o.n_shared_experts * o.moe_intermediate_size + o.shared_expert_intermediate_size;
  if (const auto& l = c.latent) {
    d.attn_qk = c.num_attention_heads * l->qk_head_dim();
    d.attn_v = c.num_attention_heads * l->v_head_dim;
    // q_a's output and its norm's, kv_a's output and the normed c (the rotated k_r beside it).
    d.attn_latent = 2 * l->q_lora_rank + 2 * l->kv_lora_rank + 2 * l->qk_rope_head_dim;
  }
  return d;
}

// Under pipeline parallelism a rank holds some layers (hold_only): their MoE
// blocks are the ones it runs, tracks, saves and exports (another stage's block
// here was never trained: its bias would overwrite the holder's on load).
bool MoeLm::holds_moe(size_t i) {
  auto l = layers->ptr<llama::DecoderLayerImpl>(i);
  return l->moe && holds(l->moe->layer() + "." + l->moe->options().router_name + ".weight");
}

std::vector<MoeStats> MoeLm::take_moe_stats() {
  std::vector<MoeStats> all;
  int64_t moe_here = 0, moe_all = 0;
  for (size_t i = 0; i < layers->size(); ++i) {
    if (!layers->ptr<llama::DecoderLayerImpl>(i)->moe) continue;
    ++moe_all;
    if (!holds_moe(i)) continue;
    ++moe_here;
    all.push_back(layers->ptr<llama::DecoderLayerImpl>(i)->moe->take_stats());
  }
  const auto& o = *mcfg_.moe;
  if (moe_here < moe_all && o.router_aux_loss_coef > 0 && o.aux_loss_form == common::AuxLossForm::GlobalBatch)
    throw config::ConfigError("model.args.router_aux_loss_form: global_batch is one loss over every MoE layer, and "
                              "this pipeline stage holds " + std::to_string(moe_here) + " of " +
                              std::to_string(moe_all) + ": use per_sequence under pipeline parallelism");
  return all;
}

std::vector<HfBuffer> MoeLm::hf_buffers() {
  std::vector<HfBuffer> out;
  for (size_t i = 0; i < layers->size(); ++i)
    if (auto l = layers->ptr<llama::DecoderLayerImpl>(i); holds_moe(i) && l->moe->expert_bias().defined()) {
      const auto& name = l->moe->layer();
      out.push_back({"moe/" + name + ".expert_bias", "model." + name + ".gate.e_score_correction_bias",
                     l->moe->expert_bias()});
    }
  return out;
}

double MoeLm::flops_per_token(int64_t seq_len) const {
  const auto& c = config();
  const auto& o = *mcfg_.moe;
  const double C = c.hidden_size, q = double(c.num_attention_heads) * c.head_dim,
               kv = double(c.num_key_value_heads) * c.head_dim;
  // Attention's matmul parameters per layer, and its width (score and value products: 2 x width x T each way).
  double attn = C * q * 2 + C * kv * 2, width = q;
  if (c.latent) {
    const auto& l = *c.latent;
    const double H = c.num_attention_heads;
    attn = (l.q_lora_rank > 0 ? C * l.q_lora_rank + double(l.q_lora_rank) * H * l.qk_head_dim() : C * H * l.qk_head_dim()) +
           C * (l.kv_lora_rank + l.qk_rope_head_dim) + double(l.kv_lora_rank) * H * (l.qk_nope_head_dim + l.v_head_dim) +
           H * l.v_head_dim * C;
    width = H * (l.qk_head_dim() + l.v_head_dim) / 2;
  }
  double n = double(c.vocab_size) * C;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    n += attn;
    if (!c.sparse(i)) {
      n += 3.0 * C * c.intermediate_size;
      continue;
    }
    // The router, the k experts a token reaches, the shared experts.
    const double shared = double(o.n_shared_experts) * o.moe_intermediate_size + o.shared_expert_intermediate_size;
    n += C * o.num_experts + 3.0 * C * (double(o.top_k) * o.moe_intermediate_size + shared);
    if (o.shared_expert_intermediate_size > 0) n += C;  // its gate
  }
  return 6 * n + 12.0 * width * c.attention_span(seq_len);  // sliding windows counted (gpt_oss)
}

std::vector<HfTensor> MoeLm::hf_tensors() const {
  const auto& o = *mcfg_.moe;
  std::vector<HfTensor> t;
  for (const auto& p : named_parameters()) {
    const auto& ours = p.key();
    const auto dot = ours.rfind('.');
    const auto leaf = ours.substr(dot + 1), parent = ours.substr(0, dot);
    const bool stacked = parent.size() > 8 && parent.compare(parent.size() - 8, 8, ".experts") == 0 &&
                         (leaf == o.gate_name || leaf == o.up_name || leaf == o.down_name);
    if (!stacked) {
      t.push_back({ours, ours == "lm_head.weight" ? ours : "model." + ours, false});
      continue;
    }
    // One HF tensor per expert: model.layers.1.mlp.experts.3.gate_proj.weight.
    for (int64_t e = 0; e < o.num_experts; ++e)
      t.push_back({ours, "model." + parent + "." + std::to_string(e) + "." + leaf + ".weight", false, e});
  }
  return t;
}

nlohmann::json MoeLm::hf_config() const {
  auto j = llama::Llama::hf_config();
  const auto& o = *mcfg_.moe;
  const bool qwen = is_qwen(mcfg_.model_type), deepseek = is_deepseek(mcfg_.model_type);
  j["model_type"] = mcfg_.model_type;
  j["architectures"] = {qwen ? "Qwen3MoeForCausalLM" : deepseek ? "DeepseekV3ForCausalLM" : "MixtralForCausalLM"};
  j.erase("mlp_bias");
  j.erase("pretraining_tp");
  j["num_experts_per_tok"] = o.top_k;
  j["router_aux_loss_coef"] = o.router_aux_loss_coef;
  // transformers adds its load_balancing_loss_func (our global_batch) only with output_router_logits.
  const bool global = o.aux_loss_form == common::AuxLossForm::GlobalBatch;
  j["output_router_logits"] = global && o.router_aux_loss_coef > 0;
  if (!global && o.router_aux_loss_coef > 0) j["router_aux_loss_form"] = "per_sequence";
  if (qwen) {
    j["num_experts"] = o.num_experts;
    j["moe_intermediate_size"] = o.moe_intermediate_size;
    j["norm_topk_prob"] = o.norm_topk_prob;
    j["decoder_sparse_step"] = mcfg_.decoder_sparse_step;
    // Qwen3MoeForCausalLM knows no first_k_dense_replace: those layers are in its mlp_only_layers.
    auto dense = mcfg_.mlp_only_layers;
    for (int64_t i = 0; i < mcfg_.first_k_dense_replace; ++i)
      if (std::find(dense.begin(), dense.end(), i) == dense.end()) dense.push_back(i);
    std::sort(dense.begin(), dense.end());
    j["mlp_only_layers"] = dense;
    j["use_sliding_window"] = false;
  } else if (deepseek) {
    const auto& l = *config().latent;
    j["attention_bias"] = config().attention_bias;
    j["n_routed_experts"] = o.num_experts;
    j["moe_intermediate_size"] = o.moe_intermediate_size;
    j["n_shared_experts"] = o.n_shared_experts;
    j["n_group"] = o.n_group;
    j["topk_group"] = o.topk_group;
    j["routed_scaling_factor"] = o.routed_scaling_factor;
    j["norm_topk_prob"] = o.norm_topk_prob;
    j["first_k_dense_replace"] = mcfg_.first_k_dense_replace;
    j["q_lora_rank"] = l.q_lora_rank > 0 ? nlohmann::json(l.q_lora_rank) : nlohmann::json(nullptr);
    j["kv_lora_rank"] = l.kv_lora_rank;
    j["qk_nope_head_dim"] = l.qk_nope_head_dim;
    j["qk_rope_head_dim"] = l.qk_rope_head_dim;
    j["v_head_dim"] = l.v_head_dim;
    j["rope_interleave"] = l.rope_interleave;
    j["bias_update_speed"] = o.bias_update_speed;  // nnstrain's: the selection bias's training speed
  } else {
    j["num_local_experts"] = o.num_experts;
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
  }
  // nnstrain's options beyond the model type's own (transformers keeps unknown keys, and ignores them).
  if (o.router == RouterKind::DeepseekV3 && !deepseek) {
    j["scoring_func"] = "sigmoid";
    j["n_group"] = o.n_group;
    j["topk_group"] = o.topk_group;
    j["routed_scaling_factor"] = o.routed_scaling_factor;
    j["bias_update_speed"] = o.bias_update_speed;
    if (!qwen) j["norm_topk_prob"] = o.norm_topk_prob;
  }
  if (o.n_shared_experts > 0) j["n_shared_experts"] = o.n_shared_experts;
  if (o.shared_expert_intermediate_size > 0) j["shared_expert_intermediate_size"] = o.shared_expert_intermediate_size;
  if (mcfg_.first_k_dense_replace > 0) j["first_k_dense_replace"] = mcfg_.first_k_dense_replace;
  if (o.router_z_loss_coef > 0) j["router_z_loss_coef"] = o.router_z_loss_coef;
  if (o.capacity_factor > 0) j["capacity_factor"] = o.capacity_factor;
  return j;
}

std::string MoeLm::hf_export_refusal() const {
  const auto& o = *mcfg_.moe;
  const std::string arch = is_qwen(mcfg_.model_type)       ? "Qwen3MoeForCausalLM"
                           : is_deepseek(mcfg_.model_type) ? "DeepseekV3ForCausalLM"
                                                           : "MixtralForCausalLM";
  const auto refuse = [&](const std::string& key, const std::string& what) {
    return "model.args." + key + " (" + what + ") has no counterpart in transformers' " + arch +
           ", which would load the folder as another model without error; merge without --hf keeps every tensor";
  };
  if (is_deepseek(mcfg_.model_type))  // its router, shared experts and dense layers are DeepSeek's own
    return o.shared_expert_intermediate_size > 0 ? refuse("shared_expert_intermediate_size", "a gated shared expert")
                                                 : std::string();
  if (o.router == RouterKind::DeepseekV3)
    return refuse("scoring_func", "sigmoid: DeepSeek-V3's router, with n_group, topk_group, routed_scaling_factor and "
                                  "the selection bias; " + arch + " routes by softmax");
  if (o.n_shared_experts > 0) return refuse("n_shared_experts", "DeepSeek's shared experts, which it would drop");
  if (o.shared_expert_intermediate_size > 0)
    return refuse("shared_expert_intermediate_size", "a gated shared expert, which it would drop");
  if (!is_qwen(mcfg_.model_type) && mcfg_.first_k_dense_replace > 0)
    return refuse("first_k_dense_replace", "dense first layers; every Mixtral layer is sparse");
  return {};
}

namespace {

// DeepseekV3Config's head_dim is its rotary part, which Llama's reader takes as the rotary tables'
// width; its keys' defaults (the 671B model's) where config.json leaves them out.
nlohmann::json deepseek_as_llama(nlohmann::json j) {
  const auto rope = llama::hf_get_or<int64_t>(j, "qk_rope_head_dim", 64);
  if (j.contains("head_dim") && !j.at("head_dim").is_null() && llama::hf_get_or<int64_t>(j, "head_dim", rope) != rope)
    throw std::runtime_error("config.json: head_dim " + j.at("head_dim").dump() + " is not qk_rope_head_dim " +
                             std::to_string(rope) + " (DeepseekV3Config sets head_dim to the rotary part)");
  j["head_dim"] = rope;
  if (!j.contains("intermediate_size")) j["intermediate_size"] = 18432;
  return j;
}

// The latent attention's keys; null q_lora_rank is q_proj (0).
common::LatentAttentionOptions latent_from_hf(const nlohmann::json& j) {
  common::LatentAttentionOptions l;
  l.q_lora_rank = j.contains("q_lora_rank") && j.at("q_lora_rank").is_null() ? 0
                                                                             : llama::hf_get_or<int64_t>(j, "q_lora_rank", 1536);
  l.kv_lora_rank = llama::hf_get_or<int64_t>(j, "kv_lora_rank", 512);
  l.qk_nope_head_dim = llama::hf_get_or<int64_t>(j, "qk_nope_head_dim", 128);
  l.qk_rope_head_dim = llama::hf_get_or<int64_t>(j, "qk_rope_head_dim", 64);
  l.v_head_dim = llama::hf_get_or<int64_t>(j, "v_head_dim", 128);
  l.rope_interleave = llama::hf_get_or<bool>(j, "rope_interleave", true);
  const std::pair<const char*, int64_t> least[] = {{"q_lora_rank", 0}, {"kv_lora_rank", 1}, {"qk_nope_head_dim", 0},
                                                    {"qk_rope_head_dim", 2}, {"v_head_dim", 1}};
  const int64_t values[] = {l.q_lora_rank, l.kv_lora_rank, l.qk_nope_head_dim, l.qk_rope_head_dim, l.v_head_dim};
  for (size_t i = 0; i < 5; ++i)
    if (values[i] < least[i].second)
      throw std::runtime_error(std::string("config.json: ") + least[i].first + " " + std::to_string(values[i]) +
                               " is less than " + std::to_string(least[i].second));
  if (llama::hf_get_or<double>(j, "attention_dropout", 0.0) != 0.0)
    throw std::runtime_error("config.json: attention_dropout is not supported (0 only)");
  return l;
}

}  // namespace

std::shared_ptr<const MoeLmConfig> config_from_hf(const nlohmann::json& j_in, const std::string& type) {
  const bool qwen = is_qwen(type), deepseek = is_deepseek(type);
  const auto j = deepseek ? deepseek_as_llama(j_in) : j_in;
  const auto base = llama::config_from_hf(j);
  auto c = std::make_shared<Parsed>();
  static_cast<llama::LlamaConfig&>(*c) = *base;
  c->model_type = type;
  MoeOptions o;
  // transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map); Qwen's own files num_experts.
  o.num_experts = llama::hf_get_or<int64_t>(j, "num_local_experts", 8);
  if (qwen) o.num_experts = llama::hf_get_or<int64_t>(j, "num_experts", j.contains("num_local_experts") ? o.num_experts : 128);
  if (deepseek) o.num_experts = llama::hf_get_or<int64_t>(j, "n_routed_experts", 256);
  o.top_k = llama::hf_get_or<int64_t>(j, "num_experts_per_tok", qwen || deepseek ? 8 : 2);
  o.moe_intermediate_size = qwen || deepseek ? llama::hf_get_or<int64_t>(j, "moe_intermediate_size", deepseek ? 2048 : 768)
                                             : c->intermediate_size;
  // DeepSeek-V3's router is always the sigmoid one (its config has no scoring_func).
  const auto scoring = llama::hf_get_or<std::string>(j, "scoring_func", deepseek ? "sigmoid" : "softmax");
  if (deepseek && scoring != "sigmoid")
    throw std::runtime_error("config.json: scoring_func '" + scoring + "': DeepSeek-V3 routes by sigmoid scores only");
  o.norm_topk_prob = llama::hf_get_or<bool>(j, "norm_topk_prob", !qwen || scoring == "sigmoid");
  if (scoring == "sigmoid") {
    o.router = RouterKind::DeepseekV3;
    o.n_group = llama::hf_get_or<int64_t>(j, "n_group", deepseek ? 8 : 1);
    o.topk_group = llama::hf_get_or<int64_t>(j, "topk_group", deepseek ? 4 : 1);
    o.routed_scaling_factor = llama::hf_get_or<double>(j, "routed_scaling_factor", deepseek ? 2.5 : 1.0);
    o.bias_update_speed = llama::hf_get_or<double>(j, "bias_update_speed", 0.0);
  } else if (scoring != "softmax") {
    throw std::runtime_error("config.json: scoring_func '" + scoring + "' is not supported (softmax or sigmoid)");
  }
  o.n_shared_experts = llama::hf_get_or<int64_t>(j, "n_shared_experts", deepseek ? 1 : 0);
  o.shared_expert_intermediate_size = llama::hf_get_or<int64_t>(j, "shared_expert_intermediate_size", 0);
  o.router_aux_loss_coef = llama::hf_get_or<double>(j, "router_aux_loss_coef", 0.001);
  // transformers' own loss (load_balancing_loss_func: global_batch) by default, and only with
  // output_router_logits, as its models apply it; a folder nnstrain wrote may name per_sequence.
  const auto form = llama::hf_get_or<std::string>(j, "router_aux_loss_form", "global_batch");
  if (form != "global_batch" && form != "per_sequence")
    throw std::runtime_error("config.json: router_aux_loss_form '" + form + "' is not global_batch or per_sequence");
  o.aux_loss_form = aux_form(form);
  // DeepseekV3ForCausalLM adds no balancing loss, output_router_logits or not.
  if (o.aux_loss_form == common::AuxLossForm::GlobalBatch &&
      (deepseek || !llama::hf_get_or<bool>(j, "output_router_logits", false)))
    o.router_aux_loss_coef = 0.0;
  o.router_z_loss_coef = llama::hf_get_or<double>(j, "router_z_loss_coef", 0.0);
  o.capacity_factor = llama::hf_get_or<double>(j, "capacity_factor", 0.0);
  if (llama::hf_get_or<double>(j, "router_jitter_noise", 0.0) > 0)
    throw std::runtime_error("config.json: router_jitter_noise is not supported (0 only)");
  if (qwen) {
    c->decoder_sparse_step = llama::hf_get_or<int64_t>(j, "decoder_sparse_step", 1);
    c->mlp_only_layers = llama::hf_get_or<std::vector<int64_t>>(j, "mlp_only_layers", {});
    if (c->decoder_sparse_step < 1) throw std::runtime_error("config.json: decoder_sparse_step must be at least 1");
  }
  c->first_k_dense_replace = llama::hf_get_or<int64_t>(j, "first_k_dense_replace", deepseek ? 3 : 0);
  if (c->first_k_dense_replace < 0) throw std::runtime_error("config.json: first_k_dense_replace is negative");
  if (o.num_experts < 1 || o.top_k < 1 || o.n_group < 1 || o.topk_group < 1)
    throw std::runtime_error("config.json: expert counts must be at least 1");
  finish(*c, o);
  if (const auto p = problem(*c)) throw std::runtime_error("config.json: " + p->first + ": " + p->second);
  if (deepseek) {
    const auto l = latent_from_hf(j);
    if (const auto p = latent_problem(*c, l)) throw std::runtime_error("config.json: " + p->first + " " + p->second);
    finish_latent(*c, l);
  }
  return c;
}

ModelEntry qwen3_moe_entry() { return entry("qwen3_moe"); }
ModelEntry mixtral_entry() { return entry("mixtral"); }
ModelEntry deepseek_v3_entry() {
  auto e = entry("deepseek_v3");
  e.args_of_hf = [](nlohmann::json j) {  // config.json's null q_lora_rank is model.args' 0
    if (j.value("q_lora_rank", nlohmann::json()).is_null()) j["q_lora_rank"] = 0;
    return j;
  };
  return e;
}

}  // namespace nnstrain::models::moe
