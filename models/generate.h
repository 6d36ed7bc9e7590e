// Sampling text from a CausalLM, one token at a time (nanoGPT's generate, with
// a KV cache): the prompt is prefilled once, then each new token costs one
// position. The command around it is `nnstrain generate` (trainer/interop/generate_command.h).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace nnstrain::models {

class CausalLM;

struct SamplingOptions {
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // keep the k likeliest tokens (0: all)
  double top_p = 1.0;        // keep the smallest set whose probability reaches top_p (1: all)
};

struct GenerateOptions {
  int64_t max_new_tokens = 100;
  SamplingOptions sampling;
  // false: recompute the whole (cropped) context for every token, as nanoGPT does.
  bool kv_cache = true;
  int64_t stop_id = -1;  // stop after generating this id (-1: never)
};

// The next id for the logits of one position ([vocab], any dtype/device):
// temperature, then top-k, then top-p (Hugging Face's order), then a draw from
// `gen` (a CPU generator: the draws depend on the seed only, not the device).
int64_t sample_next(const at::Tensor& logits, const SamplingOptions& opts, at::Generator& gen);

// Generates up to max_new_tokens after `prompt` (non-empty). Beyond the model's
// max_seq_len() the context is cropped to its last max_seq_len() tokens, as
// nanoGPT's generate does; positions then shift, so the cache is rebuilt from
// the cropped window for every such token. on_token(id, logits [vocab]) is
// called for each new token, with the logits it was drawn from. Returns the new ids.
std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt, const GenerateOptions& opts,
                              at::Generator& gen,
                              const std::function<void(int64_t id, const at::Tensor& logits)>& on_token = {});

}  // namespace nnstrain::models
