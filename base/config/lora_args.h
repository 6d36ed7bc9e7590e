// lora: parameter-efficient fine-tuning (docs/lora.md). Adapters on a frozen
// base, with peft's LoraConfig names; `enabled` is true when the section is
// present. trainer/lora/ attaches them once the model is built and sharded.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace nnstrain::config {

struct LoraArgs {
  bool enabled = false;
  int64_t r = 8;
  double alpha = 8;                          // peft's lora_alpha; scale alpha / r (alpha / sqrt(r) with use_rslora)
  double dropout = 0;                        // on the adapter's input, as peft's lora_dropout
  std::vector<std::string> target_modules;   // suffixes or globs over Hugging Face module names, or all-linear
  bool use_rslora = false;
  std::string init = "default";              // default (A Kaiming-uniform, B zero) | gaussian (A normal 1/r, B zero)
  std::vector<std::string> modules_to_save;  // whole modules trained beside the adapters
  std::string bias = "none";
  std::string base_quantization = "none";    // none | nf4 (QLoRA)
  bool double_quant = false;                 // nf4: the absmax scales quantized again (8-bit, blocks of 256)
  std::string init_from;                     // a peft adapter folder to start from
  double scale() const { return alpha / (use_rslora ? std::sqrt(double(r)) : double(r)); }
};

}  // namespace nnstrain::config
