#include "trainer/train/active_record.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "models/common/context_attention.h"
#include "models/common/varlen_attention.h"
#include "models/common/lm_loss.h"
#include "trainer/checkpoint/checkpoint.h"
#include "models/common/kernels/grouped_gemm.h"
#include "trainer/dist/process_groups.h"
#include "trainer/lora/converter.h"
#include "trainer/offload/nvme_tier.h"
#include "trainer/train/startup.h"

namespace fs = std::filesystem;

namespace nnstrain::train {

namespace {

const char* loss_name(models::common::LossKind k) {
  switch (k) {
    case models::common::LossKind::Fused: return "fused";
    case models::common::LossKind::Chunked: return "chunked";
    default: return "plain";
  }
}

// A group's size and this rank's index in it (size 1, index 0 where the run has none).
nlohmann::json group(const dist::Runtime* rt, const dist::Group dist::Runtime::*g) {
  if (!rt) return {{"size", 1}, {"rank", 0}};
  const auto& x = rt->*g;
  return {{"size", std::max(1, x.size())}, {"rank", x.rank}};
}

}  // namespace

std::string dtype_label(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::Double: return "float64";
    default: return c10::toString(t);
  }
}

RunCounts RunCounts::now(const dist::Runtime* rt) {
  RunCounts c;
  c.kernels = models::common::kernels::kernel_calls();
  const auto loss = models::common::loss_forwards();
  c.plain_loss = loss.plain;
  c.chunked_loss = loss.chunked;
  c.fused_loss = loss.fused;
  c.document_tiles = models::common::document_tiles_computed();
  c.varlen_attention = models::common::varlen_attention_calls();
  if (rt) {
    c.pp_sends = rt->pp.traffic.sends;
    c.pp_bytes = rt->pp.traffic.bytes;
    c.ep_all_to_all = rt->ep.traffic.all_to_all;
    c.ep_bytes = rt->ep.traffic.bytes;
    c.optimizer_all_to_all = rt->stage.traffic.all_to_all;
    c.optimizer_bytes = rt->stage.traffic.bytes;
  }
  return c;
}

nlohmann::json RunCounts::since(const RunCounts& b) const {
  namespace k = models::common::kernels;
  nlohmann::json kernels = nlohmann::json::object();
  for (int i = 0; i < k::kNumKernels; ++i)
    kernels[k::kernel_name(k::Kernel(i))] = {{"fused", this->kernels.fused[i] - b.kernels.fused[i]},
                                             {"composite", this->kernels.composite[i] - b.kernels.composite[i]}};
  return {{"kernels", kernels},
          {"loss_forwards",
           {{"plain", plain_loss - b.plain_loss}, {"chunked", chunked_loss - b.chunked_loss},
            {"fused", fused_loss - b.fused_loss}}},
          {"pp_sends", pp_sends - b.pp_sends},
          {"pp_bytes", pp_bytes - b.pp_bytes},
          {"ep_all_to_all", ep_all_to_all - b.ep_all_to_all},
          {"ep_bytes", ep_bytes - b.ep_bytes},
          {"optimizer_all_to_all", optimizer_all_to_all - b.optimizer_all_to_all},
          {"optimizer_bytes", optimizer_bytes - b.optimizer_bytes},
          {"document_tiles", document_tiles - b.document_tiles},
          {"varlen_attention", varlen_attention - b.varlen_attention},
          // The MoE experts' GEMM form that ran last (models/common/kernels/grouped_gemm.h; "" for a dense model).
          {"grouped_gemm", models::common::kernels::last_grouped_gemm()}};
}

nlohmann::json startup_record(const models::CausalLM& model, const dist::Runtime* rt, Trainable& tr, int rank,
                              int world) {
  auto& st = *tr.state;
  const auto& so = st.options();
  const auto& ro = model.runtime_options();
  nlohmann::json r;
  r["rank"] = rank;
  r["world_size"] = world;
  using dist::Runtime;
  r["groups"] = {{"tp", group(rt, &Runtime::tp)},     {"cp", group(rt, &Runtime::cp)},
                 {"pp", group(rt, &Runtime::pp)},     {"dp", group(rt, &Runtime::dp)},
                 {"dp_cp", group(rt, &Runtime::dp_cp)}, {"zero", group(rt, &Runtime::zero)},
                 {"zero_cross", group(rt, &Runtime::zero_cross)}, {"ep", group(rt, &Runtime::ep)},
                 {"edp", group(rt, &Runtime::edp)}, {"ezero", group(rt, &Runtime::ezero)}, {"stage", group(rt, &Runtime::stage)}};
  // Experts as this rank holds them: whole experts of every MoE layer (the
  // global count at ep 1), and whether they reduce in buckets of their own.
  int64_t expert_elements = 0, expert_global = 0;
  for (const auto& l : model.param_layouts())
    if (l.split.style == models::SplitStyle::Expert) {
      int64_t local = 1, global = 1;
      for (auto d : l.local_shape) local *= d;
      for (auto d : l.global_shape) global *= d;
      expert_elements += local, expert_global += global;
    }
  r["experts"] = expert_global ? nlohmann::json{{"held_elements", expert_elements},
                                                {"global_elements", expert_global},
                                                {"own_buckets", !so.expert.empty()}}
                               : nlohmann::json(nullptr);
  r["zero_stage"] = so.zero_stage;
  {  // LoRA: the state holds adapters alone, the frozen base no gradient (trainer/lora/converter.h)
    std::vector<std::string> names;
    for (const auto& p : st.params()) names.push_back(p.name);
    r["lora"] = lora::record(const_cast<models::CausalLM&>(model), names, st.optimizer_elements());
    // ZeRO-3: the frozen base's bytes this rank keeps between uses, of the whole (0, 0: held whole).
    if (!r["lora"].is_null())
      r["lora"]["zero3_frozen"] = {{"held_bytes", tr.reducer->frozen_held_bytes()},
                                   {"whole_bytes", tr.reducer->frozen_whole_bytes()}};
  }
  // The optimizer built: how it runs, and its state by name (segments holding each).
  {
    std::map<std::string, int64_t> state;
    for (size_t i = 0; i < tr.optimizer->segments().size(); ++i)
      for (const auto& [name, t] : tr.optimizer->state(i)) ++state[name];
    r["optimizer"] = {{"impl", tr.optimizer->impl()}, {"state_segments", state}};
  }
  r["dtypes"] = {{"params", st.params().empty() ? "" : dtype_label(st.params()[0].tensor.scalar_type())},
                 {"gradients", dtype_label(st.reduced_grads().defined() ? st.reduced_grads().scalar_type() : so.grad_dtype)},
                 {"master_weights", so.master_weights}};
  r["loss"] = {{"kind", loss_name(ro.loss)}, {"chunk_size", ro.loss_chunk_size}};
  r["recompute_layers"] = int64_t(std::count(ro.recompute_layers.begin(), ro.recompute_layers.end(), true));
  r["kernels"] = models::common::kernels::impl_name(models::common::kernels::impl());
  if (st.offloaded()) {
    const auto host = st.host_held_bytes();
    r["offload"] = {{"host_buckets", st.host_buckets()},
                    {"buckets", st.layout().buckets.size()},
                    {"host_elements", st.host_elements()},
                    {"optimizer_elements", st.optimizer_elements()},
                    {"params_on_host", so.offload_params},
                    {"delayed_update", tr.delayed_update},
                    // 4 where the host keeps fp32 weights (masters under *-mixed)
                    {"host_weight_bytes_per_element",
                     st.host_elements() > 0 ? host.master / double(st.host_elements()) : 0.0}};
    if (auto* nvme = st.nvme())
      r["offload"]["nvme"] = {{"folder", nvme->store().folder()}, {"engine", nvme->store().engine()},
                              {"direct_io", nvme->store().direct_io()}, {"file_bytes", nvme->store().file_bytes()},
                              {"slots", nvme->slots()}, {"slot_bytes", nvme->slot_bytes()},
                              {"params", so.nvme_params}};
  } else {
    r["offload"] = nullptr;
  }
  if (tr.pipeline) {
    const auto& p = tr.pipeline_plan;
    r["pipeline"] = {{"pp_rank", rt->pp.rank},    {"scheduler", p.scheduler},       {"stages", p.stages},
                     {"nmicros", p.nmicros},      {"stage_layers", p.stage_layers}, {"post_validation", p.post_validation}};
  } else {
    r["pipeline"] = nullptr;
  }
  return r;
}

ActiveRecord::ActiveRecord(const std::string& run_dir, int rank, nlohmann::json startup)
    : path_((fs::path(run_dir) / "active" / ("rank" + std::to_string(rank) + ".json")).string()),
      record_(std::move(startup)) {
  fs::create_directories(fs::path(path_).parent_path());
  write();
}

void ActiveRecord::complete(const std::string& key, nlohmann::json part) {
  record_[key] = std::move(part);
  write();
}

void ActiveRecord::write() const { checkpoint::write_file_durable(path_, record_.dump(2) + "\n"); }

}  // namespace nnstrain::train
