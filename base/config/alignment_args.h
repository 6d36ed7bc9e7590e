// alignment: preference optimisation on (chosen, rejected) pairs (docs/alignment.md),
// with TRL's names: DPOTrainer's loss_type sigmoid / ipo / hinge, CPOTrainer's
// simpo and ORPOTrainer's orpo. `enabled` is true when the section is present;
// it needs dataset.type preference, and a preference dataset needs it.
#pragma once

#include <string>

namespace nnstrain::config {

struct AlignmentArgs {
  bool enabled = false;
  std::string loss_type = "sigmoid";  // sigmoid | ipo | hinge (reference) | simpo | orpo (reference-free)
  double beta = 0.1;
  double label_smoothing = 0;         // sigmoid (conservative DPO) and simpo: the share of flipped labels
  double simpo_gamma = 0.5;           // simpo: the target reward margin (CPOConfig's simpo_gamma)
  // Where the reference's log-probabilities come from (reference losses only):
  // frozen (a copy of the starting model, split as the policy, no gradients and
  // no optimizer state), precomputed (one pass of the starting model over every
  // pair before the first step, stored in ref_log_probs), adapters_off (the LoRA
  // base with its adapters switched off: no second copy), auto (adapters_off
  // under lora, else frozen); none for simpo and orpo.
  std::string reference = "auto";
  std::string ref_log_probs;          // precomputed: the file (default: beside the dataset, named by the run)
  bool reference_free() const { return loss_type == "simpo" || loss_type == "orpo"; }
};

}  // namespace nnstrain::config
