#include "trainer/lora/converter.h"

#include <fnmatch.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "base/config/arg_map.h"
#include "base/log.h"
#include "base/text.h"
#include "models/lora/lora_linear.h"
#include "models/model.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/lora/peft_io.h"
#include "trainer/plan/cost_model.h"

namespace fs = std::filesystem;

namespace nnstrain::lora {

namespace {

using models::common::ColumnParallelLinearImpl;
using models::common::LinearImpl;
using models::common::RowParallelLinearImpl;
using models::lora::BaseKind;
using models::lora::LoraAdapter;
using models::lora::local_piece;

LoraReport g_report;
bool g_applied = false;
std::map<std::string, bool> g_frozen_names;  // what freeze_parameter froze (full name -> an expert's)

std::string strip_suffix(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0
             ? s.substr(0, s.size() - suffix.size())
             : std::string();
}

// peft's rule for a list of names (an exact name, or a suffix after a dot),
// and a glob (* ? [) over the whole name.
bool matches(const std::string& key, const std::string& name) {
  if (key.find_first_of("*?[") != std::string::npos) return fnmatch(key.c_str(), name.c_str(), 0) == 0;
  return name == key || (name.size() > key.size() && name.compare(name.size() - key.size(), key.size(), key) == 0 &&
                         name[name.size() - key.size() - 1] == '.');
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

struct LinearRef {
  std::string name;  // ours
  std::string hf;    // Hugging Face module name
  BaseKind kind;
  models::common::ShardedModule* module;
  std::shared_ptr<models::common::LinearAdapter>* slot;
  at::Tensor* weight;
};

std::vector<LinearRef> linears(models::CausalLM& model, const std::map<std::string, std::string>& hf) {
  std::vector<LinearRef> out;
  std::set<const void*> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* m = item.value().get();
    if (!seen.insert(m).second) continue;
    const auto it = hf.find(item.key());
    const std::string hf_name = it == hf.end() ? item.key() : it->second;
    if (auto* c = dynamic_cast<ColumnParallelLinearImpl*>(m))
      out.push_back({item.key(), hf_name, BaseKind::Column, c, &c->adapter, &c->weight});
    else if (auto* r = dynamic_cast<RowParallelLinearImpl*>(m))
      out.push_back({item.key(), hf_name, BaseKind::Row, r, &r->adapter, &r->weight});
    else if (auto* l = dynamic_cast<LinearImpl*>(m))
      out.push_back({item.key(), hf_name, BaseKind::Plain, l, &l->adapter, &l->weight});
  }
  return out;
}

models::common::ParamLayout weight_layout(const models::common::ShardedModule& m) {
  for (const auto& l : m.layouts())
    if (l.name == "weight") return l;
  throw std::logic_error("a linear layer without a weight layout");
}


// lora.init_from: the adapter_config.json must agree with the section; every adapter's A and B from the file.
// `targeted`: every adapted layer's HF name, this rank's or not (a pipeline rank holds some).
void load_peft(const config::LoraArgs& args, const std::vector<std::pair<LinearRef, std::shared_ptr<LoraAdapter>>>& ads,
               const std::set<std::string>& targeted) {
  const std::string where = "lora.init_from: " + args.init_from;
  nlohmann::json cfg;
  try {
    std::ifstream f(fs::path(args.init_from) / "adapter_config.json");
    cfg = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw config::ConfigError(where + "/adapter_config.json: " + e.what());
  }
  auto agree = [&](const char* theirs, const std::string& ours, const std::string& mine, const nlohmann::json& v) {
    if (cfg.contains(theirs) && !cfg[theirs].is_null() && cfg[theirs] != v)
      throw config::ConfigError("lora." + ours + " " + mine + ", but " + args.init_from + "/adapter_config.json has " +
                                theirs + " " + cfg[theirs].dump());
  };
  agree("r", "r", std::to_string(args.r), args.r);
  agree("lora_alpha", "alpha", std::to_string(args.alpha), args.alpha);
  agree("use_rslora", "use_rslora", args.use_rslora ? "true" : "false", args.use_rslora);
  checkpoint::SafetensorsReader reader((fs::path(args.init_from) / "adapter_model.safetensors").string());
  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  for (const auto& [ref, ad] : ads) {
    for (auto [mat, w] : {std::pair<const char*, models::lora::LoraWeight>{"lora_A", ad->A}, {"lora_B", ad->B}}) {
      const std::string key = "base_model.model." + ref.hf + "." + mat + ".weight";
      const auto* info = reader.find(key);
      if (!info) throw config::ConfigError(where + ": adapter_model.safetensors has no " + key);
      const auto& l = w->layout();
      if (info->shape != l.global_shape)
        throw config::ConfigError(where + ": " + key + " has shape " + c10::str(c10::IntArrayRef(info->shape)) +
                                  ", this model's is " + c10::str(c10::IntArrayRef(l.global_shape)));
      auto global = checkpoint::read_tensor(reader, key).to(torch::kFloat32);
      w->weight.copy_(local_piece(global, l));
      used.insert(key);
    }
  }
  for (const auto& hf : targeted)
    for (const char* mat : {"lora_A", "lora_B"}) used.insert("base_model.model." + hf + "." + mat + ".weight");
  for (const auto& t : reader.tensors())
    if (!used.count(t.name))
      throw config::ConfigError(where + ": " + t.name + " is in adapter_model.safetensors but this run has no such "
                                "adapter (lora.target_modules)");
}

// What lora.target_modules and modules_to_save name: the linears to adapt
// (every target must name one) and the modules trained whole.
struct Selection {
  std::vector<LinearRef> chosen;
  std::vector<std::string> saved;  // our module names
  bool is_saved(const std::string& name) const {
    for (const auto& s : saved)
      if (name == s || name.rfind(s + ".", 0) == 0) return true;
    return false;
  }
};

Selection select_targets(models::CausalLM& model, const config::LoraArgs& args,
                         const std::map<std::string, std::string>& hf) {
  Selection sel;
  const auto all = linears(model, hf);
  const bool all_linear = args.target_modules.size() == 1 && args.target_modules[0] == "all-linear";
  std::set<std::string> chosen_names;
  for (const auto& key : args.target_modules) {
    int hits = 0;
    for (const auto& l : all)
      if (all_linear || matches(key, l.hf) || matches(key, l.name)) {
        ++hits;
        if (chosen_names.insert(l.name).second) sel.chosen.push_back(l);
      }
    if (!hits) {
      // A stacked MoE expert tensor ([E, ...], not a linear layer): say so rather than "matches nothing".
      for (const auto& l : model.param_layouts()) {
        if (l.split.style != models::SplitStyle::Expert) continue;
        const auto module = l.name.substr(0, l.name.rfind('.'));
        const auto it = hf.find(module);  // Hugging Face's name of the experts module, where the model maps one
        const auto hf_module = it != hf.end() ? it->second : "model." + module;
        if (matches(key, l.name) || matches(key, module) || matches(key, hf_module) ||
            matches(key, hf_module + l.name.substr(module.size())))
          throw config::ConfigError("lora.target_modules: '" + key + "' names stacked MoE experts ('" + l.name +
                                    "'); LoRA on experts (peft's target_parameters) is not offered: the experts stay "
                                    "frozen, target the attention, dense MLP or router layers");
      }
      std::set<std::string> leaves;
      for (const auto& l : all) leaves.insert(l.hf.substr(l.hf.rfind('.') + 1));
      std::string names;
      for (const auto& n : leaves) names += (names.empty() ? "" : ", ") + n;
      throw config::ConfigError("lora.target_modules: '" + key + "' matches no linear layer of the model (its linear layers: " + names + ")");
    }
  }
  // modules_to_save: whole modules, matched as targets are, over every module.
  for (const auto& key : args.modules_to_save) {
    int hits = 0;
    for (const auto& item : model.named_modules("", false)) {
      const auto it = hf.find(item.key());
      if (matches(key, it == hf.end() ? item.key() : it->second) || matches(key, item.key())) {
        ++hits;
        sel.saved.push_back(item.key());
      }
    }
    if (!hits) throw config::ConfigError("lora.modules_to_save: '" + key + "' matches no module of the model");
  }
  return sel;
}

}  // namespace

std::map<std::string, std::string> hf_module_names(const models::CausalLM& model) {
  std::map<std::string, std::string> out;
  for (const auto& t : model.hf_tensors()) {
    const auto ours = strip_suffix(t.ours, ".weight"), theirs = strip_suffix(t.theirs, ".weight");
    if (!ours.empty() && !theirs.empty()) out.emplace(ours, theirs);
  }
  return out;
}

std::string peft_name(const std::string& ours, const std::map<std::string, std::string>& hf_modules) {
  for (const char* m : {".lora_A.weight", ".lora_B.weight"}) {
    const auto module = strip_suffix(ours, m);
    if (module.empty()) continue;
    const auto it = hf_modules.find(module);
    return "base_model.model." + (it == hf_modules.end() ? module : it->second) + m;
  }
  return {};
}

std::vector<FrozenTensor> frozen_base(models::CausalLM& model) {
  std::vector<FrozenTensor> out;
  if (!g_applied) return out;
  for (const auto& item : model.named_buffers()) {
    const auto it = g_frozen_names.find(item.key());
    if (it != g_frozen_names.end()) out.push_back({item.key(), item.value(), it->second});
  }
  return out;
}

nlohmann::json frozen_state(models::CausalLM& model) {
  if (!g_applied) return nullptr;
  int64_t frozen = 0, requiring = 0, with_grad = 0;
  for (const auto& item : model.named_buffers()) {
    const auto& t = item.value();
    if (!t.is_floating_point()) continue;
    ++frozen;
    requiring += t.requires_grad();
    with_grad += t.grad().defined();
  }
  return {{"tensors", frozen}, {"requiring_grad", requiring}, {"with_grad", with_grad}};
}

nlohmann::json record(models::CausalLM& model, const std::vector<std::string>& state_params,
                      int64_t optimizer_state_elements) {
  if (!g_applied) return nullptr;
  const auto& rep = g_report;
  int64_t adapters = 0, saved = 0;
  std::vector<std::string> others;
  for (const auto& n : state_params) {
    if (!peft_name(n, {}).empty()) {
      ++adapters;
      continue;
    }
    bool in_saved = false;
    for (const auto& s : rep.saved) in_saved = in_saved || n.rfind(s + ".", 0) == 0;
    if (in_saved) ++saved;
    else others.push_back(n);
  }
  const auto f = frozen_state(model);
  return {{"adapted_layers", rep.adapted.size()},
          {"adapter_elements", rep.adapter_elements},
          {"modules_to_save", rep.saved},
          {"state_adapter_params", adapters},
          {"state_saved_params", saved},
          {"state_others", others},
          {"optimizer_state_elements", optimizer_state_elements},
          {"frozen_tensors", f["tensors"]},
          {"frozen_elements", rep.frozen_elements},
          {"frozen_bytes", rep.frozen_bytes},
          {"frozen_requiring_grad", f["requiring_grad"]},
          {"frozen_with_grad", f["with_grad"]},
          {"quantized_layers", rep.quantized_layers},
          {"base_sha256", rep.base_sha256}};
}

const LoraReport* last_report() { return g_applied ? &g_report : nullptr; }

LoraReport apply_lora(models::CausalLM& model, const config::LoraArgs& args, const models::common::ShardingContext& ctx,
                      const c10::Device& device, c10::ScalarType base_dtype, uint64_t seed, const std::string& base_dir) {
  LoraReport rep;
  rep.base_dir = base_dir;
  rep.base_sha256 = base_dir.empty() ? "fresh-init seed " + std::to_string(seed) : base_identity(base_dir);
  const auto hf = hf_module_names(model);
  const auto sel = select_targets(model, args, hf);
  const auto& chosen = sel.chosen;
  const auto& saved = sel.saved;
  auto is_saved = [&](const std::string& name) { return sel.is_saved(name); };
  // The adapters, on the held layers only (a pipeline rank's stages).
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  models::lora::AdapterShape shape;
  shape.r = args.r;
  shape.scale = args.scale();
  shape.dropout = args.dropout;
  std::vector<std::pair<LinearRef, std::shared_ptr<LoraAdapter>>> made;
  std::set<std::string> targeted;
  for (const auto& l : chosen) {
    if (is_saved(l.name)) continue;
    // An unsplit layer under sequence parallelism sees this rank's tokens (latent attention's
    // a-projections, a router): its adapter's gradients would be this rank's part alone.
    if (ctx.sp() && l.kind == BaseKind::Plain)
      throw config::ConfigError("lora.target_modules: " + l.hf + " is not split by tensor parallelism and sees only "
                                "this rank's tokens under compute_config.sequence_parallel; leave it out of the "
                                "targets or set sequence_parallel: false");
    targeted.insert(l.hf);
    if (!model.holds(l.name + ".weight") || l.weight->is_meta()) continue;
    shape.kind = l.kind;
    auto ad = std::make_shared<LoraAdapter>(shape, ctx, weight_layout(*l.module), opts);
    ad->init(args.init, seed ^ fnv1a(l.hf));
    l.module->register_module("lora_A", ad->A);
    l.module->register_module("lora_B", ad->B);
    *l.slot = ad;
    made.emplace_back(l, ad);
    rep.adapted.push_back(l.name);
    rep.adapter_elements += ad->A->weight.numel() + ad->B->weight.numel();
  }
  if (!args.init_from.empty()) load_peft(args, made, targeted);
  // QLoRA: the adapted layers' weights to NF4 from their fp32 values (before the cast below).
  if (args.base_quantization == "nf4") {
    torch::NoGradGuard no_grad;
    for (const auto& [l, ad] : made) {
      at::Tensor& w = *l.weight;
      auto q = models::lora::quantize_nf4(w.to(torch::kFloat32), 64, args.double_quant);
      rep.frozen_elements += w.numel();
      rep.frozen_bytes += q.bytes();
      ad->set_quantized(std::move(q), base_dtype);
      w.set_data(torch::empty({0}, w.options()));  // the NF4 codes replace it
      ++rep.quantized_layers;
    }
  }
  // Freeze the rest: every parameter outside the adapters and modules_to_save.
  torch::NoGradGuard no_grad;
  std::set<const void*> seen;
  for (const auto& item : model.named_modules("", false)) {
    auto* m = dynamic_cast<models::common::ShardedModule*>(item.value().get());
    if (!m || !seen.insert(m).second || dynamic_cast<models::lora::LoraWeightImpl*>(m)) continue;
    if (is_saved(item.key())) continue;
    for (const auto& layout : m->layouts()) {
      auto own = m->named_parameters(/*recurse=*/false);
      const auto* p = own.find(layout.name);
      if (!p) continue;
      at::Tensor t = *p;
      m->freeze_parameter(layout.name);
      if (t.is_meta()) continue;
      g_frozen_names[item.key().empty() ? layout.name : item.key() + "." + layout.name] =
          layout.split.style == models::SplitStyle::Expert;
      rep.frozen_elements += t.numel();
      if (t.scalar_type() != base_dtype) t.set_data(t.to(base_dtype));
      rep.frozen_bytes += t.numel() * t.element_size();
    }
  }
  for (const auto& item : model.named_buffers())
    if (item.value().requires_grad()) ++rep.frozen_requiring_grad;
  rep.saved = saved;
  log::info("lora: adapters (r " + std::to_string(args.r) + ", scale " + std::to_string(args.scale()) + ") on " +
            std::to_string(rep.adapted.size()) + " linear layers, " + std::to_string(rep.adapter_elements) +
            " adapter elements; frozen base " + std::to_string(rep.frozen_elements) + " elements, " +
            std::to_string(rep.frozen_bytes) + " bytes held" +
            (rep.quantized_layers ? " (" + std::to_string(rep.quantized_layers) + " layers in NF4)" : std::string()) +
            (args.init_from.empty() ? std::string() : "; adapters from " + args.init_from));
  g_report = rep;
  g_applied = true;
  return rep;
}

// The planner's view (trainer/plan/cost_model.h ParamFact::frozen_bytes): the
// base as apply_lora leaves it, without building anything. The adapters follow
// their layer's own parameters, as the module tree registers them.
void lora_plan_facts(const models::CausalLM& model, const config::LoraArgs& args, c10::ScalarType base_dtype,
                     parallel::ModelFacts& f) {
  auto& m = const_cast<models::CausalLM&>(model);  // only read: named_modules() is not const
  const auto hf = hf_module_names(m);
  const auto sel = select_targets(m, args, hf);
  std::map<std::string, BaseKind> adapted;
  for (const auto& l : sel.chosen)
    if (!sel.is_saved(l.name)) adapted.emplace(l.name, l.kind);
  const double elem = double(c10::elementSize(base_dtype));
  // NF4: a code per half byte and an fp32 absmax per 64 (double_quant: a byte, an fp32 scale per 256 of those).
  const double nf4 = 0.5 + (args.double_quant ? (1.0 + 4.0 / 256) / 64 : 4.0 / 64);
  const bool quantize = args.base_quantization == "nf4";
  auto module_of = [](const std::string& param) { return param.substr(0, param.rfind('.')); };
  const double V = double(f.dims.vocab), h = double(f.dims.hidden);
  std::vector<parallel::ParamFact> out;
  std::vector<int> units;
  double adapter_elements = 0, frozen_elements = 0, trained_elements = 0;
  bool outer_all_frozen = true, outer_any = false;  // the embedding and head (CausalLM::flops_per_token's 6 V h)
  for (size_t i = 0; i < f.params.size(); ++i) {
    auto p = f.params[i];
    const auto module = module_of(p.name);
    const auto it = adapted.find(module);
    if (!sel.is_saved(module)) {
      p.frozen_bytes = quantize && it != adapted.end() && p.name == module + ".weight" ? nf4 : elem;
      frozen_elements += double(p.numel);
      // Its weight gradient's 2 FLOPs per element per token are not run (experts: not counted here).
      if (p.shape.size() == 2 && p.split.style != models::SplitStyle::Expert && p.unit >= 0)
        f.frozen_weight_grad_flops += 2.0 * double(p.numel);
    } else {
      trained_elements += double(p.numel);
    }
    if (p.unit < 0 && p.shape.size() == 2 && double(p.shape[0]) >= V) outer_any = true, outer_all_frozen &= p.frozen();
    out.push_back(p);
    units.push_back(f.zero3_units.at(i));
    const bool last_of_module = i + 1 == f.params.size() || module_of(f.params[i + 1].name) != module;
    if (it == adapted.end() || !last_of_module) continue;
    const parallel::ParamFact* w = nullptr;
    for (const auto& q : f.params)
      if (q.name == module + ".weight") w = &q;
    if (!w || w->shape.size() != 2) continue;
    const int64_t o = w->shape[0], in = w->shape[1], r = args.r;
    parallel::ParamFact a, b;  // A [r, in], B [out, r], split as adapter_layouts splits them (models/lora)
    a.name = module + ".lora_A.weight", a.shape = {r, in}, a.numel = r * in, a.unit = w->unit;
    b.name = module + ".lora_B.weight", b.shape = {o, r}, b.numel = o * r, b.unit = w->unit;
    a.split.param = a.name, b.split.param = b.name;
    if (it->second == BaseKind::Column && w->split.style == models::SplitStyle::Column) {
      b.split = w->split, b.split.param = b.name;
    } else if (it->second == BaseKind::Row && w->split.style == models::SplitStyle::Row) {
      a.split = w->split, a.split.param = a.name;
    }
    for (auto* ad : {&a, &b}) {
      out.push_back(*ad);
      units.push_back(f.zero3_units.at(i));
      adapter_elements += double(ad->numel);
    }
    f.adapter_flops += 6.0 * double(r * (in + o));
  }
  if (outer_any && outer_all_frozen) f.frozen_weight_grad_flops += 2.0 * V * h;  // the head's
  f.params = std::move(out);
  f.zero3_units = std::move(units);
  auto count = [](double n) { return util::fixed(n / 1e6, 2) + "M"; };
  f.frozen_what = "lora r " + std::to_string(args.r) + " on " + std::to_string(adapted.size()) +
                  " linear layers: " + count(adapter_elements) + " adapter elements" +
                  (trained_elements > 0 ? " and " + count(trained_elements) + " in modules_to_save" : std::string()) +
                  " trained; the base's " + count(frozen_elements) + " frozen, held as buffers in " +
                  (quantize ? "NF4 (adapted weights) and " : "") + std::string(c10::toString(base_dtype)) +
                  " (no gradients, masters or optimizer state; not ZeRO-sharded)";
}

}  // namespace nnstrain::lora
