// Where LoRA checkpoints meet peft and Hugging Face folders (docs/lora.md):
// merge --adapter writes a peft adapter folder, merge --hf of a LoRA run writes
// the base with the adapters merged in (W + scale x B A), and the base's
// identity (its folder's weights index hashed) travels in checkpoints so that
// --resume refuses another base.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "trainer/checkpoint/merge.h"

namespace nnstrain::config {
struct TrainerArgs;
}

namespace nnstrain::lora {

// SHA-256 (hex) of a Hugging Face folder's weights index: model.safetensors.index.json,
// else the header of model.safetensors (names, dtypes, shapes, offsets). Throws naming the folder.
std::string base_identity(const std::string& hf_dir);
// The checkpoint state tensor holding it (32 bytes, uint8), replicated.
constexpr const char* kBaseIdentityName = "lora/base_sha256";

// --resume of a LoRA run: the checkpoint's base identity must be this run's
// (last_report()); throws config::ConfigError naming both otherwise.
void check_resume_base(const std::string& ckpt_dir);
// The identity as the checkpoint stores it, for Trainable::state_tensors (undefined outside LoRA).
at::Tensor base_identity_tensor();

// True when the checkpoint was saved by a LoRA run (its saved config has lora:).
bool is_lora_checkpoint(const std::string& ckpt_dir);

// merge --adapter: adapter_config.json + adapter_model.safetensors under peft's names.
checkpoint::MergeReport write_peft_adapter(const std::string& ckpt_dir, const std::string& out_dir);
// merge --hf of a LoRA checkpoint: the base folder's tensors with each adapted
// weight replaced by W + scale x B A (in fp32, then the base's dtype; `dtype` overrides it).
checkpoint::MergeReport write_merged_hf(const std::string& ckpt_dir, const std::string& out_dir, const std::string& dtype);

}  // namespace nnstrain::lora
