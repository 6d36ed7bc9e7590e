// Hugging Face checkpoints in: `model.init_from: DIR` where DIR is what
// transformers' save_pretrained writes (config.json plus model.safetensors, or
// model.safetensors.index.json and the files it names). Names and layouts are
// mapped through the model's own declaration (models::CausalLM::hf_tensors()).
// The other direction is `nnstrain merge --hf` (model_checkpoint.h, checkpoint/merge.h).
#pragma once

#include <c10/core/Device.h>

#include "models/common/init.h"

#include <cstdint>

#include <memory>
#include <optional>
#include <string>

namespace nnstrain::config {
struct ModelConfig;
}
namespace nnstrain::models {
class CausalLM;
struct ModelEntry;
}

namespace nnstrain::interop {

// DIR/config.json -> the model's config, through the registry entry's
// from_hf_config. Throws CheckpointError naming the file and the fault.
std::shared_ptr<const config::ModelConfig> hf_model_config(const models::ModelEntry& entry, const std::string& dir);

// Materialises every parameter of `model` (built on meta, or already
// allocated) from DIR's safetensors on `device` (default: where the parameters
// are, the CPU for meta), converting dtype and transposing where hf_tensors()
// says so. Only the blocks this rank holds (its layouts) are read from the
// memory-mapped files. Throws CheckpointError naming the
// file and tensor on a missing tensor or a shape mismatch, and when config.json's
// model_type is not the model's. Tensors of the files the model does not use
// (buffers such as GPT-2's attn.bias masks) are ignored.
struct HfLoadReport {
  uint64_t bytes_read = 0;    // bytes of the slices this rank copied out of the files
  uint64_t bytes_needed = 0;  // bytes of the whole tensors the model maps (what tp 1 reads)
};
// `after`: as models::common::materialise's.
HfLoadReport load_hf_weights(models::CausalLM& model, const std::string& dir,
                             std::optional<c10::Device> device = std::nullopt,
                             const models::common::Filler& after = {});

}  // namespace nnstrain::interop
