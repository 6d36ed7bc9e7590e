#include "trainer/lora/peft_io.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "base/config/arg_map.h"
#include "base/config/trainer_args.h"
#include "data/sha256.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/interop/model_checkpoint.h"
#include "trainer/lora/converter.h"
#include "trainer/state/tensor_parallel.h"

namespace fs = std::filesystem;

namespace nnstrain::lora {

namespace {

using checkpoint::CheckpointError;

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw CheckpointError(p.string() + ": cannot be read");
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The base model of a checkpoint on meta (names only) and its saved config.
struct Saved {
  config::TrainerArgs args;
  std::shared_ptr<models::CausalLM> meta;
};

Saved saved(const checkpoint::Checkpoint& ck) {
  Saved s{interop::saved_args(ck), nullptr};
  if (!s.args.lora.enabled) throw CheckpointError(ck.dir() + ": not a LoRA run's checkpoint (its config has no lora:)");
  s.meta = models::find_model(s.args.model.type)->build_sharded(*s.args.model.args, parallel::sharding_context(nullptr));
  return s;
}

at::Tensor load_whole(const checkpoint::Checkpoint& ck, const std::string& name) {
  const auto pieces = ck.pieces(name);
  if (pieces.empty()) throw CheckpointError(ck.dir() + ": holds no " + name);
  const auto& spec = pieces[0].first;
  const auto dt = checkpoint::parse_dtype(spec.dtype);
  if (!dt) throw CheckpointError(ck.dir() + ": " + name + " has dtype " + spec.dtype);
  auto t = torch::empty(spec.global_shape, checkpoint::to_scalar_type(*dt));
  sharding::StateTensor st{sharding::ShardSpec::full(name, spec.dtype, spec.global_shape), t};
  ck.load_into(st);
  return t;
}

// Our trained tensors in the checkpoint: adapters (name -> peft's) and modules_to_save's parameters.
std::vector<std::pair<std::string, std::string>> trained_names(const checkpoint::Checkpoint& ck, const Saved& s,
                                                               const std::map<std::string, std::string>& hf_modules) {
  std::map<std::string, std::string> hf_params;
  for (const auto& t : s.meta->hf_tensors()) hf_params[t.ours] = t.theirs;
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& n : ck.names()) {
    if (n.rfind("model/", 0) != 0) continue;
    const auto ours = n.substr(6);
    auto peft = peft_name(ours, hf_modules);
    if (peft.empty()) {  // a module trained whole (modules_to_save): peft saves it under the base's name
      const auto it = hf_params.find(ours);
      peft = "base_model.model." + (it == hf_params.end() ? ours : it->second);
    }
    out.emplace_back(n, peft);
  }
  return out;
}

void publish_dir(const fs::path& tmp, const fs::path& out) {
  fs::rename(tmp, out);
}

fs::path fresh_tmp(const std::string& out_dir) {
  if (fs::exists(out_dir)) throw CheckpointError(out_dir + " exists; merge writes a new folder");
  fs::path tmp = out_dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  return tmp;
}

void add_report(checkpoint::MergeReport& r, const at::Tensor& t) {
  ++r.tensors;
  const int64_t b = t.numel() * t.element_size();
  r.bytes += b;
  r.largest_bytes = std::max(r.largest_bytes, b);
}

}  // namespace

std::string base_identity(const std::string& hf_dir) {
  const fs::path d(hf_dir);
  if (fs::is_regular_file(d / "model.safetensors.index.json"))
    return data::sha256_file_hex((d / "model.safetensors.index.json").string());
  const auto file = d / "model.safetensors";
  std::ifstream f(file, std::ios::binary);
  uint64_t n = 0;
  if (!f || !f.read(reinterpret_cast<char*>(&n), 8) || n > (1ULL << 30))
    throw std::runtime_error(hf_dir + ": no model.safetensors or model.safetensors.index.json to identify the base by");
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  return data::sha256_hex(header);
}

at::Tensor base_identity_tensor() {
  const auto* rep = last_report();
  if (!rep) return {};
  const auto& id = rep->base_sha256;
  return torch::from_blob(const_cast<char*>(id.data()), {int64_t(id.size())}, torch::kUInt8).clone();
}

void check_resume_base(const std::string& ckpt_dir) {
  const auto* rep = last_report();
  if (!rep) return;
  checkpoint::Checkpoint ck(ckpt_dir);
  if (!ck.has(kBaseIdentityName))
    throw config::ConfigError("lora: --resume " + ckpt_dir + " was not saved by a LoRA run (it names no base)");
  const auto pieces = ck.pieces(kBaseIdentityName);
  auto t = torch::empty(pieces.at(0).first.global_shape, torch::kUInt8);
  sharding::StateTensor st{sharding::ShardSpec::full(kBaseIdentityName, "U8", t.sizes().vec()), t};
  ck.load_into(st);
  const std::string saved(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), t.numel());
  if (saved != rep->base_sha256)
    throw config::ConfigError("model.init_from: --resume " + ckpt_dir + " holds adapters trained on the base " +
                              saved + ", but this run's base " + (rep->base_dir.empty() ? "(fresh)" : rep->base_dir) +
                              " is " + rep->base_sha256 + " (SHA-256 of its weights index)");
}

bool is_lora_checkpoint(const std::string& ckpt_dir) {
  checkpoint::Checkpoint ck(ckpt_dir);
  return interop::saved_args(ck).lora.enabled;
}

checkpoint::MergeReport write_peft_adapter(const std::string& ckpt_dir, const std::string& out_dir) {
  checkpoint::Checkpoint ck(ckpt_dir);
  const auto s = saved(ck);
  const auto hf_modules = hf_module_names(*s.meta);
  const auto names = trained_names(ck, s, hf_modules);
  checkpoint::MergeReport r;
  const auto tmp = fresh_tmp(out_dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::set<std::string> targets;
  bool conv1d = false;
  std::map<std::string, bool> transposed;
  for (const auto& t : s.meta->hf_tensors()) transposed[t.ours] = t.transpose;
  for (const auto& [ours, peft] : names) {
    auto t = load_whole(ck, ours);
    add_report(r, t);
    tensors.emplace_back(peft, t);
    for (const char* m : {".lora_A.weight", ".lora_B.weight"})
      if (peft.size() > strlen(m) && peft.compare(peft.size() - strlen(m), strlen(m), m) == 0) {
        const auto module = peft.substr(17, peft.size() - 17 - strlen(m));  // after "base_model.model."
        targets.insert(module);
        const auto our_module = ours.substr(6, ours.size() - 6 - strlen(m));
        conv1d = conv1d || transposed[our_module + ".weight"];
      }
  }
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  checkpoint::save_tensors((tmp / "adapter_model.safetensors").string(), tensors, {{"format", "pt"}});
  const auto& l = s.args.lora;
  nlohmann::json cfg = {{"peft_type", "LORA"},
                        {"task_type", "CAUSAL_LM"},
                        {"base_model_name_or_path", s.args.model.init_from},
                        {"r", l.r},
                        {"lora_alpha", l.alpha},
                        {"lora_dropout", l.dropout},
                        {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
                        {"use_rslora", l.use_rslora},
                        {"bias", l.bias},
                        {"fan_in_fan_out", conv1d},
                        {"init_lora_weights", l.init == "gaussian" ? nlohmann::json("gaussian") : nlohmann::json(true)},
                        {"modules_to_save", l.modules_to_save.empty() ? nlohmann::json(nullptr)
                                                                       : nlohmann::json(l.modules_to_save)},
                        {"inference_mode", true}};
  std::ofstream(tmp / "adapter_config.json") << cfg.dump(2) << "\n";
  publish_dir(tmp, out_dir);
  r.out_dir = out_dir;
  return r;
}

checkpoint::MergeReport write_merged_hf(const std::string& ckpt_dir, const std::string& out_dir,
                                        const std::string& dtype) {
  checkpoint::Checkpoint ck(ckpt_dir);
  const auto s = saved(ck);
  const fs::path base = s.args.model.init_from;
  if (base.empty())
    throw CheckpointError(ckpt_dir + ": the run's base was freshly initialised (no model.init_from): nothing to merge "
                          "the adapters into; merge --adapter writes them alone");
  // The base's tensors, by file.
  std::map<std::string, std::string> where;  // HF tensor -> file
  if (fs::is_regular_file(base / "model.safetensors.index.json")) {
    const auto j = nlohmann::json::parse(read_text(base / "model.safetensors.index.json"));
    for (const auto& [k, v] : j.at("weight_map").items()) where[k] = (base / v.get<std::string>()).string();
  } else {
    checkpoint::SafetensorsReader rd((base / "model.safetensors").string());
    for (const auto& t : rd.tensors()) where[t.name] = rd.path();
  }
  // Each adapted HF weight's delta, scale x B A (transposed for a Conv1D weight stored [in, out]).
  const auto hf_modules = hf_module_names(*s.meta);
  std::map<std::string, bool> transposed;
  std::map<std::string, std::string> theirs_of;
  for (const auto& t : s.meta->hf_tensors()) transposed[t.theirs] = t.transpose, theirs_of[t.ours] = t.theirs;
  std::map<std::string, at::Tensor> deltas, whole;
  for (const auto& n : ck.names()) {
    if (n.rfind("model/", 0) != 0) continue;
    const auto ours = n.substr(6);
    const std::string a_suffix = ".lora_A.weight";
    if (ours.size() > a_suffix.size() && ours.compare(ours.size() - a_suffix.size(), a_suffix.size(), a_suffix) == 0) {
      const auto module = ours.substr(0, ours.size() - a_suffix.size());
      auto A = load_whole(ck, n).to(torch::kFloat32);
      auto B = load_whole(ck, "model/" + module + ".lora_B.weight").to(torch::kFloat32);
      const auto theirs = theirs_of.at(module + ".weight");
      auto d = torch::matmul(B, A) * s.args.lora.scale();
      deltas[theirs] = transposed[theirs] ? d.t().contiguous() : d;
    } else if (ours.find(".lora_B.weight") == std::string::npos) {  // modules_to_save: the trained tensor itself
      const auto it = theirs_of.find(ours);
      if (it != theirs_of.end()) whole[it->second] = load_whole(ck, n);
    }
  }
  const auto tmp = fresh_tmp(out_dir);
  checkpoint::MergeReport r;
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<std::string, std::unique_ptr<checkpoint::SafetensorsReader>> readers;
  for (const auto& [name, file] : where) {
    auto& rd = readers[file];
    if (!rd) rd = std::make_unique<checkpoint::SafetensorsReader>(file);
    auto w = checkpoint::read_tensor(*rd, name);
    if (const auto d = deltas.find(name); d != deltas.end())
      w = (w.to(torch::kFloat32) + d->second).to(w.scalar_type());
    else if (const auto t = whole.find(name); t != whole.end())
      w = t->second.to(w.scalar_type());
    if (!dtype.empty()) w = w.to(checkpoint::to_scalar_type(*checkpoint::parse_dtype(dtype)));
    add_report(r, w);
    out.emplace_back(name, w);
  }
  checkpoint::save_tensors((tmp / "model.safetensors").string(), out, {{"format", "pt"}});
  for (const auto& e : fs::directory_iterator(base)) {  // config.json, tokenizer files: as the base has them
    const auto fn = e.path().filename().string();
    if (e.is_regular_file() && fn.find("safetensors") == std::string::npos && fn.rfind(".bin") == std::string::npos)
      fs::copy_file(e.path(), tmp / fn);
  }
  publish_dir(tmp, out_dir);
  r.out_dir = out_dir;
  return r;
}

}  // namespace nnstrain::lora
