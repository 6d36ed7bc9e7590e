// Pipeline schedules as data (DESIGN.md: "A schedule is data, checked before it
// runs"). A schedule is, per pipeline rank, the ordered list of what that rank
// does: forward (F), backward (B), or backward split into its input-gradient
// (I) and weight-gradient (W) halves, each for one stage and one micro-batch.
// It is generated, validated, lowered (sends and receives inserted between
// ranks, a local hand-off where adjacent stages share a rank), dry-run for
// deadlock and simulated in time, and hashed, identically on every rank; the
// planner's simulator and the runtime run the same lists, so a predicted bubble
// can be compared with a measured one and a hang can name the action it waited on.
// No LibTorch: plain data, in nnstrain_base.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace nnstrain::parallel::pipeline {

enum class Op { F, B, I, W, Send, Recv };

struct Action {
  Op op = Op::F;
  int stage = 0;      // Send / Recv: the stage that consumes the message (-1: the tied embedding's gradient)
  int micro = 0;
  int peer = -1;      // Send / Recv: the other rank
  bool grad = false;  // Send / Recv: a gradient going back rather than an activation going forward
  int group = -1;     // Send / Recv: its group in the row; a group's transfers are posted together
  bool operator==(const Action& o) const {
    return op == o.op && stage == o.stage && micro == o.micro && peer == o.peer && grad == o.grad &&
           group == o.group;
  }
};

// A schedule that cannot run; what() holds the reason and the action grid.
struct ScheduleError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Schedule {
  std::string name;
  int ranks = 1, stages = 1, micros = 1;
  std::vector<int> stage_rank;               // stage -> the pipeline rank holding it
  std::vector<std::vector<Action>> actions;  // per rank, in the order it runs them
};

// The schedulers pipeline_scheduler names:
//   gpipe             every forward, then every backward (stages == ranks)
//   1f1b              one forward one backward after a warm-up (stages == ranks)
//   1f1b_interleaved  Megatron's: stages = v x ranks looped over the ranks
//                     (stage s on rank s % ranks), micros a multiple of ranks
//   zb1p              ZB-H1: backward split into I and W, W delayed by r micro-batches
//                     on rank r to fill 1F1B's bubbles; p live micro-batches at most
//   zbv               zero-bubble V (the paper's): stages = 2 x ranks, rank r holding
//                     stages r and 2 x ranks - 1 - r, backward split, W filling the
//                     fill and drain, each W right after its I in the steady state; at
//                     most 2 p stage-activations live (1F1B's rank 0: p whole stages)
// Throws ScheduleError naming the constraint a combination breaks.
Schedule make_schedule(const std::string& scheduler, int ranks, int stages, int micros);
// The stages a scheduler runs on `ranks` when pipeline_nstages is auto: two per
// rank for 1f1b_interleaved and zbv, one otherwise.
int default_stages(const std::string& scheduler, int ranks);
const std::vector<std::string>& scheduler_names();

// Every micro-batch's F, then its B (or I then W) for every stage, each on the
// rank holding the stage, F before B/I and I before W where they share a rank;
// at most ranks x (stages it holds) W's pending after their I on a rank.
void validate(const Schedule& s);

// Inserts the transfers, in groups that hold under NCCL's point-to-point
// rules (docs/parallelism.md, "Point to point under NCCL's rules"): tags are
// ignored (the n-th send of a rank pair meets the n-th receive), a send does
// not complete before its receive is posted unless both are in groups in
// flight together, and a rank's groups run one after another. Every message
// gets a key, the time its producer ends when each rank runs its list at F = I
// = W = 1 with free transfers; both ends post it in their group of that key,
// the sender right after the producer, the receiver before its first action
// starting at or after the key. Groups and the actions waiting on them then
// follow one order of keys on every rank, so no cycle of waits can form, and
// the same message order holds on both ends of every pair. Adjacent stages on
// one rank hand off locally (nothing inserted). In a group: sends first, then
// receives, each by (peer, gradient, stage, micro-batch).
Schedule lower(const Schedule& s);
// Evaluation: every stage's forward of one micro-batch, in stage order, each
// rank its own stages; lowered as lower() does.
Schedule lower_forward(const Schedule& s);

// Per action of lowered row `rank`: the group to have completed before it
// (-1: none), the one holding a receive it consumes. Waiting on a group waits
// on every group before it too: a communicator's groups complete in order.
std::vector<int> group_waits(const Schedule& lowered, int rank);

// When the pipeline executor may drop a sent tensor: per action of lowered
// row `rank`, the positions (in the row) of the sends whose groups the wait
// before it completes (group_waits), each once. Whatever no wait retires (a
// row's last sends) waits for the step's end.
std::vector<std::vector<int>> retired_sends(const Schedule& lowered, int rank);

// The dry run under the backend's rules: the lowered lists run as NCCL runs
// them. Per rank a compute stream (F, B, I, W in order, each after the groups
// group_waits names) and one communication stream (the groups in order, each
// after the compute before it, as c10d orders a collective after the current
// stream); messages paired first in, first out per (sender, receiver), tags
// ignored; a group completes once every partner's group is in flight. Throws
// BackendRuleError on a pair whose order differs at its two ends or on a
// state where nothing can run.
struct BackendRuleError : ScheduleError {
  BackendRuleError(const std::string& line, const std::string& grid)
      : ScheduleError(line + "\n" + grid), line(line) {}
  std::string line;  // one line: the schedule, pp, micro-batches and the first conflicting pair of actions
};
struct BackendCheck {
  // The tied embedding's gradient exchange after the step (first and last
  // stage on different ranks): one group of a send and a receive on each.
  bool tied = false;
  // Optimizer post-validation: per rank, the prefix of its row run before the
  // previous step is validated (post_validation_prefix). Checked over two
  // steps, with a host sync (the validation) after the second step's
  // prefixes, and again with the prefixes rerun after it (a rollback).
  std::vector<int> prefix;
};
void check_backend_rules(const Schedule& lowered, const BackendCheck& check = {});

// Durations of one action of one stage; B = I + W.
struct Costs {
  double f = 1, i = 1, w = 1;
  double comm = 0;  // a transfer between ranks
  // Per stage when not empty (one entry each): its own F, I and W in place of
  // f, i and w, for stages that differ (uneven layers, the head's stage).
  struct Stage {
    double f = 1, i = 1, w = 1;
  };
  std::vector<Stage> stage;
};

struct Simulation {
  double makespan = 0;
  std::vector<double> busy;      // per rank: time spent computing
  // Per rank: most stage-activations held at once, from F until the backward is
  // done (its B, or its W: W reads the layers' inputs F kept).
  std::vector<int> peak_live;
  double bubble(int rank) const { return makespan > 0 ? 1 - busy[rank] / makespan : 0; }
  double mean_bubble() const;
};

// Runs the schedule (compute lists, or lowered ones with sends and receives) in
// time: each rank in its order, an action starting once its rank is free and
// what it consumes is done (a posted receive waits at its consumer, as the
// executor does). Throws ScheduleError if no rank can go on (a deadlock), the
// grid marking each rank's action that waits. Timing only: the backend's
// rules are check_backend_rules'.
Simulation simulate(const Schedule& s, const Costs& c = {});

// Optimizer post-validation (docs/parallelism.md): a rank runs the leading
// forwards of step t + 1 before step t's optimizer step is validated. Per rank
// of a lowered schedule, how many actions of its row that prefix holds: only
// forwards and groups of activation transfers, up to the first backward work,
// cut between groups so that every message sent inside a prefix is received
// inside its receiver's and every one received inside was sent inside (a
// rollback reruns all the prefixes, message for message). A forward whose send
// the receiver's prefix does not take ends its prefix before that send: it
// goes after validation. Every rank computes the same cuts.
std::vector<int> post_validation_prefix(const Schedule& lowered);

// Consecutive steps in steady state. Synchronous (post_validation false):
// every step starts once every rank finished the one before (the global norm
// all-reduce before the optimizer), so the period is one step's makespan.
// Post-validation: rank r's prefix of step t + 1 starts once r finished step
// t, the rest of it once every rank did. Optimizer and validation take no time.
struct SteadyState {
  double period = 0;         // time from one step's end to the next's
  std::vector<double> busy;  // per rank and step: time spent computing
  std::vector<int> peak_live;
  double bubble(int rank) const { return period > 0 ? 1 - busy[rank] / period : 0; }
  double mean_bubble() const;
};
// `s` compute lists or lowered ones (lowered here when not).
SteadyState simulate_steady(const Schedule& s, const Costs& c = {}, bool post_validation = true);

// One row per rank: "rank 0 | F0.0 F0.1 B0.0 ..." (stage.micro); `waiting[r]`,
// when given, is the index of rank r's action to mark as [waited on] (-1: none).
std::string grid(const Schedule& s, const std::vector<int>& waiting = {});

// The text form (a schedule can be loaded from a file and is validated the same way):
//   schedule NAME ranks R stages S micros M
//   placement RANK_OF_STAGE_0 RANK_OF_STAGE_1 ...
//   rank 0: F0.0 F0.1 I0.0 W0.0 ...
// Lowered rows add transfers: sa1.0>1 (send the activation for stage 1,
// micro-batch 0, to rank 1), sg / ra / rg alike (g: gradient, r: receive from
// <RANK), st>1 and rt<1 for the tied embedding's gradient; a group's
// transfers joined by '+' (sa1.0>1+rg0.0<1).
std::string to_text(const Schedule& s);
// Throws ScheduleError naming `what` (a file name) and the line at fault.
Schedule from_text(const std::string& text, const std::string& what = "schedule");

// FNV-1a of the text form: what the ranks agree on.
uint64_t hash(const Schedule& s);

}  // namespace nnstrain::parallel::pipeline
