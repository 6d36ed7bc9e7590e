#include "trainer/pipeline/runtime.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <deque>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "base/log.h"
#include "data/dataset.h"
#include "models/common/weight_grad.h"
#include "models/model.h"
#include "trainer/dist/process_groups.h"
#include "trainer/state/grad_reducer.h"
#include "trainer/state/param_units.h"

namespace nnstrain::parallel {

namespace {

using pipeline::Action;
using pipeline::Op;

// What stage `s` of `p` covers.
models::CausalLM::HeldPieces stage_pieces(const PipelinePlan& p, const std::vector<StageBlocks>& blocks,
                                          const std::vector<int>& stages) {
  models::CausalLM::HeldPieces h;
  h.embed = h.head = false;
  h.blocks.assign(blocks.empty() ? 0 : blocks.back().end, false);
  for (int s : stages) {
    h.embed = h.embed || s == 0;
    h.head = h.head || s == p.stages - 1;
    for (int64_t b = blocks[s].begin; b < blocks[s].end; ++b) h.blocks[b] = true;
  }
  return h;
}

std::vector<int> stages_on(const pipeline::Schedule& s, int rank) {
  std::vector<int> out;
  for (int st = 0; st < s.stages; ++st)
    if (s.stage_rank[st] == rank) out.push_back(st);
  return out;
}

pipeline::Schedule make(const PipelinePlan& p) {
  return pipeline::make_schedule(p.scheduler, p.pp, p.stages, static_cast<int>(p.nmicros));
}

std::string describe(const Action& a) {
  // A collective inside a stage's own work (the cp ring, tp's, a ZeRO gather) fails during F, B, I or W.
  const std::string where = " stage " + std::to_string(a.stage) + ", micro-batch " + std::to_string(a.micro);
  switch (a.op) {
    case Op::F: return "in the forward (F) of" + where;
    case Op::B: return "in the backward (B) of" + where;
    case Op::I: return "in the input gradient (I) of" + where;
    case Op::W: return "in the weight gradient (W) of" + where;
    default: break;
  }
  const bool in = a.op == Op::Recv;
  return std::string(in ? (a.grad ? "receiving the gradient of" : "receiving the activation for")
                        : (a.grad ? "sending the gradient to" : "sending the activation to")) +
         " stage " + std::to_string(a.stage) + ", micro-batch " + std::to_string(a.micro) + (in ? ", from" : ", to") +
         " pipeline rank " + std::to_string(a.peer);
}

}  // namespace

int pipeline_rank_of(int rank, int tp, int cp, int pp) { return (rank / (tp * cp)) % pp; }

void check_transfers(const PipelinePlan& plan, bool tied, bool post_validation) {
  const auto sched = make(plan);
  auto lowered = pipeline::lower(sched);
  // Test hook (NNSTRAIN_TEST_P2P_UNGROUPED=1): every transfer a group of its
  // own, as before the lowering grouped them, so that tests see the refusal.
  if (const char* e = std::getenv("NNSTRAIN_TEST_P2P_UNGROUPED"); e && std::string(e) == "1")
    for (auto& row : lowered.actions) {
      int group = 0;
      for (auto& a : row)
        if (a.op == Op::Send || a.op == Op::Recv) a.group = group++;
    }
  pipeline::BackendCheck check;
  check.tied = tied;
  if (post_validation) check.prefix = pipeline::post_validation_prefix(lowered);
  pipeline::check_backend_rules(lowered, check);
  pipeline::check_backend_rules(pipeline::lower_forward(sched));
}

void hold_stages(models::CausalLM& model, const PipelinePlan& plan, int pp_rank) {
  model.hold_only(stage_pieces(plan, stage_blocks(plan), stages_on(make(plan), pp_rank)));
}

void pipeline_replicas(std::vector<ParamShard>& shards, models::CausalLM& model, const PipelinePlan& plan,
                       dist::Runtime& rt, int world) {
  const auto sched = make(plan);
  const auto blocks = stage_blocks(plan);
  // Which pipeline ranks hold each parameter.
  std::map<std::string, std::vector<int>> holders;
  for (int p = 0; p < plan.pp; ++p)
    for (const auto& name : model.params_of(stage_pieces(plan, blocks, stages_on(sched, p)))) holders[name].push_back(p);
  const int tp = rt.tp.size(), cp = rt.cp.size(), my_t = rt.rank() % tp;
  for (auto& sh : shards) {
    const auto& h = holders.at(sh.name);
    if (sh.expert) {  // the ranks holding the same experts at this stage (tensor_parallel_shards); never tied
      sh.norm_weight /= static_cast<double>(h.size());
      continue;
    }
    const bool split = !sh.spec.is_full();  // a tensor-parallel piece: only my TP position's ranks hold it
    std::vector<int> replicas;
    for (int r = 0; r < world; ++r) {
      if (std::find(h.begin(), h.end(), pipeline_rank_of(r, tp, cp, plan.pp)) == h.end()) continue;
      if (split && r % tp != my_t) continue;
      replicas.push_back(r);
    }
    sh.spec.replica_ranks = replicas;
    sh.norm_weight /= static_cast<double>(h.size());  // each holder's gradient is the whole (tied: summed)
  }
}

std::vector<int> pipeline_units(const models::CausalLM& model, const PipelinePlan& plan, int pp_rank, int zero_stage) {
  const auto sched = make(plan);
  const auto blocks = stage_blocks(plan);
  const auto mine = stages_on(sched, pp_rank);
  const auto ties = model.head_ties();
  const int nblocks = static_cast<int>(model.num_layers());
  const auto per_block = parameter_units(model);
  std::vector<int> units;
  const auto layouts = model.param_layouts();  // what this rank holds, in registration order
  for (size_t k = 0; k < layouts.size(); ++k) {
    const auto& name = layouts[k].name;
    if (std::find(ties.begin(), ties.end(), name) != ties.end()) {
      units.push_back(zero_stage == 3 ? nblocks + 2 : plan.stages);  // a unit of its own
      continue;
    }
    if (zero_stage == 3) {
      units.push_back(per_block[k]);
      continue;
    }
    int stage = -1;
    for (int s : mine) {
      const auto held = model.params_of(stage_pieces(plan, blocks, {s}));
      if (std::find(held.begin(), held.end(), name) != held.end()) {
        stage = s;
        break;
      }
    }
    units.push_back(stage);
  }
  return units;
}

struct PipelineExecutor::Impl {
  std::function<void(const data::Batch&)> before_head;  // set_before_head
  models::CausalLM& model;
  PipelinePlan plan;
  dist::Runtime& rt;
  TrainingState& state;
  GradientReducer& reducer;
  Options opts;
  pipeline::Schedule sched, lowered;  // compute actions; with the transfers (what runs)
  int me = 0, S = 1, M = 1;
  std::vector<StageBlocks> blocks;
  // ZeRO 2 and 3 (the reducer follows the schedule): per stage, the buckets of
  // its parameters (layout order); per action of this rank's row, the ZeRO-3
  // units to have gathered before it and to free after it; all of them in the
  // order of first use (the step's gathers).
  bool zero_schedule = false;
  std::vector<std::vector<size_t>> stage_buckets, wait_before, free_after;
  std::vector<size_t> gather_order;
  // Tied parameters (the head's use of the embedding) when the first and last
  // stage live on different ranks: their indices in the state, and the other rank.
  std::vector<size_t> tied;
  int tie_peer = -1;

  // Per (stage, micro): what a forward left for its backward, and the
  // tensors between stages.
  std::vector<at::Tensor> input, output, act_in, grad_out, grad_send;
  // Groups of transfers posted and not yet waited on, in row order (their ids
  // ascending): each keeps its sent tensors alive and its receive buffers
  // until a wait (group_waits: before the action consuming one of its
  // receives) completes it and every group before it, as a communicator's
  // groups complete in order.
  struct Posted {
    int group = -1;
    size_t first = 0;  // its first action's position in the row (named on a failure)
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<at::Tensor> sent;
    std::vector<std::pair<Action, at::Tensor>> received;
  };
  std::deque<Posted> posted;
  std::vector<int> waits;  // group_waits of this rank's row
  pipeline::Schedule eval_lowered;  // evaluation: each stage's forward of one batch
  std::vector<int> eval_waits;
  // Split backward: the linears defer their weight gradients while this rank
  // runs I, into the (stage, micro)'s store, which its W empties.
  std::optional<models::common::SplitLinears> split_linears;
  std::vector<models::common::WeightGradStore> weight_grads;
  const std::vector<data::Batch>* batches = nullptr;
  at::Tensor loss_sum, loss_scale;
  at::Tensor weights;   // [M]: each micro-batch's share of the step's counted targets (over dp x cp)
  bool poison = false;
  // Synthetic costs (NNSTRAIN_PIPELINE_SYNTHETIC_MS=F,I,W, milliseconds per
  // layer): every F, I and W waits its time instead of computing, and the
  // transfers carry zeros, so a few cores can time a pipeline of many ranks
  // (bench/pipeline_bubble.py). The step's busy time and span are logged.
  std::optional<pipeline::Costs> synthetic;
  std::chrono::steady_clock::time_point last_end;
  // Fault injection for the kill test (NNSTRAIN_TEST_PIPELINE_KILL=GLOBAL_RANK:STEP:ACTION):
  // that rank SIGKILLs itself before that action of its STEP-th train_step, so
  // the death lands mid-schedule by construction, not by timing.
  struct KillAt { int rank, step; size_t action; };
  std::optional<KillAt> kill_at;
  int steps_run = 0;
  double busy_s = 0;
  std::chrono::steady_clock::time_point start;  // synthetic: when this step began on this rank
  // The step in progress: the next action of the row, the phase callback and
  // where it stands; post-validation's prefix (pipeline::post_validation_prefix).
  size_t next = 0, prefix = 0;
  std::function<void(bool)> phase;
  bool in_backward = false;

  Impl(models::CausalLM& m, const PipelinePlan& p, dist::Runtime& r, TrainingState& st, GradientReducer& red,
       const Options& o)
      : model(m), plan(p), rt(r), state(st), reducer(red), opts(o), sched(make(p)), lowered(pipeline::lower(sched)) {
    me = rt.pp.rank;
    S = sched.stages;
    M = sched.micros;
    blocks = stage_blocks(plan);
    const int first = sched.stage_rank[0], last = sched.stage_rank[S - 1];
    if (first != last && (me == first || me == last)) {
      tie_peer = me == first ? last : first;
      const auto ties = model.head_ties();
      for (size_t k = 0; k < state.params().size(); ++k)
        if (std::find(ties.begin(), ties.end(), state.params()[k].name) != ties.end()) tied.push_back(k);
    }
    if (state.options().zero_stage >= 2) plan_zero();
    waits = pipeline::group_waits(lowered, me);
    eval_lowered = pipeline::lower_forward(sched);
    eval_waits = pipeline::group_waits(eval_lowered, me);
    if (opts.post_validation) prefix = static_cast<size_t>(pipeline::post_validation_prefix(lowered)[me]);
    const size_t n = static_cast<size_t>(S) * M;
    input.resize(n), output.resize(n), act_in.resize(n), grad_out.resize(n), grad_send.resize(n);
    weight_grads.resize(n);
    const auto& row = sched.actions[me];
    if (opts.split_backward && std::any_of(row.begin(), row.end(), [](const Action& a) { return a.op == Op::I; }))
      split_linears.emplace();
    if (const char* e = std::getenv("NNSTRAIN_PIPELINE_SYNTHETIC_MS")) synthetic = parse_synthetic(e);
    if (const char* e = std::getenv("NNSTRAIN_TEST_PIPELINE_KILL")) {
      KillAt k{};
      if (std::sscanf(e, "%d:%d:%zu", &k.rank, &k.step, &k.action) != 3)
        throw std::runtime_error(std::string("NNSTRAIN_TEST_PIPELINE_KILL='") + e + "': expected GLOBAL_RANK:STEP:ACTION");
      if (k.rank == rt.rank()) kill_at = k;
    }
  }

  // Whether action `a` accumulates into its stage's gradients: B; I too, even
  // split (norms, embeddings, biases outside the linears and the head take
  // theirs there); W when split (the linears' weights).
  bool weight_backward(const Action& a) const {
    return a.op == Op::B || a.op == Op::I || (a.op == Op::W && opts.split_backward);
  }

  void plan_zero() {
    zero_schedule = true;
    reducer.follow_schedule();
    const auto& L = state.layout();
    std::map<std::string, size_t> index;
    for (size_t k = 0; k < state.params().size(); ++k) index[state.params()[k].name] = k;
    stage_buckets.resize(S);
    for (int s : stages_on(sched, me)) {
      auto& b = stage_buckets[s];
      for (const auto& name : model.params_of(stage_pieces(plan, blocks, {s}))) b.push_back(L.bucket_of[index.at(name)]);
      std::sort(b.begin(), b.end());
      b.erase(std::unique(b.begin(), b.end()), b.end());
    }
    const auto& row = lowered.actions[me];
    wait_before.assign(row.size(), {});
    free_after.assign(row.size(), {});
    std::vector<int64_t> first(L.buckets.size(), -1), last(L.buckets.size(), -1);
    for (size_t k = 0; k < row.size(); ++k) {
      if (row[k].op == Op::Send || row[k].op == Op::Recv) continue;
      for (auto b : stage_buckets[row[k].stage]) {
        if (first[b] < 0) first[b] = static_cast<int64_t>(k);
        last[b] = static_cast<int64_t>(k);
      }
    }
    for (size_t b = 0; b < L.buckets.size(); ++b) {
      if (first[b] < 0) continue;
      wait_before[first[b]].push_back(b);
      free_after[last[b]].push_back(b);
    }
    for (const auto& w : wait_before) gather_order.insert(gather_order.end(), w.begin(), w.end());
    // A tied parameter's gradient is summed in this rank's shard (sum_tied):
    // its bucket must be itself alone, chunked alike on both ranks (pipeline_units).
    for (auto k : tied)
      TORCH_CHECK(L.buckets[L.bucket_of[k]].params.size() == 1, "pipeline: the tied parameter ",
                  state.params()[k].name, " shares a ZeRO bucket");
  }

  static pipeline::Costs parse_synthetic(const std::string& text) {
    pipeline::Costs c;
    char comma1 = 0, comma2 = 0;
    std::istringstream in(text);
    if (!(in >> c.f >> comma1 >> c.i >> comma2 >> c.w) || comma1 != ',' || comma2 != ',' || c.f < 0 || c.i < 0 || c.w < 0)
      throw std::runtime_error("NNSTRAIN_PIPELINE_SYNTHETIC_MS='" + text + "': expected F,I,W milliseconds per layer");
    return c;
  }

  // Synthetic mode: stage s's share of `ms_per_layer`, waited for.
  void wait_cost(int s, double ms_per_layer) {
    const double secs = ms_per_layer * 1e-3 * static_cast<double>(blocks[s].end - blocks[s].begin);
    std::this_thread::sleep_for(std::chrono::duration<double>(secs));
    busy_s += secs;
    last_end = std::chrono::steady_clock::now();
  }
  at::Tensor zeros_like_activation(int j) {
    return torch::zeros(activation_shape((*batches)[j]), torch::TensorOptions().dtype(opts.activation_dtype).device(opts.device));
  }
  void run_synthetic(const Action& a) {
    const int s = a.stage, j = a.micro;
    const auto& c = *synthetic;
    if (a.op == Op::F) {
      wait_cost(s, c.f);
      if (s == S - 1) return;
      output[at(s, j)] = zeros_like_activation(j);
      if (sched.stage_rank[s + 1] == me) act_in[at(s + 1, j)] = output[at(s, j)];
      return;
    }
    const bool whole = a.op == Op::B || (a.op == Op::I && !opts.split_backward);
    if (a.op == Op::W && !opts.split_backward) return;
    wait_cost(s, whole ? c.i + c.w : a.op == Op::I ? c.i : c.w);
    if (a.op != Op::W && s > 0) pass_back(s, j, zeros_like_activation(j));
    if (a.op != Op::I) release(s, j);
  }

  size_t at(int s, int j) const { return static_cast<size_t>(s) * M + j; }
  int tag(bool grad, int stage, int micro) const { return ((grad ? 1 : 0) * S + stage) * M + micro; }

  std::vector<int64_t> activation_shape(const data::Batch& b) const {
    return {b.x.size(0), b.x.size(1) / opts.sequence_divisor, opts.hidden};
  }

  // Posts the group starting at row[k] (its transfers are consecutive) as one
  // coalesced point-to-point group; returns the position after it. `sending`
  // gives what a Send carries, `shape` a receive's buffer. Gloo moves host
  // memory: a CUDA tensor goes through the host.
  template <typename Sending, typename Shape>
  size_t post(const std::vector<Action>& row, size_t k, const Sending& sending, const Shape& shape, const char* what) {
    const bool host = !rt.pp.nccl && opts.device.is_cuda();
    Posted g;
    g.group = row[k].group;
    g.first = k;
    std::vector<dist::P2POp> ops;
    size_t end = k;
    for (; end < row.size() && (row[end].op == Op::Send || row[end].op == Op::Recv) && row[end].group == g.group; ++end) {
      const auto& a = row[end];
      if (a.op == Op::Send) {
        auto t = sending(a).detach().to(opts.activation_dtype).contiguous();
        if (host) t = t.to(torch::kCPU);
        g.sent.push_back(t);
        ops.push_back({true, t, a.peer});
      } else {
        auto buf = torch::empty(shape(a), torch::TensorOptions()
                                              .dtype(opts.activation_dtype)
                                              .device(host ? c10::Device(c10::kCPU) : opts.device));
        g.received.emplace_back(a, buf);
        ops.push_back({false, buf, a.peer});
      }
    }
    g.work = rt.p2p_async(rt.pp, std::move(ops), what);
    posted.push_back(std::move(g));
    return end;
  }

  // Waits for posted group `group` (every group: INT_MAX) and hands each
  // receive to `place(action, tensor)`; the groups before it that are
  // complete go too, their sent tensors with them. The wait orders this
  // rank's compute after the group (NCCL: the stream, on which the groups
  // before it complete first; Gloo: the host), and only its partners' progress
  // could hold it: the lowering's keys make that progress come first. A group
  // before it still in flight (Gloo: a send whose peer has not consumed it)
  // is left to its own consumer or the step's end, so the host never waits on
  // a transfer this action does not need.
  template <typename Place>
  void wait_through(int group, const std::vector<Action>& row, const Place& place) {
    const bool all = group == std::numeric_limits<int>::max();
    for (auto it = posted.begin(); it != posted.end() && it->group <= group;) {
      if (!all && it->group != group && !it->work->isCompleted()) {
        ++it;
        continue;
      }
      try {
        rt.wait(it->work, rt.pp, "pipeline transfer");
      } catch (const dist::CollectiveError& e) {
        // Name a receive of the group when it has one: that is what this rank waited for.
        size_t k = it->first;
        for (size_t i = it->first; i < row.size() && row[i].group == it->group; ++i)
          if (row[i].op == Op::Recv) { k = i; break; }
        fail_at(k, row, e);
      }
      for (auto& [a, t] : it->received) place(a, opts.device.is_cuda() && !t.is_cuda() ? t.to(opts.device) : t);
      it = posted.erase(it);
    }
  }

  void place_received(const Action& a, const at::Tensor& t) { (a.grad ? grad_out : act_in)[at(a.stage, a.micro)] = t; }

  void finish_sends() {
    wait_through(std::numeric_limits<int>::max(), lowered.actions[me],
                 [this](const Action& a, const at::Tensor& t) { place_received(a, t); });
  }

  models::Documents docs(const data::Batch& b) const { return {b.positions, b.segments}; }

  // The stage's forward: its blocks on what came in; the last stage's loss.
  at::Tensor forward(int s, const data::Batch& b, const at::Tensor& in) {
    const auto d = docs(b);
    auto x = s == 0 ? model.embed(b.x, d) : in;
    return model.blocks(x, blocks[s].begin, blocks[s].end, b.x.size(1), d);
  }

  void run_f(int s, int j) {
    const auto& b = (*batches)[j];
    at::Tensor in;
    if (s > 0) {
      in = act_in[at(s, j)].detach().requires_grad_(true);
      act_in[at(s, j)] = at::Tensor();
      input[at(s, j)] = in;
    }
    auto y = forward(s, b, in);
    if (s == S - 1) {
      // Token-weighted, as the trainer's own loop: this micro-batch's mean x its
      // share of the targets (0, not NaN, when it counts none).
      const auto w = weights[j];
      if (before_head) before_head(b);
      auto mean = model.head_loss(y, b.y);
      auto loss = torch::where(w.gt(0), mean, torch::zeros_like(mean)) * w.to(mean.scalar_type());
      if (poison) loss = loss * std::numeric_limits<double>::infinity();
      loss_sum += loss.detach().to(torch::kFloat32);
      output[at(s, j)] = loss_scale.defined() ? loss * loss_scale : loss;
      return;
    }
    output[at(s, j)] = y;
    if (sched.stage_rank[s + 1] == me) act_in[at(s + 1, j)] = y.detach();
  }

  // The gradient backward starts from: none for the loss, else what came back.
  std::vector<at::Tensor> start_grad(int s, int j) {
    if (s == S - 1) return {};
    return {grad_out[at(s, j)].to(output[at(s, j)].scalar_type())};
  }

  void pass_back(int s, int j, const at::Tensor& g) {
    if (sched.stage_rank[s - 1] == me) grad_out[at(s - 1, j)] = g;
    else grad_send[at(s, j)] = g;
  }

  void release(int s, int j) {
    input[at(s, j)] = output[at(s, j)] = grad_out[at(s, j)] = at::Tensor();
  }

  // A stage before the last never sees the micro-batch's LM loss gradient:
  // hand the model its weight x the loss scale (MoE balancing losses scale by it).
  void tell_loss_grad(int s, int j) {
    if (s == S - 1) return;
    const auto w = weights[j].to(torch::kFloat32);
    model.set_loss_grad(loss_scale.defined() ? w * loss_scale.to(w.device()) : w);
  }

  void run_b(int s, int j) {
    tell_loss_grad(s, j);
    torch::autograd::backward({output[at(s, j)]}, start_grad(s, j));
    if (s > 0) pass_back(s, j, input[at(s, j)].grad());
    release(s, j);
  }

  // I: the whole backward but for the linears' weight gradients, which wait in
  // the store with what they need (their inputs and output gradients); the
  // graph, and the rest of the activations, go now. Norms and the embedding
  // take theirs here (models/common/weight_grad.h).
  void run_i(int s, int j) {
    if (!opts.split_backward) return run_b(s, j);
    {
      models::common::CaptureWeightGrads capture(weight_grads[at(s, j)]);
      tell_loss_grad(s, j);
      torch::autograd::backward({output[at(s, j)]}, start_grad(s, j));
    }
    if (s > 0) pass_back(s, j, input[at(s, j)].grad());
    release(s, j);
  }

  // W: the deferred weight gradients only (dW = dY^T X per linear), no chain.
  void run_w(int s, int j) {
    if (!opts.split_backward) return;
    weight_grads[at(s, j)].flush();
  }

  void run(const Action& a) {
    if (synthetic) return run_synthetic(a);
    switch (a.op) {
      case Op::F: return run_f(a.stage, a.micro);
      case Op::B: return run_b(a.stage, a.micro);
      case Op::I: return run_i(a.stage, a.micro);
      case Op::W: return run_w(a.stage, a.micro);
      default: return;  // transfers: posted by run_until
    }
  }

  // What a Send of the training step carries: the forward's output, or the
  // input's gradient (dropped once posted: the group keeps it).
  at::Tensor sending(const Action& a) {
    if (!a.grad) return output[at(a.stage - 1, a.micro)];
    auto t = grad_send[at(a.stage + 1, a.micro)];
    grad_send[at(a.stage + 1, a.micro)] = at::Tensor();
    return t;
  }

  // A transfer that failed or timed out: this rank's grid, the action marked.
  [[noreturn]] void fail_at(size_t k, const std::vector<Action>& row, const std::exception& e) {
    std::vector<int> waiting(sched.ranks, -1);
    waiting[me] = static_cast<int>(k);
    const auto& a = row[k];
    const std::string where = "pipeline rank " + std::to_string(me) + " (global rank " + std::to_string(rt.rank()) +
                              ") failed " + describe(a);
    const bool eval = &row == &eval_lowered.actions[me];
    log::error(where + "; the schedule " + sched.name + (eval ? " (evaluation)" : "") +
               ", the action waited on in [brackets]:\n" + pipeline::grid(eval ? eval_lowered : lowered, waiting));
    throw dist::CollectiveError(std::string(e.what()) + "; " + where);
  }

  // Runs this rank's row from `next` up to (not including) action `end`: a
  // group of transfers is posted at its first action, a compute action first
  // waits for the group holding what it receives (group_waits).
  void run_until(size_t end) {
    const auto& row = lowered.actions[me];
    auto place = [this](const Action& a, const at::Tensor& t) { place_received(a, t); };
    auto shape = [this](const Action& a) { return activation_shape((*batches)[a.micro]); };
    auto send = [this](const Action& a) { return sending(a); };
    while (next < end) {
      const size_t k = next;
      const auto& a = row[k];
      // The kill hook fires at its action, also inside a group (posted whole at its first).
      size_t last = k;
      while (last + 1 < row.size() && (row[last + 1].op == Op::Send || row[last + 1].op == Op::Recv) &&
             (a.op == Op::Send || a.op == Op::Recv) && row[last + 1].group == a.group)
        ++last;
      if (kill_at && kill_at->step == steps_run && kill_at->action >= k && kill_at->action <= last) std::raise(SIGKILL);
      if (a.op == Op::Send || a.op == Op::Recv) {
        if (k == 0 || row[k - 1].group != a.group || (row[k - 1].op != Op::Send && row[k - 1].op != Op::Recv)) {
          try {
            next = post(row, k, send, shape, "pipeline transfer");
          } catch (const dist::CollectiveError& e) {
            fail_at(k, row, e);
          }
        } else {
          ++next;
        }
        continue;
      }
      const bool backward = a.op != Op::F;
      if (phase && backward != in_backward) phase(in_backward = backward);
      const bool reduce = zero_schedule && weight_backward(a);
      if (waits[k] >= 0) wait_through(waits[k], row, place);
      try {
        if (zero_schedule) reducer.gather_buckets(wait_before[k], true);
        if (reduce) reducer.begin_backward(stage_buckets[a.stage]);
        run(a);
        if (reduce) reducer.end_backward();
        if (zero_schedule) reducer.free_buckets(free_after[k]);
      } catch (const dist::CollectiveError& e) {
        fail_at(k, row, e);
      }
      ++next;
    }
  }

  void sum_tied() {
    if (tied.empty()) return;
    torch::NoGradGuard no_grad;
    const auto& L = state.layout();
    // Both ranks send and receive in one group (two lone sends of a whole
    // gradient would wait on each other under NCCL), then add: a + b and b + a
    // are the same floats, so the two copies stay identical. ZeRO 2, 3: the
    // reduced chunk of the tied parameter's own bucket, the same elements on
    // both ranks (same size, same place in the ZeRO group).
    const bool host = !rt.pp.nccl && opts.device.is_cuda();
    std::vector<at::Tensor> mine, other;
    std::vector<dist::P2POp> ops;
    for (size_t i = 0; i < tied.size(); ++i) {
      const auto b = L.bucket_of[tied[i]];
      mine.push_back(zero_schedule
                         ? state.shard_grad().narrow(0, L.shard_offset[b], L.chunk_size(L.buckets[b]))
                         : state.flat_grad().narrow(0, L.offset[tied[i]], state.params()[tied[i]].tensor.numel()));
      auto copy = mine.back().clone();
      ops.push_back({true, host ? copy.to(torch::kCPU) : copy, tie_peer});
    }
    for (size_t i = 0; i < tied.size(); ++i) {
      other.push_back(torch::empty({mine[i].numel()}, mine[i].options().device(host ? c10::Device(c10::kCPU) : opts.device)));
      ops.push_back({false, other.back(), tie_peer});
    }
    rt.wait(rt.p2p_async(rt.pp, std::move(ops), "tied embedding gradient"), rt.pp, "tied embedding gradient");
    for (size_t i = 0; i < tied.size(); ++i) mine[i].add_(other[i].to(mine[i].device()));
  }
};

PipelineExecutor::PipelineExecutor(models::CausalLM& model, const PipelinePlan& plan, dist::Runtime& rt,
                                   TrainingState& state, GradientReducer& reducer, const Options& opts)
    : impl_(std::make_unique<Impl>(model, plan, rt, state, reducer, opts)) {
  // The dry run under NCCL's rules (the same check refused the plan at load if it failed).
  check_transfers(plan, !model.head_ties().empty(), opts.post_validation);
  if (impl_->split_linears)
    log::info("pipeline: backward split into I and W (W: the linears' weight gradients only, from the inputs and "
              "output gradients I left)");
  if (impl_->synthetic) {
    // The simulator's prediction for the same costs (stages of equal layer counts).
    auto c = *impl_->synthetic;
    const double layers = static_cast<double>(plan.stage_layers.front());
    c.f *= layers, c.i *= layers, c.w *= layers;
    if (!opts.split_backward) c.i += c.w, c.w = 0;
    // Consecutive steps: synchronous (as one step alone) or overlapping under post-validation.
    const auto sim = pipeline::simulate_steady(impl_->sched, c, opts.post_validation);
    std::string bubbles;
    for (int r = 0; r < plan.pp; ++r) bubbles += (r ? " " : "") + std::to_string(sim.bubble(r));
    log::info("pipeline synthetic costs F " + std::to_string(c.f) + " I " + std::to_string(c.i) + " W " +
              std::to_string(c.w) + " ms per stage; simulated bubble per pipeline rank: " + bubbles);
  }
}

PipelineExecutor::~PipelineExecutor() = default;

void PipelineExecutor::start_step(const std::vector<data::Batch>& micro_batches, const at::Tensor& weights,
                                  const at::Tensor& loss_scale, bool poison,
                                  const std::function<void(bool backward)>& phase, bool prefix) {
  auto& I = *impl_;
  TORCH_CHECK(static_cast<int>(micro_batches.size()) == I.M, "pipeline: ", micro_batches.size(),
              " micro-batches for a schedule of ", I.M);
  I.batches = &micro_batches;
  I.weights = weights;
  I.loss_scale = loss_scale;
  I.poison = poison;
  I.phase = phase;
  I.in_backward = false;
  I.next = 0;
  I.loss_sum = torch::zeros({}, torch::TensorOptions().device(I.opts.device).dtype(torch::kFloat32));
  // Every rank starts the timed step together, but under post-validation,
  // whose steps overlap by design (the bench measures over a window of them).
  if (I.synthetic && !I.opts.post_validation)
    I.rt.all_reduce(I.rt.pp, torch::zeros({1}, torch::TensorOptions().device(I.opts.device)), "pipeline synthetic start");
  if (I.synthetic) {
    I.start = I.last_end = std::chrono::steady_clock::now();
    I.busy_s = 0;
  }
  ++I.steps_run;
  if (I.zero_schedule) I.reducer.gather_buckets(I.gather_order, false);  // ZeRO-3: once per step
  if (prefix) I.run_until(I.prefix);
}

void PipelineExecutor::redo_prefix() {
  auto& I = *impl_;
  // Every message sent inside a prefix was received inside its receiver's, so
  // these groups complete once every rank reached validation.
  I.finish_sends();
  for (size_t k = 0; k < I.input.size(); ++k) I.input[k] = I.output[k] = I.act_in[k] = at::Tensor();
  I.loss_sum.zero_();
  I.next = 0;
  I.in_backward = false;
  I.run_until(I.prefix);
}

size_t PipelineExecutor::prefix_length() const { return impl_->prefix; }

at::Tensor PipelineExecutor::finish_step() {
  auto& I = *impl_;
  I.run_until(I.lowered.actions[I.me].size());
  I.finish_sends();
  if (I.zero_schedule) I.reducer.complete_reductions();  // the shard is whole before the tied sum
  if (I.synthetic) {
    // Steady-clock times (one clock for every process on a machine): the bench
    // takes the step's span from the earliest start to the latest end over ranks.
    auto ns = [](std::chrono::steady_clock::time_point t) {
      return std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
    };
    log::info("pipeline synthetic step: pipeline rank " + std::to_string(I.me) + " start_ns " + ns(I.start) +
              " end_ns " + ns(I.last_end) + " busy_ns " + std::to_string(static_cast<int64_t>(I.busy_s * 1e9)));
  }
  I.sum_tied();
  I.batches = nullptr;
  I.loss_scale = at::Tensor();
  I.phase = nullptr;
  return I.loss_sum;
}

void PipelineExecutor::set_before_head(std::function<void(const data::Batch&)> f) { impl_->before_head = std::move(f); }

at::Tensor PipelineExecutor::eval_loss(const data::Batch& batch) {
  auto& I = *impl_;
  auto loss = eval_forward(batch, [&](const at::Tensor& y) {
    if (I.before_head) I.before_head(batch);
    return I.model.head_loss(y, batch.y).detach().to(torch::kFloat32);
  });
  return loss.defined() ? loss : torch::zeros({}, torch::TensorOptions().device(I.opts.device).dtype(torch::kFloat32));
}

at::Tensor PipelineExecutor::eval_forward(const data::Batch& batch,
                                          const std::function<at::Tensor(const at::Tensor& hidden)>& head) {
  auto& I = *impl_;
  torch::NoGradGuard no_grad;
  at::Tensor result;
  // ZeRO-3: this rank's units, gathered once (already so after the first
  // batch); the trainer frees them after evaluating (release_params).
  if (I.zero_schedule) I.reducer.gather_buckets(I.gather_order, true);
  // Each stage's output while it waits to be sent, and what arrives, by stage.
  std::map<int, at::Tensor> out, in;
  const auto& row = I.eval_lowered.actions[I.me];
  auto place = [&](const Action& a, const at::Tensor& t) { in[a.stage] = t; };
  auto shape = [&](const Action&) { return I.activation_shape(batch); };
  auto send = [&](const Action& a) { return out.at(a.stage - 1); };
  for (size_t k = 0; k < row.size();) {
    const auto& a = row[k];
    if (a.op == Op::Send || a.op == Op::Recv) {
      try {
        k = I.post(row, k, send, shape, "pipeline transfer (evaluation)");
      } catch (const dist::CollectiveError& e) {
        I.fail_at(k, row, e);
      }
      continue;
    }
    if (I.eval_waits[k] >= 0) I.wait_through(I.eval_waits[k], row, place);
    const int s = a.stage;
    const bool local = s > 0 && I.sched.stage_rank[s - 1] == I.me;  // handed over on this rank
    auto y = I.forward(s, batch, s == 0 ? at::Tensor() : local ? out.at(s - 1) : in.at(s));
    if (s == I.S - 1) result = head(y);
    else out[s] = y;
    ++k;
  }
  I.wait_through(std::numeric_limits<int>::max(), row, place);
  return result;
}

}  // namespace nnstrain::parallel
