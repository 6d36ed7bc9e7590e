// The memory terms: the state a rank keeps between steps under ZeRO, the
// activations backward needs, the loss, the step's peak with the sharding's
// transient buffers, and optimizer post-validation's backup. (Offload's
// memory is offload.cpp's.)
#include <algorithm>
#include <cmath>
#include <vector>

#include "trainer/optim/precision.h"
#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel::cost {

namespace {

// The loss: vocab-split logits under tp. Plain: fp32 logits/softmax kept for
// backward, and at backward's start its gradient and the incoming one, three
// [tokens, V] fp32 tensors. Chunked: per-token logsumexp kept; backward holds
// the hidden gradient, an fp32 weight gradient and a chunk's logits twice.
// Fused: from its last chunk into backward, the fp32 gradients of hidden and
// weight; during the last chunk also its fp32 logits (softmax and gradient in
// place), their compute-dtype copy, and (16-bit compute) the compute-dtype
// weight and its chunk's weight gradient; in backward, the gradients cast to
// the inputs' 16-bit dtype.
double loss_term(const Setting& x, bool fp32_compute) {
  const double ea = x.pb.act, tokens = x.tokens, h = x.h, v_local = x.v_local;
  const auto loss = config::resolved_loss(x.a.model, int64_t(tokens));
  if (loss == "fused") {
    const double chunk = std::min(double(std::max(1, x.a.model.loss_chunk_size)), tokens);
    const double half = fp32_compute ? 0 : ea;
    return (tokens + v_local) * h * 4 +
           std::max(chunk * v_local * (4 + half) + 2 * v_local * h * half, (tokens + v_local) * h * half);
  }
  if (loss == "chunked") {
    const double chunk = std::min(double(std::max(1, x.a.model.loss_chunk_size)), tokens);
    return tokens * 4 + tokens * h * ea + v_local * h * (4 + (fp32_compute ? 0 : ea)) +
           chunk * v_local * (2 * 4 + (fp32_compute ? 0 : ea));
  }
  // Then the head's backward: the logits' gradient, the hidden states' and the weight's.
  // (The vocab-parallel forward holds the compute-dtype logits beside its
  // three fp32 tensors; the one-rank loss has freed them by then.)
  const bool vocab_split = x.f.vocab_parallel_head && x.c.tp > 1;
  return std::max(tokens * v_local * (3 * 4 + (fp32_compute || !vocab_split ? 0 : ea)),
                  tokens * v_local * 4 + tokens * h * ea + v_local * h * ea);
}

// The zero-bubble split (models/common/weight_grad.h): from a micro-batch's I
// until its W, every deferred linear of the rank's layers keeps its input X
// and output gradient dY in the compute dtype, a whole layer's worth per
// `live` unit (X shared by q/k/v or gate/up once; a sequence-parallel column
// linear keeps its local slice and gathers it again in W; a row-parallel
// linear's dY is whole); the plain LM head keeps its input and the logits'
// gradient. Per (stage, micro-batch) of `Lr` layers: divide as `live` does.
double layer_w_bytes(const Setting& x) {  // one layer, one micro-batch
  const double h = x.h, t = x.t, rep = x.rep, hkv = h * x.kv / x.heads, ffn = x.ffn;
  const double mlp_out = x.f.gated_mlp ? 2 * ffn : ffn;  // gate and up, or c_fc
  const double inputs = h * rep + h / t + h * rep + ffn / t;      // attention's, its out projection's, the MLP's, its down's
  const double grads = (h + 2 * hkv) / t + h + mlp_out / t + h;  // q/k/v, out, MLP up, MLP down
  return x.tokens * (inputs + grads) * x.pb.act;
}

}  // namespace

// ZeRO: parameters, gradients and optimizer state each rank keeps between
// steps (flat elements, padding included; Sz this rank's shard).
// Expert parameters' buckets shard over their own (smaller) group, so Sz is
// the sum of every bucket's chunk; expert_bytes is their part.
void state_term(const Setting& x, Interim&, PlanEstimate& e) {
  const auto& pb = x.pb;
  const double moments = pb.moments * x.ow.state_scale;  // the optimizer's state (AdamW's two moments)
  auto part = [&](double S, double Sz, double& param, double& grad, double& optim) {
    switch (x.c.zero_stage) {
      case 0:
        param = S * pb.param, grad = S * pb.grad, optim = S * (pb.master + moments);
        break;
      case 1:  // the full gradient buffer stays, plus the reduced chunk
        param = S * pb.param, grad = S * pb.grad + Sz * pb.grad, optim = Sz * (pb.master + moments);
        break;
      case 2:  // no full gradient buffer outlives backward
        param = S * pb.param, grad = Sz * pb.grad, optim = Sz * (pb.master + moments);
        break;
      default:  // 3: parameters sharded too, units gathered around their use
        param = Sz * pb.param, grad = Sz * pb.grad, optim = Sz * (pb.master + moments);
    }
  };
  part(x.st.padded, x.st.shard, e.param_bytes, e.grad_bytes, e.optim_bytes);
  // A frozen reference (alignment.reference frozen, trainer/align): a second copy
  // of this rank's weights, split as the policy (never under ZeRO-3), no gradient
  // or optimizer state.
  if (x.a.alignment.enabled && x.a.alignment.reference == "frozen" && !x.a.lora.enabled)
    e.param_bytes += x.st.padded * pb.param;
  double p = 0, g = 0, o = 0;
  if (x.c.ep > 1) part(x.st.expert_padded, x.st.expert_shard, p, g, o);
  else part(x.st.expert_elements, x.st.expert_elements / x.st.z, p, g, o);  // in the common buckets
  e.expert_bytes = p + g + o;
}

// A frozen base (LoRA, ParamFact::frozen_bytes): this rank's held weights in
// the form the converter keeps them (compute dtype, or NF4 codes and scales),
// split as tensor and pipeline parallelism split them; under ZeRO-3 (no pp)
// this rank's chunks of its units (the gathered units count in peak_term).
void frozen_term(const Setting& x, Interim&, PlanEstimate& e) { e.frozen_bytes = x.st.frozen_bytes; }

double pending_w_bytes(const Setting& x) {
  double bytes = x.Lr * layer_w_bytes(x);
  if (x.last && config::resolved_loss(x.a.model, int64_t(x.tokens)) == "plain")
    bytes += x.tokens * (x.h * x.rep + x.v_local) * x.pb.act;
  return bytes;
}

Activations activation_term(const Setting& x) {
  const double ea = x.pb.act, tokens = x.tokens, h = x.h, t = x.t, rep = x.rep;
  const double hkv = h * x.kv / x.heads, ffn = x.ffn;
  const bool fp32_compute = ea >= 4;
  double layer_rep, layer_split, head_in, norm_extra, wide_grads;
  if (x.f.gated_mlp) {
    // Llama: each RMSNorm keeps its input in fp32 (the input itself at fp32,
    // else an fp32 copy, and then not the input), its normalised input and
    // (through the next linear) its output, twice per layer; attention keeps
    // rotated q, k, v (key/value heads repeated except under CUDA's native
    // GQA) and the output; SwiGLU keeps gate, silu(gate), up and their product.
    const bool native_gqa = !fp32_compute && x.req.device.name != "cpu";
    const double norm_in = fp32_compute ? h : h * 4 / ea;
    layer_rep = 2 * (norm_in + 2 * h);
    layer_split = (native_gqa ? 2 * h + 2 * hkv : 4 * h) + 4 * ffn;
    if (x.f.dims.attn_qk > 0) {  // latent attention: q, k, v and the output at their own widths, the latents whole
      const double qk = double(x.f.dims.attn_qk), v = double(x.f.dims.attn_v);
      layer_split += 2 * qk + 2 * v - (native_gqa ? 2 * h + 2 * hkv : 4 * h);
      layer_rep += double(x.f.dims.attn_latent);
    }
    head_in = norm_in;
    norm_extra = h;        // the final norm's normalised input
    wide_grads = 2 * ffn;  // backward of gate * up: both gradients and the incoming one (the product freed)
  } else {
    // GPT: the block input (kept by ln_1), ln_1's output, the residual sum
    // and ln_2's output; q, k, v, attention output; the MLP's c_fc output and
    // its GELU.
    layer_rep = 4 * h;
    layer_split = 2 * h + 2 * hkv + 2 * ffn;
    head_in = h;
    norm_extra = 0;
    wide_grads = ffn;  // the GELU output's gradient while the output is still kept
  }
  if (x.moe > 0) {
    // An MoE layer keeps, in place of the dense MLP: the router's logits and
    // probabilities (fp32), its tokens' k rows sorted by expert, under ep the
    // rows received (imb x) and the rows returned, the experts' SwiGLU
    // (gate, silu(gate), up, product) per assignment, the shared experts'
    // (split over tp). Experts are whole on each tp rank: their rows are not
    // divided by tp (1/tp of the tokens under SP). Averaged over the layers.
    const double a2a_rows = x.c.ep > 1 ? x.imb * x.topk * h : 0.0;
    const double moe_rep = 2 * x.E * 4 / ea + 2 * x.topk * h + a2a_rows + x.imb * x.topk * 4 * x.eff;
    layer_rep += x.moe * moe_rep;
    layer_split += x.moe * (4 * x.shf - (x.f.gated_mlp ? 4 : 2) * ffn);
    wide_grads = std::max({x.moe < 1 ? wide_grads : 0.0, 2 * x.shf, 2 * x.imb * x.topk * x.eff * t * rep});
  }
  Activations act;
  act.layer_full = tokens * (layer_rep * rep + layer_split / t) * ea;
  act.layer_input = tokens * h * rep * ea;
  act.scores = x.req.fused_attention && !x.f.dims.materialised_scores ? 0.0 : tokens * 2 * (x.heads / t) * x.s * ea;
  // Under pp the rank's stages' layers, for every micro-batch in flight.
  act.saved_layers = x.live * ((x.Lr - x.kr) * (act.layer_full + act.scores) + x.kr * act.layer_input);
  act.pending_w = x.w_live > 0 ? x.w_live * pending_w_bytes(x) : 0.0;
  act.layer_w = x.split_layers > 0 ? layer_w_bytes(x) : 0.0;
  act.saved_layers += act.pending_w;
  // The last block's output (what the final norm keeps of its input) and of
  // the norm, and its output; under SP the head gathers that output whole and keeps it.
  act.head_saved = x.last ? x.live * tokens * ((head_in + norm_extra) * rep + (x.sp ? h : h * rep)) * ea : 0.0;
  act.loss_peak = x.last ? loss_term(x, fp32_compute) : 0.0;
  // One block's backward: the gradient coming in, the widest gradients (the
  // MLP's), under SP the gathered gradient of the row-parallel output, and
  // autograd's gradient of the block's largest parameter before it is added
  // into its slot (its bucket under ZeRO-2, its unit under ZeRO-3).
  act.block_grads = tokens * (h * rep + (x.sp ? h : 0) + wide_grads / t) * ea + x.st.largest_block_param * x.pb.param +
                    cp_layer(x).kv_backward;
  // A tied embedding's gradient from the head waits in autograd until the
  // embedding's own part is added at the end of backward.
  act.tied_head_grad = x.f.dims.tied_embeddings && x.first && x.last ? x.v_local * h * x.pb.param : 0.0;
  // The pipeline's executor keeps a tensor it sends until a wait completes its
  // group (pipeline::retired_sends), and a received one from its group's post
  // until it is used: each one micro-batch's hidden states.
  act.sent_per_tensor = tokens * h * rep * ea;
  act.sent = x.sends * act.sent_per_tensor;
  return act;
}

// The step's peak: the largest of the moments backward passes through, each
// the activations still kept plus what the sharding holds only for a while.
// ZeRO-3's outer units (embedding, head) are gathered for the whole forward
// and backward. During the blocks' backward ZeRO-2/3 fill gradient buckets
// (ZeRO-3: one per unit) in layout order and launch each one's reduce-scatter
// when it is full, at most kBucketsInFlight = 2 at once (grad_reducer.h), each
// with its output chunk (bucket / N) and, over Gloo (CPU), the copy of its
// input Gloo reduces; one more bucket fills meanwhile; ZeRO-3 also holds the
// current block's unit and zero_prefetch more. By the time j buckets are
// launched, about j x (bucket / block) blocks have finished their backward and
// freed their activations, so each j is a moment of its own. Under pipeline
// parallelism ZeRO-3 gathers every unit of the rank's stages once per step and
// frees it after the step's last backward: the whole gathered parameters live
// through every phase (pipeline_runtime.h).
void peak_term(const Setting& x, Interim&, PlanEstimate& e) {
  const auto act = activation_term(x);
  const auto& st = x.st;
  const auto& pb = x.pb;
  const double L = x.Lr, k = x.kr;
  const bool z2 = x.c.zero_stage == 2, z3 = x.c.zero_stage == 3;  // at one rank too: the same buffers
  const bool z3_per_step = z3 && x.c.pp > 1;
  const double outer_units = z3_per_step ? st.padded * pb.param : z3 ? (st.embed_unit + st.head_unit) * pb.param : 0.0;
  struct Phase {
    double acts, transient;
  };
  std::vector<Phase> phases{{act.saved_layers + act.head_saved + act.loss_peak, outer_units}};  // backward starts at the loss
  double worst_block_transient = outer_units;
  const double per_layer = act.layer_full + act.scores;
  if (z2 || z3) {
    constexpr int kBucketsInFlight = 2;
    const double bucket = z3 ? st.largest_block : st.largest_bucket;  // elements, padded
    const double gloo_copy = x.req.device.name == "cpu" ? 1.0 : 0.0;
    const double per_flight = bucket * pb.grad * (1 + gloo_copy) + bucket / st.z * pb.grad;
    // Gathered: the block computing, zero_prefetch ahead, and (measured) one
    // more: the unit just done is freed only when its bucket launches.
    // Under parameter offload the gather in flight also reads a device copy of
    // its host chunk, freed once the gather is waited for.
    const double gathered = z3_per_step ? outer_units
                            : z3 ? outer_units + st.frozen_outer_gathered +
                                       (2 + x.a.compute_config.zero_prefetch) * (st.largest_block * pb.param + st.frozen_block_gathered) +
                                       (x.c.offload_params ? st.largest_block / st.z * pb.param : 0.0)
                                 : 0.0;
    const double blocks_per_bucket = st.block_elements > 0 ? bucket / st.block_elements : double(L);
    const int flights = static_cast<int>(std::min<double>(kBucketsInFlight, std::max<double>(0, double(st.buckets) - 1)));
    for (int j = 0; j <= flights && L - k >= 1; ++j) {
      const double done = std::min(L - k, std::floor(j * blocks_per_bucket));
      const double trans = gathered + bucket * pb.grad + j * per_flight;
      phases.push_back({act.saved_layers - done * per_layer + act.block_grads + act.tied_head_grad, trans});
      worst_block_transient = std::max(worst_block_transient, trans);
    }
    if (L - k < 1) worst_block_transient = gathered + bucket * pb.grad + flights * per_flight;
  } else if (L - k >= 1) {
    phases.push_back({act.saved_layers + act.block_grads + act.tied_head_grad, 0.0});  // the last block's backward
  }
  // Every block recomputes: the last one rebuilt whole, its output held, then
  // its backward. Under a split backward the pairs waiting for W keep theirs,
  // the one in its I all but the block being rebuilt (the peak moment counts
  // it as waiting already).
  if (k >= 1 && k >= L)
    phases.push_back({x.live * k * act.layer_input + std::max(0.0, act.pending_w - act.layer_w) + act.layer_full -
                          act.layer_input +
                          x.tokens * x.h * x.rep * x.pb.act + act.block_grads + act.scores + act.tied_head_grad,
                      worst_block_transient});
  // A recomputed block's forward (nothing kept but its input) while a split
  // backward's W's are pending, as zero-bubble schedules run forwards: every
  // pair's holdings whole, and the block's widest moment, its MLP's
  // up-projection output and activation (SwiGLU: gate, up, silu(gate));
  // measured for GPT by bench/bench_pipeline_sends.py.
  if (k >= 1 && act.pending_w > 0)
    phases.push_back({act.saved_layers + act.head_saved +
                          x.tokens * ((x.f.gated_mlp ? 3 : 2) * x.ffn / x.t + x.h * x.rep) * x.pb.act,
                      outer_units});
  // The optimizer's step, after backward (activations freed): a whole-matrix
  // optimizer's exchange buffers (this rank's pieces out, its update pieces
  // back, the matrices it owns gathered) and the Newton-Schulz temporaries of
  // the largest matrix, in the exchange's dtype. AdamW's fused step has none.
  const auto& ow = x.ow;
  if (ow.matrices > 0)
    phases.push_back({0.0, (ow.owned + 2 * ow.piece + ow.workspace) * ow.wire()});
  for (auto& ph : phases) ph.acts += act.sent;  // held through every phase
  const auto peak_phase = *std::max_element(phases.begin(), phases.end(), [](const Phase& p, const Phase& q) {
    return p.acts + p.transient < q.acts + q.transient;
  });
  e.activation_bytes = peak_phase.acts;
  e.transient_bytes = peak_phase.transient;
  e.total_bytes =
      e.frozen_bytes + e.param_bytes + e.grad_bytes + e.optim_bytes + e.activation_bytes + e.transient_bytes;
}

// Optimizer post-validation: the backup of what the speculative step changes,
// the optimizer's weights (masters, or the parameters) and moments, and under
// a loss scaler the reduced gradients (the step unscales them in place).
void post_validation_term(const Setting& x, Interim&, PlanEstimate& e) {
  if (!x.a.compute_config.pipeline.post_validation) return;
  const double n = x.c.zero_stage ? x.st.shard : x.st.padded;
  e.optim_bytes += n * (update_bytes(x.pb) + x.pb.moments * x.ow.state_scale);
  if (optim::precision_setup(x.a.precision, x.a.compute_config.reduce_dtype).loss_scaling) e.grad_bytes += n * x.pb.grad;
}

}  // namespace nnstrain::parallel::cost
