// Model configurations small enough for unit tests, shared by those that need
// the same one.
#pragma once

#include "models/llama/llama.h"

namespace nnstrain::testing {

// Three layers, GQA (4 heads, 2 key/value heads), width 32, vocabulary 80.
inline models::llama::LlamaConfig tiny_llama(bool tied = false) {
  models::llama::LlamaConfig cfg;
  cfg.vocab_size = 80;
  cfg.hidden_size = 32;
  cfg.intermediate_size = 48;
  cfg.num_hidden_layers = 3;
  cfg.num_attention_heads = 4;
  cfg.num_key_value_heads = 2;
  cfg.max_position_embeddings = 32;
  cfg.tie_word_embeddings = tied;
  return cfg;
}

}  // namespace nnstrain::testing
