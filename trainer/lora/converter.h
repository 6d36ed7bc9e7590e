// LoRA as a model converter (docs/lora.md): once a model is built, sharded and
// filled, apply_lora() attaches adapters (models/lora/) to the typed linear
// layers that lora.target_modules names (peft's matching over Hugging Face
// module names), fills them (peft's default or gaussian init, or a peft folder:
// lora.init_from) and freezes the rest: every base parameter becomes a buffer
// in the compute dtype (or NF4 under base_quantization), so only the adapters
// and modules_to_save are parameters, and the training state, ZeRO, the
// reducer, the optimizer and checkpoints see nothing else. Model code knows
// none of this.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/config/lora_args.h"

namespace nnstrain::models {
class CausalLM;
namespace common {
struct ShardingContext;
}
}  // namespace nnstrain::models

namespace nnstrain::parallel {
struct ModelFacts;
}

namespace nnstrain::lora {

// What apply_lora did on this rank (logged; the run's record shows it).
struct LoraReport {
  std::vector<std::string> adapted;    // our module names, with adapters
  std::vector<std::string> saved;      // modules_to_save: our module names, trained whole
  int64_t adapter_elements = 0;        // this rank's adapter elements
  int64_t frozen_elements = 0;         // this rank's frozen base elements
  int64_t frozen_bytes = 0;            // as held (compute dtype; NF4 codes and scales)
  int64_t frozen_requiring_grad = 0;   // frozen tensors that still require grad (0 unless broken)
  int64_t quantized_layers = 0;
  std::string base_dir, base_sha256;   // the base's identity (peft_io.h base_identity); fresh: "fresh-init seed N"
};

// Our module name -> its Hugging Face module name ("layers.0.self_attn.q_proj" ->
// "model.layers.0.self_attn.q_proj"), from the model's hf_tensors(); call before freezing.
std::map<std::string, std::string> hf_module_names(const models::CausalLM& model);

// Throws config::ConfigError (exit 2) for a target or module_to_save matching
// nothing, or an init_from folder that does not fit.
// base_dir: the base's Hugging Face folder (model.init_from; empty: a fresh init from `seed`).
LoraReport apply_lora(models::CausalLM& model, const config::LoraArgs& args, const models::common::ShardingContext& ctx,
                      const c10::Device& device, c10::ScalarType base_dtype, uint64_t seed, const std::string& base_dir);

// The report of the last apply_lora in this process (for the run's record).
const LoraReport* last_report();

// The run's record of LoRA (active_record.h): what the converter did, and from
// the training state built after it, that it holds adapters and modules_to_save
// alone (state_others: any other parameter in it) while no frozen base tensor
// requires a gradient or has one. Null outside LoRA.
nlohmann::json record(models::CausalLM& model, const std::vector<std::string>& state_params,
                      int64_t optimizer_state_elements);

// The base tensors the converter froze (buffers in the compute dtype; NF4
// codes and scales are not among them), for ZeRO-3 to shard (startup.cpp).
struct FrozenTensor {
  std::string name;
  at::Tensor tensor;
  bool expert = false;  // an MoE layer's experts (SplitStyle::Expert)
};
std::vector<FrozenTensor> frozen_base(models::CausalLM& model);

// {"tensors", "requiring_grad", "with_grad"} over the frozen base's tensors (null outside LoRA).
nlohmann::json frozen_state(models::CausalLM& model);

// Our adapter parameter name -> peft's ("layers.0.self_attn.q_proj.lora_A.weight" ->
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"); empty when not an adapter's.
std::string peft_name(const std::string& ours, const std::map<std::string, std::string>& hf_modules);

// The planner's facts of a LoRA run (PlanRequest::adjust_facts): every base
// parameter outside modules_to_save frozen at its held bytes per element
// (base_dtype; NF4 for adapted weights under base_quantization), each adapted
// layer's lora_A and lora_B added as trained parameters split as the converter
// splits them, the FLOPs the frozen weights' gradients save and the adapters
// add. `model`: the whole model the planner reads (nothing is built or changed).
// Throws config::ConfigError as apply_lora does for a target matching nothing.
void lora_plan_facts(const models::CausalLM& model, const config::LoraArgs& args, c10::ScalarType base_dtype,
                     parallel::ModelFacts& f);

}  // namespace nnstrain::lora
