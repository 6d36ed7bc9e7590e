// The shape facts of a model that the planner's cost model needs (FLOPs,
// activation memory), apart from models/model.h so the cost model's header
// needs no LibTorch.
#pragma once

#include <cstdint>

namespace nnstrain::models {

struct ModelDims {
  int64_t hidden = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, max_seq = 0;
  bool tied_embeddings = true;
  // Mixture-of-Experts (0 experts: dense): routed experts per MoE layer, each
  // token's top-k of them, their width; the layers that are MoE (the rest
  // dense, of width ffn); always-on shared experts' total width (0: none).
  int64_t experts = 0, experts_per_token = 0, expert_ffn = 0, moe_layers = 0, shared_expert_ffn = 0;
  // Latent attention (0: hidden-wide heads): per token, the queries' and keys' width (heads x qk
  // head dim), the values' (heads x v head dim), and the compressed activations every tp rank keeps
  // (the q and kv latents with the shared rope key; the K/V cache holds the kv part of them).
  int64_t attn_qk = 0, attn_v = 0, attn_latent = 0;
  // Attention runs the math form (attention sinks: no fused kernel takes them), so the
  // [heads, s, keys] scores are kept for backward whatever the request's kernel.
  bool materialised_scores = false;
};

}  // namespace nnstrain::models
