#include "trainer/interop/hf_import.h"

#include <cmath>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "models/common/init.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"
#include "base/text.h"

namespace fs = std::filesystem;

namespace nnstrain::interop {

using namespace checkpoint;  // CheckpointError, the safetensors reader, bounded JSON

namespace {

std::string show(const std::vector<int64_t>& s) { return nlohmann::json(s).dump(); }

// Tensor name -> file (relative to dir), from model.safetensors or the index.
std::map<std::string, std::string> weight_files(const fs::path& dir) {
  std::map<std::string, std::string> where;
  const auto single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(single)) {
    SafetensorsReader r(single.string());
    for (const auto& t : r.tensors()) where[t.name] = "model.safetensors";
    return where;
  }
  if (!fs::exists(index))
    throw CheckpointError(dir.string() + ": neither model.safetensors nor model.safetensors.index.json "
                          "(only safetensors checkpoints are read; no pickle)");
  const auto j = read_json_bounded(index.string());
  if (!j.contains("weight_map") || !j.at("weight_map").is_object())
    throw CheckpointError(index.string() + ": no \"weight_map\" object");
  for (const auto& [name, file] : j.at("weight_map").items()) {
    if (!file.is_string()) throw CheckpointError(index.string() + ": weight_map entry of '" + name + "' is not a file name");
    const auto f = file.get<std::string>();
    confined_path(dir.string(), f, index.string() + ": weight_map file of " + util::quote_prefix(name) + ":");
    where[name] = f;
  }
  return where;
}

// The config.json keys that change what the model computes without changing a
// tensor's shape (both GPT-2 and Llama spellings), and the vocabulary. Widths and
// depths are left to the weight loader, whose message names the file and tensor.
const char* const kMathKeys[] = {"vocab_size", "num_attention_heads", "n_head", "num_key_value_heads", "head_dim",
                                 "rms_norm_eps", "layer_norm_epsilon", "hidden_act", "activation_function",
                                 "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_theta",
                                 // Mixture of Experts: how tokens are routed and which layers are sparse
                                 "num_experts_per_tok", "norm_topk_prob", "scoring_func", "n_group", "topk_group",
                                 "routed_scaling_factor", "decoder_sparse_step", "mlp_only_layers",
                                 "first_k_dense_replace",
                                 // attention windows (Mistral, Qwen2/3)
                                 "sliding_window", "use_sliding_window", "layer_types",
                                 // Phi-3's partial rotation; Gemma 3's activation, score scale, local rope, caps
                                 "partial_rotary_factor", "hidden_activation", "query_pre_attn_scalar",
                                 "rope_local_base_freq", "attn_logit_softcapping", "final_logit_softcapping",
                                 // GPT-OSS's clamped SwiGLU
                                 "swiglu_alpha", "swiglu_limit"};
const char* const kRopeScalingKeys[] = {"factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                        "mscale_all_dim", "attention_factor", "short_factor", "long_factor"};

// Those settings in one layout. transformers 5 nests rope_theta and the scaling under
// `rope_parameters`; 4 writes top-level `rope_theta` + `rope_scaling` ("type" in
// older files). rope_scaling becomes null for plain rope (absent, null or "default").
nlohmann::json math_settings(const nlohmann::json& j) {
  nlohmann::json out = nlohmann::json::object();
  if (!j.is_object()) return out;
  for (const char* key : kMathKeys)
    if (j.contains(key) && !j.at(key).is_null()) out[key] = j.at(key);
  nlohmann::json rope = nullptr;
  if (j.contains("rope_parameters") && j.at("rope_parameters").is_object()) {
    rope = j.at("rope_parameters");
    if (rope.contains("full_attention") && rope.at("full_attention").is_object()) {  // by layer kind (Gemma 3)
      const auto local = rope.value("sliding_attention", nlohmann::json());
      if (local.is_object() && local.contains("rope_theta")) out["rope_local_base_freq"] = local.at("rope_theta");
      rope = rope.at("full_attention");
    }
    if (rope.contains("rope_theta") && !rope.at("rope_theta").is_null()) out["rope_theta"] = rope.at("rope_theta");
  } else if (j.contains("rope_scaling")) {
    rope = j.at("rope_scaling");
  }
  nlohmann::json scaling = nullptr;
  if (rope.is_object()) {
    const auto type = rope.contains("rope_type") ? rope.at("rope_type") : rope.value("type", nlohmann::json("default"));
    if (type != "default") {
      scaling = {{"rope_type", type}};
      for (const char* key : kRopeScalingKeys)
        if (rope.contains(key)) scaling[key] = rope.at(key);
    }
  } else if (!rope.is_null()) {
    scaling = rope;  // not an object: compared as is, so it is refused
  }
  out["rope_scaling"] = scaling;
  return out;
}

bool same_setting(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.is_number() && b.is_number())
    return std::abs(a.get<double>() - b.get<double>()) <= 1e-9 * std::max(1.0, std::abs(b.get<double>()));
  if (a.is_object() && b.is_object()) {  // a rope_scaling block: what both give must agree
    for (const auto& [k, v] : a.items())
      if (b.contains(k) && !same_setting(v, b.at(k))) return false;
    return true;
  }
  return a == b;
}

}  // namespace

std::shared_ptr<const config::ModelConfig> hf_model_config(const models::ModelEntry& entry, const std::string& dir) {
  const auto path = fs::path(dir) / "config.json";
  if (!entry.from_hf_config)
    throw CheckpointError("model type '" + entry.name + "' cannot be initialised from a Hugging Face checkpoint (" +
                          path.string() + ")");
  const auto j = read_json_bounded(path.string());
  try {
    auto cfg = entry.from_hf_config(j);
    if (!cfg) throw std::runtime_error("not a config of model type '" + entry.name + "'");
    return cfg;
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(path.string() + ": " + e.what());
  }
}

HfLoadReport load_hf_weights(models::CausalLM& model, const std::string& dir_str, std::optional<c10::Device> device,
                             const models::common::Filler& after) {
  const fs::path dir(dir_str);
  const auto config_path = dir / "config.json";
  if (fs::exists(config_path)) {
    const auto j = read_json_bounded(config_path.string());
    const auto ours = model.hf_config().value("model_type", std::string());
    const auto theirs = j.value("model_type", std::string());
    if (!ours.empty() && !theirs.empty() && ours != theirs)
      throw CheckpointError(config_path.string() + ": model_type '" + theirs + "', but the model is a '" + ours + "'");
    // Every setting that changes the math must agree, or the weights would load
    // into a silently different model (rope, norm epsilon, activation shape no tensor).
    const auto mine = math_settings(model.hf_config()), theirs_math = math_settings(j);
    for (const auto& [key, a] : mine.items()) {
      if (!theirs_math.contains(key) || (a.is_null() && key != "rope_scaling")) continue;
      const auto& b = theirs_math.at(key);
      if (!same_setting(a, b))
        throw CheckpointError(config_path.string() + ": " + key + " is " + b.dump().substr(0, 300) +
                              " in config.json but model.args give " + a.dump() +
                              "; make model.args match the checkpoint");
    }
  }
  const auto mapping = model.hf_tensors();
  if (mapping.empty()) throw CheckpointError("the model declares no Hugging Face names: cannot load " + dir_str);
  const auto where = weight_files(dir);
  // Our name -> its HF tensor, or one per expert of a stacked expert parameter (by expert).
  std::map<std::string, std::map<int64_t, const models::HfTensor*>> theirs_of;
  for (const auto& h : mapping) theirs_of[h.ours][h.expert] = &h;
  // A tensor fused from several of ours (Phi-3's qkv_proj): its rows, the parts' together.
  std::map<std::string, int64_t> fused_rows;
  {
    std::map<std::string, std::vector<int64_t>> global;
    for (const auto& l : model.param_layouts()) global[l.name] = l.global_shape;
    for (const auto& h : mapping)
      if (h.fused_offset >= 0 && global.count(h.ours))
        fused_rows[h.theirs] = std::max(fused_rows[h.theirs], h.fused_offset + global.at(h.ours).at(0));
  }

  // Where the parameters go: where they are, or the CPU for a model on meta.
  c10::Device target = device.value_or(c10::Device(c10::kCPU));
  if (!device)
    for (const auto& p : model.parameters())
      if (!p.is_meta()) target = p.device();

  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  HfLoadReport report;
  // Each parameter is allocated at this rank's shape and filled with only the
  // slices it holds, read from the memory-mapped file (no whole-tensor copy).
  models::common::materialise(model, target, [&](const models::common::ParamLayout& l, at::Tensor& local) {
    auto hit = theirs_of.find(l.name);
    if (hit == theirs_of.end())
      throw CheckpointError("the model's parameter '" + l.name + "' has no Hugging Face name: cannot load it from " +
                            dir_str);
    // One source tensor: its reader, checked against the shape it must have.
    auto source = [&](const models::HfTensor& h, std::vector<int64_t> want) -> SafetensorsReader& {
      auto it = where.find(h.theirs);
      if (it == where.end())
        throw CheckpointError((dir / (fs::exists(dir / "model.safetensors") ? "model.safetensors"
                                                                             : "model.safetensors.index.json"))
                                  .string() +
                              ": tensor '" + h.theirs + "' (the model's '" + h.ours + "') is missing");
      const auto path = (dir / it->second).string();
      auto& reader = readers[path];
      if (!reader) reader = std::make_unique<SafetensorsReader>(path);
      const auto* info = reader->find(h.theirs);
      if (!info) throw CheckpointError(path + ": tensor '" + h.theirs + "' is missing (the index names this file)");
      if (h.transpose) {
        if (want.size() != 2) throw CheckpointError("hf_tensors() marks '" + h.ours + "' transposed but it is not 2-d");
        std::swap(want[0], want[1]);
      }
      if (h.fused_offset >= 0) want.at(0) = fused_rows.at(h.theirs);  // ours is rows of it
      if (info->shape != want)
        throw CheckpointError(path + ": tensor '" + h.theirs + "' has shape " + show(info->shape) + " but the model's '" +
                              h.ours + "' needs " + show(want) + (h.transpose ? " (stored transposed)" : ""));
      report.bytes_needed += info->nbytes();
      return *reader;
    };
    const auto& entries = hit->second;
    if (entries.begin()->first >= 0) {
      // Stacked experts: this rank's rows are whole experts, each its own HF tensor.
      const std::vector<int64_t> one(l.global_shape.begin() + 1, l.global_shape.end());
      int64_t row = 0;
      for (const auto& b : l.blocks)
        for (int64_t e = b.offsets[0]; e < b.offsets[0] + b.shape[0]; ++e, ++row) {
          const auto found = entries.find(e);
          if (found == entries.end())
            throw CheckpointError("hf_tensors() names no Hugging Face tensor for expert " + std::to_string(e) +
                                  " of '" + l.name + "'");
          const auto& h = *found->second;
          auto& reader = source(h, one);
          auto t = read_tensor_slice(reader, h.theirs, std::vector<int64_t>(one.size(), 0), one);
          report.bytes_read += t.nbytes();
          local[row].copy_(h.transpose ? t.t() : t);
        }
      return;
    }
    const auto& h = *entries.begin()->second;
    auto& reader = source(h, l.global_shape);
    int64_t row = 0;
    if (h.fused_offset >= 0 && h.transpose)
      throw CheckpointError("hf_tensors() marks '" + h.ours + "' both fused and transposed");
    for (const auto& b : l.blocks) {
      auto off = b.offsets, size = b.shape;
      if (h.fused_offset >= 0) off.at(0) += h.fused_offset;
      if (h.transpose) std::swap(off[0], off[1]), std::swap(size[0], size[1]);
      auto t = read_tensor_slice(reader, h.theirs, off, size);
      report.bytes_read += t.nbytes();
      if (h.transpose) t = t.t();
      const int64_t rows = b.shape.empty() ? 1 : b.shape[0];
      (b.shape.empty() ? local : local.narrow(0, row, rows)).copy_(t);  // converts dtype and device
      row += rows;
    }
  }, after);
  // State beside the parameters (DeepSeek-V3's selection bias): read where the
  // folder has it; a folder without it (a Qwen3-MoE's) leaves the fresh value.
  for (auto& b : model.hf_buffers()) {
    const auto it = where.find(b.theirs);
    if (it == where.end()) continue;
    const auto path = (dir / it->second).string();
    auto& reader = readers[path];
    if (!reader) reader = std::make_unique<SafetensorsReader>(path);
    const auto* info = reader->find(b.theirs);
    if (!info) throw CheckpointError(path + ": tensor '" + b.theirs + "' is missing (the index names this file)");
    if (info->shape != b.tensor.sizes().vec())
      throw CheckpointError(path + ": tensor '" + b.theirs + "' has shape " + show(info->shape) + " but the model's '" +
                            b.ours + "' needs " + show(b.tensor.sizes().vec()));
    auto t = read_tensor_slice(*reader, b.theirs, std::vector<int64_t>(info->shape.size(), 0), info->shape);
    report.bytes_needed += info->nbytes();
    report.bytes_read += t.nbytes();
    b.tensor.copy_(t);
  }
  std::map<std::string, bool> known;
  for (const auto& p : model.named_parameters()) known[p.key()] = true;
  for (const auto& h : mapping)
    if (!known.count(h.ours))
      throw CheckpointError("hf_tensors() names '" + h.ours + "', which is not a parameter of the model");
  return report;
}

}  // namespace nnstrain::interop
