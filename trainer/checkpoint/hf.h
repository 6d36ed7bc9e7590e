// Hugging Face checkpoints in: `model.init_from: DIR` where DIR is what
// transformers' save_pretrained writes (config.json plus model.safetensors, or
// model.safetensors.index.json and the files it names). Names and layouts are
// mapped through the model's own declaration (models::CausalLM::hf_tensors()).
// The other direction is `nnstrain merge --hf` (merge.h).
#pragma once

#include <memory>
#include <string>

namespace nnstrain::config {
struct ModelConfig;
}
namespace nnstrain::models {
class CausalLM;
struct ModelEntry;
}

namespace nnstrain::checkpoint {

// DIR/config.json -> the model's config, through the registry entry's
// from_hf_config. Throws CheckpointError naming the file and the fault.
std::shared_ptr<const config::ModelConfig> hf_model_config(const models::ModelEntry& entry, const std::string& dir);

// Copies every parameter of `model` from DIR's safetensors (converting dtype,
// transposing where hf_tensors() says so). Throws CheckpointError naming the
// file and tensor on a missing tensor or a shape mismatch, and when config.json's
// model_type is not the model's. Tensors of the files the model does not use
// (buffers such as GPT-2's attn.bias masks) are ignored.
void load_hf_weights(models::CausalLM& model, const std::string& dir);

}  // namespace nnstrain::checkpoint
