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
  int stage = 0;
  int micro = 0;
  int peer = -1;      // Send / Recv: the other rank
  bool grad = false;  // Send / Recv: a gradient going back rather than an activation going forward
  bool operator==(const Action& o) const {
    return op == o.op && stage == o.stage && micro == o.micro && peer == o.peer && grad == o.grad;
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

// Inserts the transfers: after a forward whose next stage lives on another rank a
// Send of the activation, before the consuming forward a Recv; the same for the
// gradient going back. Adjacent stages on one rank hand off locally (nothing inserted).
Schedule lower(const Schedule& s);

// When the sends of lowered row `rank` are certainly delivered, so that
// their tensors can go: per action of the row, the positions (in the row) of
// the sends whose delivery its completion proves; only a Recv retires any.
// Our Recv of a message from q completes once q has posted its Send, and q
// runs its row in order with blocking receives, so every receive of q's row
// from us before that Send has completed: the matching sends of ours are
// delivered and waiting for them returns without any rank's help.
// Whatever no receive retires (a row's last sends) waits for the step's end.
// Throws ScheduleError when a Recv has no matching Send or a retired send
// comes after its retiring Recv (a schedule the dry run refuses).
std::vector<std::vector<int>> retired_sends(const Schedule& lowered, int rank);

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
// what it consumes is done. Throws ScheduleError if no rank can go on (a
// deadlock), the grid marking each rank's action that waits.
Simulation simulate(const Schedule& s, const Costs& c = {});

// Optimizer post-validation (docs/parallelism.md): a rank runs the leading
// forwards of step t + 1 before step t's optimizer step is validated. Per rank
// of a lowered schedule, how many actions of its row that prefix holds: only
// forwards and activation transfers, up to the first backward work, cut so
// that every message sent inside a prefix is received inside its receiver's
// and every one received inside was sent inside (a rollback reruns all the
// prefixes, message for message). A forward whose send the receiver's prefix
// does not take ends its prefix before that send: it goes after validation.
// Every rank computes the same cuts.
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
std::string to_text(const Schedule& s);
// Throws ScheduleError naming `what` (a file name) and the line at fault.
Schedule from_text(const std::string& text, const std::string& what = "schedule");

// FNV-1a of the text form: what the ranks agree on.
uint64_t hash(const Schedule& s);

}  // namespace nnstrain::parallel::pipeline
