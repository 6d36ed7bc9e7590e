// The Mixture-of-Experts feed-forward block: a router picks k of E SwiGLU
// experts per token (Mixtral / Qwen3-MoE softmax top-k, or DeepSeek-V3's
// sigmoid scores with a selection bias and group-limited top-k), the tokens go
// to their experts through the dispatcher (moe_dispatch.h: a permutation at
// ep 1, all-to-all under expert parallelism), the experts run as grouped GEMMs
// (kernels/grouped_gemm.h) and their outputs are summed with the routing
// weights; optional shared experts (always on, optionally gated) are added.
//
// Routing runs in fp32 under every precision (autocast off). Routed experts are
// stored stacked, [E, I, C] gate and up, [E, C, I] down, declared with
// expert_layout (this rank's E / ep whole experts), replicated over
// tensor-parallel ranks (without sequence parallelism every tp rank holds the
// same tokens); shared experts are column/row parallel like the dense MLP.
//
// Balancing losses (router_aux_loss_coef, router_z_loss_coef). The load-balancing
// loss has two forms (MoeOptions::aux_loss_form):
//
// GlobalBatch, transformers' load_balancing_loss_func (Mixtral, Qwen3-MoE): one
// loss per micro-batch over all its tokens and every MoE layer of the model,
//   aux = E * sum_e F_e * Pbar_e,  F_e = (assignments to e over all layers) / (L N),
//         Pbar_e = (router probabilities of e summed over all layers and tokens) / (L N)
// (N the micro-batch's tokens, L the MoE layers). F couples the layers, so each
// layer's share of the gradient is made in backward, once every layer of the
// micro-batch has counted its assignments (GlobalAux, kept by AuxLossScale). It
// depends on the micro-batch's size, not on dp, cp, sp or accumulation; every MoE
// layer must be on the rank (no pipeline stages).
//
// PerSequence (nnstrain's; DeepSeek's sequence-wise form up to its scaling,
// which divides f by k: coef_DeepSeek = k x coef here), defined per
// SEQUENCE, so no plan changes it: for sequence b of T tokens,
//   aux_b = E * sum_e f_be * P_be,  f_be = (tokens of b choosing e) / T,
//           P_be = mean over b's tokens of the router's probability of e
//           (softmax; DeepSeek-V3: the sigmoid scores normalised per token)
//   z_b   = mean over b's tokens of logsumexp(router logits)^2
// and a micro-batch adds coef x the mean over its sequences. Under context
// parallelism the sums over a sequence's tokens are all-reduced over the cp
// group (forward and backward), so every cp rank holds the whole sequence's
// aux_b. The losses are not in the returned LM loss: an identity function on
// the block's output adds their gradient in backward, scaled by the gradient
// the micro-batch's mean LM loss received (AuxLossScale: the trainer's weight
// of that micro-batch x the fp16 loss scale; recorded by the model's head in
// backward, or, on a pipeline stage without the head, handed over by the
// runtime through CausalLM::set_loss_grad), so the aux loss is weighted
// exactly like the LM loss it rides on: with every target counted, the step's
// objective is LM loss + coef x mean over all its sequences, at any dp, cp,
// accumulation, pipeline or recompute.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "models/common/layers.h"
#include "models/model.h"

namespace nnstrain::models::common {

enum class RouterKind { Softmax, DeepseekV3 };
enum class AuxLossForm { PerSequence, GlobalBatch };
// The experts' activation of gate g and up u: silu(g) u, or GPT-OSS's clamped form
// (g clamped above at limit, u to [-limit, limit]): g sigmoid(alpha g) (u + 1).
enum class ExpertActivation { Swiglu, ClampedSwiglu };

struct MoeOptions {
  int64_t hidden_size = 0;
  int64_t num_experts = 0, top_k = 0, moe_intermediate_size = 0;
  RouterKind router = RouterKind::Softmax;
  bool norm_topk_prob = false;       // renormalise the k chosen weights (Mixtral: always; Qwen3: option)
  int64_t n_group = 1, topk_group = 1;  // DeepSeek-V3: experts in n_group groups, choose among topk_group
  double routed_scaling_factor = 1.0;   // DeepSeek-V3: routed output scale
  double bias_update_speed = 0.0;       // DeepSeek-V3 aux-loss-free balancing (0: no selection bias)
  int64_t n_shared_experts = 0;         // always-on shared experts, width n x moe_intermediate_size (DeepSeek)
  int64_t shared_expert_intermediate_size = 0;  // one sigmoid-gated shared expert (Qwen2-MoE)
  double router_aux_loss_coef = 0.0, router_z_loss_coef = 0.0;
  AuxLossForm aux_loss_form = AuxLossForm::PerSequence;  // the load-balancing loss's definition (above)
  int64_t moe_layers = 1;  // the model's MoE layers (GlobalBatch averages over them)
  double capacity_factor = 0.0;  // 0: dropless; else Megatron's per-expert capacity, lowest weights dropped
  double initializer_range = 0.02;
  // The experts' parameter names: Qwen3 / DeepSeek gate_proj, up_proj, down_proj; Mixtral w1, w3, w2.
  std::string gate_name = "gate_proj", up_name = "up_proj", down_name = "down_proj";
  // GPT-OSS: the router's module name and bias; the activation; biases on the experts
  // (<name>_bias, [E, out]); gate and up as one input-major gate_up_proj [E, C, 2I], gate
  // in the even columns and up in the odd ones, and down_proj [E, I, C], as its checkpoints
  // store them (so they load and save as they are).
  std::string router_name = "gate";
  bool router_bias = false;
  ExpertActivation activation = ExpertActivation::Swiglu;
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  bool expert_bias = false, interleaved_gate_up = false;
};

// A router's choice for N tokens: k experts each [N, k] int64, their weights
// [N, k] fp32, and the per-expert probabilities the balancing loss uses [N, E].
struct Routing {
  at::Tensor experts, weights, probs;
};
// logits [N, E] fp32; bias [E] (DeepSeek-V3 selection bias; undefined: none).
Routing route(const at::Tensor& logits, const MoeOptions& o, const at::Tensor& bias = {});

// Megatron's capacity dropping: each expert keeps at most
// ceil(N x k / E x capacity_factor) of the N tokens' assignments, those of
// highest weight; the others become -1 in `experts`. Returns how many were dropped.
int64_t drop_over_capacity(at::Tensor& experts, const at::Tensor& weights, int64_t num_experts,
                           double capacity_factor);

// DeepSeek-V3's aux-loss-free update, in place: bias += speed x sign(mean(load) - load),
// load [E] the tokens each expert received (summed over data-parallel ranks by the caller).
void update_expert_bias(at::Tensor& bias, const at::Tensor& load, double speed);

// The gradient the current micro-batch's mean LM loss received in backward (the
// trainer's weight of it x the loss scale), which the balancing losses' gradients
// are scaled by. record_loss_grad(mean) is the identity and stores it in backward.
// One micro-batch's GlobalBatch statistics, summed over the MoE layers its
// forward has passed: assignments and router probabilities per expert (fp32,
// no graph), the layers counted, the micro-batch's tokens.
struct GlobalAux {
  at::Tensor chose, probs;
  std::vector<const void*> layers;
  double tokens = 0;
};
struct AuxLossScale {
  at::Tensor grad;  // undefined until a backward reached the loss
  // GlobalBatch: the micro-batch the latest training forward is in (a recomputed
  // forward in backward uses it: its micro-batch's backward comes before the next
  // forward), and those since the statistics were last taken (for the value).
  std::shared_ptr<GlobalAux> current;
  std::vector<std::shared_ptr<GlobalAux>> taken;
};
at::Tensor record_loss_grad(const at::Tensor& mean, const std::shared_ptr<AuxLossScale>& scale);

// The routed experts, stacked: this rank's E / ep of them.
class ExpertsImpl : public ShardedModule {
 public:
  ExpertsImpl(const MoeOptions& o, const ShardingContext& ctx);
  // rows [sum(counts), C] sorted by local expert -> [sum(counts), C].
  torch::Tensor forward(const torch::Tensor& rows, const std::vector<int64_t>& counts);
  std::vector<ParamLayout> layouts() const override { return layouts_; }
  torch::Tensor gate, up, down;  // [E_local, I, C], [E_local, I, C], [E_local, C, I]
  // interleaved_gate_up: gate_up [E_local, C, 2I] in place of gate and up, down [E_local, I, C].
  torch::Tensor gate_up;
  torch::Tensor gate_bias, up_bias, down_bias, gate_up_bias;  // expert_bias only

 private:
  void rebind() override;
  MoeOptions o_;
  c10::intrusive_ptr<TpComm> sp_comm_;  // sequence parallelism: the experts' gradients summed over tp
  std::vector<ParamLayout> layouts_;
};
TORCH_MODULE(Experts);

// A SwiGLU MLP over column/row-parallel linears (the shared experts).
class SwigluMlpImpl : public torch::nn::Module {
 public:
  SwigluMlpImpl(int64_t hidden, int64_t intermediate, double init_std, const ShardingContext& ctx);
  torch::Tensor forward(const torch::Tensor& x);
  ColumnParallelLinear gate_proj{nullptr}, up_proj{nullptr};
  RowParallelLinear down_proj{nullptr};
};
TORCH_MODULE(SwigluMlp);

class MoeImpl : public torch::nn::Module {
 public:
  // `layer`: its module name for the statistics ("layers.3.mlp"); `scale`: the
  // model's (null: balancing gradients unscaled, for the block on its own).
  MoeImpl(const MoeOptions& o, const ShardingContext& ctx, std::string layer,
          std::shared_ptr<AuxLossScale> scale = nullptr);
  // [B, T, C] -> [B, T, C]; under sequence parallelism this rank's sequence shard
  // (tp_ops.h), its tokens routed here, the experts whole on every tp rank.
  torch::Tensor forward(const torch::Tensor& x);
  // Statistics since the last call (training forwards, recomputations not counted again).
  MoeStats take_stats();
  const MoeOptions& options() const { return o_; }
  // The selection bias [E] fp32 (DeepSeek-V3 with bias_update_speed > 0; undefined
  // otherwise), on the device of the first forward, updated in place by the trainer.
  at::Tensor& expert_bias() { return bias_; }
  const std::string& layer() const { return layer_; }  // its module, e.g. "layers.3.mlp"

  Linear gate{nullptr};  // the router, [E, C] (registered as options().router_name)
  Experts experts{nullptr};
  SwigluMlp shared_experts{nullptr};  // DeepSeek's (n_shared_experts), or Qwen2-MoE's gated one
  Linear shared_expert_gate{nullptr};  // [1, C], Qwen2-MoE

 private:
  MoeOptions o_;
  ShardingContext ctx_;
  std::string layer_;
  std::shared_ptr<AuxLossScale> scale_;
  std::shared_ptr<AuxLossScale> global_;  // GlobalBatch's statistics: the model's scale_, or the block's own
  at::Tensor bias_;
  std::vector<int64_t> tokens_;
  int64_t dropped_ = 0;
  at::Tensor aux_;  // sum of the added balancing losses (no graph)
  // Per-sequence sums [B, X] of per-token values v [B x T, X] over the whole
  // sequence: its tensor-parallel shards (sequence parallelism) and cp ranks.
  at::Tensor sequence_sums(const at::Tensor& v, int64_t B, int64_t T) const;
  // The parameter as used on a sequence shard: its gradient summed over tp (norms' rule).
  at::Tensor on_shard(const at::Tensor& w) const;
};
TORCH_MODULE(Moe);

}  // namespace nnstrain::models::common
