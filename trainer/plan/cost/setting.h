// The cost model's inside (not a public header: planner and trainer include
// trainer/plan/cost_model.h): what every term reads of one candidate, worked
// out once per estimate (under pp: once per pipeline rank). The terms are
// declared in terms.h and listed in cost_model.cpp's table.
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/plan/cost_model.h"

namespace nnstrain::parallel::cost {

// Bytes per element: parameters (the copy compute reads), gradients (the
// reduction buffer), optimizer state (fp32 masters under *-mixed plus AdamW's
// two moments), activations. The first three are what TrainingState allocates
// (parallel::state_bytes, the same function the trainer's start-up line checks).
struct PrecisionBytes {
  double param, grad, master, moments, act;
};

PrecisionBytes precision_bytes(const config::TrainerArgs& a);

// What the optimizer updates, bytes per element: fp32 masters, else the parameters.
double update_bytes(const PrecisionBytes& pb);

// The flat buffers of one rank, element counts, as TrainingState lays them out
// (FlatLayout: buckets in reverse registration order, each padded to a multiple
// of the ZeRO group) or, under ZeRO-3, as units (each block one unit, the
// parameters before the first block one, those after it one), each padded.
struct StateLayout {
  double elements = 0;  // this rank's parameter elements (after tp; the first tp rank, which holds most)
  double padded = 0;    // in the flat buffers, padding included
  double shard = 0;     // this rank's ZeRO chunks (padded: every bucket's chunk; no ZeRO: padded)
  int z = 1;            // ZeRO group size (1: no ZeRO)
  // Expert parallelism: the expert parameters' share of the above (their own
  // buckets, E / ep experts each, ZeRO-sharded over dp x cp / ep ranks).
  double expert_elements = 0, expert_padded = 0, expert_shard = 0;
  int ez = 1;
  int64_t buckets = 0;
  double largest_bucket = 0, largest_block_param = 0;  // a block's largest parameter (any, without blocks)
  double block_elements = 0;                            // the largest block's parameters
  double embed_unit = 0, head_unit = 0, largest_block = 0;  // ZeRO-3, padded
  // Offload: the optimizer elements on the host (whole buckets, as the
  // training state takes them) and the last of those buckets.
  double host_elements = 0, last_host_bucket = 0;
  // A frozen base (LoRA): this rank's held frozen weights, not in the buffers above.
  double frozen_elements = 0, frozen_bytes = 0;
  // ZeRO-3: the frozen base's units as gathered (bytes): outside the blocks (all step), the largest block's.
  double frozen_outer_gathered = 0, frozen_block_gathered = 0;
};

// The gradient-reduction (and ZeRO) group: parameters are replicated over
// cp, so their gradients are reduced over dp x cp.
int reduce_group(const Candidate& c);

// `held` (empty: every parameter): the parameters of this rank's pipeline stages.
StateLayout state_layout(const config::TrainerArgs& a, const ModelFacts& f, const Candidate& c,
                         const PrecisionBytes& pb, const std::vector<bool>& held);

// The optimizer's step as the plan shapes it. OptimizerEntry::cost says what
// each parameter's state and matrix work are; this lays them over the
// candidate: this rank's share of state, and for a whole-matrix optimizer
// (Muon) the owners of the stage's matrices, dealt out as MatrixExchange does
// (largest FLOPs first, each to the least-loaded member, ties to the lowest),
// and what its gather and scatter move. The stage's members are its tp x cp x
// dp ranks (one pipeline index); a matrix's holders are all of them (experts
// under ep: the tp x dp x cp / ep ranks holding that expert), each holding one
// of P = tp (split dims) x Z (ZeRO's shards) pieces, on average; the owner is
// one of its holders with probability q = holders / members.
struct OptimizerWork {
  double state_scale = 1;   // this rank's state per element over AdamW's two moments (Muon's matrices: 1/2)
  double matrix_share = 0;  // of this rank's parameter elements, those in whole-matrix work
  bool bf16 = false;        // the matrix work and the exchange in bf16 (else fp32)
  int members = 1;          // the stage's ranks
  int64_t matrices = 0;     // the stage's
  // Elements: the busiest owner's gather (what it lacks of its matrices) and
  // the mean a member sends into it; the busiest owner's scatter (its
  // matrices' update pieces to every other holder) and what one rank receives
  // back (its own pieces, less those of matrices it owns).
  double gather_recv = 0, gather_mean = 0, scatter_send = 0, scatter_recv = 0;
  double piece = 0;          // elements of this rank's pieces of the matrices
  double busiest_flops = 0;  // the most matrix FLOPs one member owns
  double owned = 0;          // the most elements one member owns (gathered whole)
  double workspace = 0;      // elements of the largest matrix's Newton-Schulz temporaries
  double wire() const { return bf16 ? 2.0 : 4.0; }
};

// optimizer.cpp.
OptimizerWork optimizer_work(const optim::StepCost& cost, const ModelFacts& f, const Candidate& c,
                             const std::vector<bool>& held, int z, int ez);

// What every term reads: the request, the candidate and what follows from
// them once (bytes per element, this rank's flat buffers, the batch's shape).
struct Setting {
  const PlanRequest& req;
  const config::TrainerArgs& a;
  const ModelFacts& f;
  const Candidate& c;
  PrecisionBytes pb;
  StateLayout st;
  double t, d, b, s, h, heads, kv, ffn, V, L, k;
  double micro_steps;  // micro-batches per rank per step
  double tokens;       // of one micro-batch on this rank: b x s / cp
  bool sp;             // sequence parallelism
  double rep;          // what tensor parallelism leaves whole is 1/tp of the sequence under SP
  double v_local;      // this rank's rows of the LM head
  double cp;           // context-parallel ranks
  double attn_flops;   // attention's FLOPs per token per layer (forward + backward), over the whole sequence
  // What this rank holds of the layers (under pp: its stages'): Lr layers, kr
  // of them recomputed, activations of `live` micro-batches at once, the
  // embedding (first) and the head (last).
  double Lr, kr, live = 1;
  bool first = true, last = true;
  double sends = 0;  // pipeline: boundary tensors held (sent ones until retired, received ones until used)
  double w_live = 0;  // pipeline: (stage, micro-batch)s between their I and W, as `live` counts them
  double split_layers = 0;  // pipeline, split backward: the layers of the rank's largest stage (0: no split)
  // Mixture-of-Experts (moe 0: dense): the share of layers that are MoE; per
  // MoE layer each token's topk assignments to experts of width eff (SwiGLU),
  // shared experts of total width shf, E routed experts; imb: the busiest
  // expert-parallel rank's tokens over the mean (1 at ep 1: every rank runs
  // every expert on its own tokens).
  double moe = 0, moe_layers = 0, topk = 0, eff = 0, shf = 0, E = 0, imb = 1;
  // The routed experts' training FLOPs per token over all MoE layers.
  double expert_flops = 0;
  OptimizerWork ow;  // the optimizer's state and step on this rank's parameters
};

// The rank's part of the model under pp; the whole model otherwise.
struct RankPart {
  std::vector<bool> held;  // per parameter (empty: all)
  double layers = 0, recomputed = 0, live = 1, sends = 0, w_live = 0, split_layers = 0;
  bool first = true, last = true;
};

// cost: the optimizer's (optimizer_cost), when the caller has it already.
Setting setting(const PlanRequest& req, const ModelFacts& f, const Candidate& c, const RankPart& part,
                const optim::StepCost* cost = nullptr);

// The link a collective over `span` consecutive ranks uses: NVLink while they
// share a node (devices.cpp).
double link_bw(const DeviceSpec& dev, double span);

}  // namespace nnstrain::parallel::cost
