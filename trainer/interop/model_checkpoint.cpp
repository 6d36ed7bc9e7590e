#include "trainer/interop/model_checkpoint.h"

#include <torch/torch.h>

#include <filesystem>

#include "data/indexed/config_check.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/optim/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/tensor_io.h"
#include "base/config/load.h"
#include "trainer/pipeline/config_check.h"

namespace fs = std::filesystem;

namespace nnstrain::interop {

config::TrainerArgs saved_args(const checkpoint::Checkpoint& ck) {
  const std::string where = (fs::path(ck.dir()) / "manifest.json").string();
  const std::string yaml = ck.state().value("config", "");
  if (yaml.empty())
    throw checkpoint::CheckpointError(where + ": the trainer state holds no resolved config to rebuild the model");
  config::TrainerArgs args;
  try {
    config::LoadOptions lo;
    lo.models = models::model_catalog();
    lo.optimizers = optim::optimizer_catalog();
    lo.checks = {parallel::pipeline::check_config_schedule, indexed::check_config_datasets};
    lo.check_files = false;            // the run's data need not be here
    lo.reject_unimplemented = false;   // only the model section matters
    args = config::load_trainer_args_from_text(yaml, where + " (saved config)", lo);
  } catch (const config::ConfigError& e) {
    throw checkpoint::CheckpointError(where + ": the saved config does not load: " + e.what());
  }
  return args;
}

std::shared_ptr<models::CausalLM> build_model(const checkpoint::Checkpoint& ck) {
  const std::string where = (fs::path(ck.dir()) / "manifest.json").string();
  const std::string type = ck.state().value("model_type", "");
  const auto* entry = models::find_model(type);
  if (!entry) throw checkpoint::CheckpointError(where + ": unknown model type '" + type + "' in the trainer state");
  const auto args = saved_args(ck);
  if (args.model.type != type || !args.model.args)
    throw checkpoint::CheckpointError(where + ": the saved config's model '" + args.model.type + "' is not the state's '" +
                                      type + "'");
  return entry->build(*args.model.args);
}

void load_model_weights(const checkpoint::Checkpoint& ck, models::CausalLM& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.named_parameters()) {
    auto t = p.value().detach();
    const auto dtype = checkpoint::dtype_name(checkpoint::to_dtype(t.scalar_type()));
    sharding::StateTensor st{sharding::ShardSpec::full("model/" + p.key(), dtype, t.sizes().vec()), t};
    ck.load_into(st);
  }
}

checkpoint::HfExport hf_export(models::CausalLM& model) {
  if (const auto why = model.hf_export_refusal(); !why.empty()) throw checkpoint::CheckpointError("merge --hf: " + why);
  checkpoint::HfExport e;
  for (const auto& h : model.hf_tensors()) {
    if (h.expert >= 0) {  // stacked experts: one tensor per expert in their layout
      auto& n = e.names[h.ours];
      if (n.experts.size() <= static_cast<size_t>(h.expert)) n.experts.resize(h.expert + 1);
      n.experts[h.expert] = h.theirs;
      continue;
    }
    e.names[h.ours] = {h.theirs, h.transpose, {}, h.fused_offset};
  }
  // State beside the parameters, by its full checkpoint name ("moe/...").
  for (const auto& b : model.hf_buffers()) e.names[b.ours] = {b.theirs, false, {}};
  e.config = model.hf_config();
  return e;
}

checkpoint::MergeReport merge(const std::string& ckpt_dir, const std::string& out_dir, bool hf,
                              const std::string& dtype) {
  checkpoint::MergeOptions opts;
  opts.dtype = dtype;
  if (hf) {
    // Build the model only to learn its names; freed before the tensors stream.
    opts.hf = hf_export(*build_model(checkpoint::Checkpoint(ckpt_dir)));
  }
  return checkpoint::merge(ckpt_dir, out_dir, opts);
}

}  // namespace nnstrain::interop
