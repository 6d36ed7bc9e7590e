// The cost model's terms (internal): one function per thing a candidate costs,
// each in the file of its family (trainer/plan/README.md), all listed in ONE
// table, cost_terms() in cost_model.cpp, which both estimates iterate: the
// flat one (pp 1) and the pipeline's (pp > 1).
//
// A term is `void f(const Setting&, Interim&, PlanEstimate&)`: it reads the
// setting (setting.h), may read what an earlier term left in Interim or in
// the estimate, and fills its own PlanEstimate fields. To add one (a new
// parallel dimension, an attention variant's cost): write its function in a
// file of trainer/plan/cost/ (a new family: a new file; the CMake glob picks it
// up), declare it below, and give it a row in cost_terms() at the place its
// inputs are ready; give PlanEstimate (plan.h) a field for it if it has a
// figure of its own. Its time joins step_s (and comm_s, if it is
// communication) through the table; under pp its `pipeline` column says how
// the pipeline ranks combine it.
#pragma once

#include <vector>

#include "trainer/plan/cost/setting.h"

namespace nnstrain::parallel::cost {

// Compute: the training FLOPs per token (work_per_token) and the recomputed
// layers' extra forward, per token.
struct Compute {
  double flops_token = 0, recompute_flops = 0;
};

// What a term leaves for the terms after it (beyond its PlanEstimate fields).
struct Interim {
  Compute compute;  // compute_term's: dp_comm_term overlaps the reduction with backward's share
};

// How the pipeline estimate (pp > 1) takes a term; without pp the one rank is every rank.
enum class OverRanks {
  Worst,     // priced for every pipeline rank: the rank needing most memory (total_bytes) is the estimate's
  Slowest,   // priced for every pipeline rank: the slowest one's figures (its `time` the largest)
  Schedule,  // on each stage's critical path per micro-batch: the schedule simulation prices its fields
             // (pipeline.cpp schedule_time); its function still runs (into scratch) for Interim
  Step,      // once per step, on the worst rank's setting
};

struct Term {
  const char* name;
  const char* prices;  // what it prices
  const char* fills;   // the PlanEstimate fields it fills
  OverRanks pipeline;
  double PlanEstimate::*time;  // its seconds in step_s (nullptr: memory only)
  bool comm;                   // its seconds are communication: summed into comm_s
  void (*price)(const Setting&, Interim&, PlanEstimate&);
};

// The table (cost_model.cpp), in the order the terms run.
const std::vector<Term>& cost_terms();

// ---- memory (memory.cpp) -------------------------------------------------------

void state_term(const Setting& x, Interim&, PlanEstimate& e);
void frozen_term(const Setting& x, Interim&, PlanEstimate& e);  // LoRA's frozen base
void post_validation_term(const Setting& x, Interim&, PlanEstimate& e);
void peak_term(const Setting& x, Interim&, PlanEstimate& e);  // activation_term's, at the step's peak

// Activations of one micro-batch (micro-batches run one after another), in
// the compute dtype, counted as our models keep them for backward
// (models/gpt, models/llama; fused attention keeps q, k, v, its output and a
// per-row logsumexp, never the scores). Tensor and sequence parallelism
// divide them, recompute keeps only the first k layers' inputs.
struct Activations {
  double layer_full = 0;      // one layer's kept activations
  double layer_input = 0;     // a recomputed layer's input
  double scores = 0;          // unfused attention's scores and softmax, per layer
  double saved_layers = 0;    // every layer's, as recompute leaves them
  double head_saved = 0;      // around the final norm and the head
  double loss_peak = 0;       // the loss's own peak (loss_term)
  double block_grads = 0;     // one block's backward on top of the kept activations
  double tied_head_grad = 0;  // a tied embedding's head gradient waiting in autograd
  double sent = 0;            // pipeline: the boundary tensors held (Setting::sends)
  double sent_per_tensor = 0;  // one of them: a micro-batch's hidden states on this rank
  double pending_w = 0;       // pipeline: what the (stage, micro-batch)s between I and W keep
  double layer_w = 0;         // pipeline, split backward: what one layer's W needs of one micro-batch
};
Activations activation_term(const Setting& x);
// The zero-bubble split: what one (stage, micro-batch) of the rank's layers keeps from its I until its W.
double pending_w_bytes(const Setting& x);

// ---- compute (compute.cpp) -------------------------------------------------------

void compute_term(const Setting& x, Interim& s, PlanEstimate& e);
// The FLOPs a training step runs per token (causal attention's masked half skipped).
double work_per_token(const Setting& x);

// ---- communication: one file per kind (comm_tp.cpp, comm_cp.cpp, comm_dp.cpp, comm_ep.cpp) ----

void tp_comm_term(const Setting& x, Interim&, PlanEstimate& e);
void cp_comm_term(const Setting& x, Interim&, PlanEstimate& e);
void dp_comm_term(const Setting& x, Interim& s, PlanEstimate& e);
void ep_comm_term(const Setting& x, Interim&, PlanEstimate& e);

// Context parallelism, one layer of one micro-batch: K and V (this rank's
// s / cp tokens, its key/value heads) travel round the ring (p2p: cp - 1 steps,
// each transfer hidden behind the block computing meanwhile, exposed only
// beyond it; backward sends the K/V with their fp32 gradients) or are gathered
// once (all_gather: the whole sequence's K/V, gathered in forward and again in
// backward, the gradients reduce-scattered, exposed in full). The bytes in
// flight are what the ring holds beside the layer's activations.
struct CpLayer {
  double forward_s = 0, backward_s = 0;  // exposed, with the contention below
  double forward_contention_s = 0, backward_contention_s = 0;  // the blocks slowed by the transfers they hide
  double kv_backward = 0;                // bytes in flight during a layer's backward
};
CpLayer cp_layer(const Setting& x);

// Expert parallelism, one MoE layer of one micro-batch (cost_model.h AllToAll).
AllToAll a2a_layer(const Setting& x);

// ---- the pipeline (pipeline.cpp) ---------------------------------------------------

// pp 1: no bubble, no transfers between stages (pipeline.cpp schedule_time prices them under pp).
void pipeline_term(const Setting& x, Interim&, PlanEstimate& e);

// ---- offload (offload.cpp) and the optimizer's step (optimizer.cpp) -----------------

void offload_memory_term(const Setting& x, Interim&, PlanEstimate& e);
void offload_time_term(const Setting& x, Interim&, PlanEstimate& e);
void optimizer_time_term(const Setting& x, Interim&, PlanEstimate& e);

}  // namespace nnstrain::parallel::cost
