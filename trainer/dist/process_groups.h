// The distributed runtime of one training process: rendezvous through c10d's
// TCPStore, the world / data-parallel / tensor-parallel / context-parallel /
// pipeline groups (tensor-parallel ranks innermost, so a TP group stays within a
// node, then context-parallel, then pipeline, then data-parallel: Llama 3's
// [TP, CP, PP, DP]), point-to-point transfers between pipeline stages, collectives that fail
// loudly naming the collective and the ranks that stopped answering, and a CPU
// control group for decisions every rank must agree on (stop, skip).
//
// Waiting: Gloo work is waited on by the host, with the collective timeout.
// NCCL work is waited on the current CUDA stream (the host never blocks inside a
// step); its timeout is enforced by a monitor thread that watches every NCCL
// collective in flight and, past collective_timeout_s, prints the same diagnosis
// and ends the process with status 1. NCCL's own watchdog, set a little later,
// is the backstop.
//
// CUDA graphs (trainer/train/step_graph.h): an NCCL collective issued while the
// current stream is being captured is recorded, not run. The monitor leaves it
// alone (querying an event recorded in a capture is an error, and c10d's
// watchdog skips such work too); each replay of the graph is watched whole
// instead (watch_replay), and replays count the captured collectives' traffic.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "trainer/dist/dist_env.h"
#include "trainer/dist/flight_recorder.h"
#include "trainer/dist/nccl_rules.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace nnstrain::dist {

// A collective failed or timed out; what() names it and the ranks missing.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Collectives issued on a group since the start, by kind, and the bytes they
// carried (each rank's input): the direct evidence that a layer of parallelism
// actually communicated (metrics.jsonl's tp_* fields, the parity tests).
struct Traffic {
  int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0;
  int64_t send_recv = 0;  // ring steps (context parallelism): one send and one receive each
  int64_t bytes = 0;
  int64_t sends = 0;  // point to point (pipeline stages); their bytes are in `bytes`
  int64_t all_to_all = 0;  // expert parallelism's token dispatch (and its counts exchange)
  Traffic operator-(const Traffic& o) const {
    return {all_reduce - o.all_reduce, all_gather - o.all_gather, reduce_scatter - o.reduce_scatter,
            send_recv - o.send_recv,   bytes - o.bytes,           sends - o.sends,
            all_to_all - o.all_to_all};
  }
  Traffic& operator+=(const Traffic& o) {
    all_reduce += o.all_reduce, all_gather += o.all_gather, reduce_scatter += o.reduce_scatter;
    send_recv += o.send_recv, bytes += o.bytes, sends += o.sends, all_to_all += o.all_to_all;
    return *this;
  }
};

struct Group {
  std::string name;                          // "world", "dp0", "tp1", ...
  std::vector<int> ranks;                    // global ranks, in group order
  int rank = 0;                              // this process's index in `ranks`
  c10::intrusive_ptr<c10d::Backend> backend; // null when size() == 1
  bool nccl = false;                         // backend is NCCL: waits go on the stream
  // Gloo under NCCL's point-to-point rules (NNSTRAIN_P2P_SEMANTICS=nccl): its
  // groups go through this communicator's own "stream" (nccl_rules.h).
  std::shared_ptr<NcclRulesP2P> nccl_rules;
  Traffic traffic;
  int size() const { return static_cast<int>(ranks.size()); }
};

struct RuntimeOptions {
  int tp = 1;                                // tensor-parallel degree (plan_ngpus)
  int cp = 1;                                // context-parallel degree (ranks splitting one sequence)
  int pp = 1;                                // pipeline ranks (pas_config.pp_size)
  int ep = 1;                                // expert-parallel degree (divides dp x cp)
  int zero_ngroups = 1;                      // ZeRO shards within dp / zero_ngroups ranks
  std::string backend = "auto";              // auto | nccl | gloo
  bool cuda = false;                         // tensors live on CUDA
  std::chrono::milliseconds timeout{600000};
  // One process with real (one-rank) backends, so that its collectives run the
  // code of many ranks (ZeRO-2/3 at one rank: NCCL's streams on one GPU).
  bool one_rank_backend = false;
  bool pp_validation = false;  // make pp_validation (optimizer post-validation)
  bool stage = false;          // make `stage` (an optimizer that gathers whole matrices: Muon)
  // Gloo's point-to-point under NCCL's rules (nccl_rules.h); read from
  // NNSTRAIN_P2P_SEMANTICS=nccl by the Runtime when not set here.
  bool nccl_p2p_rules = false;
  // The flight recorder (flight_recorder.h): its file and how many operations
  // it keeps (0: none).
  std::string flight_path;
  size_t flight_size = 0;
};

// Connects this rank to the job's rendezvous store (rank 0 serves it), waiting
// up to `timeout`. Throws CollectiveError naming the rank and address on failure.
c10::intrusive_ptr<c10d::Store> rendezvous(const DistEnv& env, std::chrono::milliseconds timeout);

class Runtime {
 public:
  // `store`: the job's rendezvous (rendezvous() above), made before the plan so
  // that the ranks can agree on it; null connects here. Unused for one process.
  Runtime(const DistEnv& env, const RuntimeOptions& opts, c10::intrusive_ptr<c10d::Store> store = nullptr);
  // Without shutdown() first (an error left the run) the backends are aborted:
  // a clean NCCL shutdown would wait for peers that may never come.
  ~Runtime();
  // The clean exit, after the last collective: the monitor and heartbeat stop,
  // then every backend shuts down in the reverse of its creation order (NCCL
  // communicators finalised and destroyed, as destroy_process_group() does).
  void shutdown();

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const std::string& backend_name() const { return backend_name_; }
  // The rendezvous store, for agreement off the training stream (asynchronous checkpoints).
  c10::intrusive_ptr<c10d::Store> store() const { return store_; }

  // Rank = ((dp index x pp + pp index) x cp + cp index) x tp + tp index:
  // tensor-parallel ranks innermost, then context-parallel, then pipeline, then
  // data-parallel. `cp` holds the ranks that split one sequence, `pp` the
  // pipeline's ranks in stage order (each one rank, no backend, at size 1).
  // `dp` holds the ranks at this cp, pp and tp index (different samples, the
  // same tokens of them); `dp_cp` those at this pp and tp index: parameters are
  // replicated over it, so gradients are reduced (and ZeRO shards) over dp x cp.
  // At cp 1 dp_cp is dp.
  Group world, dp, tp, cp, pp, dp_cp;
  // Expert parallelism: dp_cp cut into consecutive slices of ep ranks (`ep`:
  // each holds a different E / ep of every MoE layer's experts and routes tokens
  // among them); `edp`: the dp_cp ranks at my place in my slice, which hold the
  // same experts, so expert gradients are reduced and ZeRO-sharded over it.
  // At ep 1: `ep` this rank alone (no backend), `edp` is dp_cp.
  Group ep, edp;
  Group zero;        // ZeRO shard group: a slice of dp_cp of size dp x cp / zero_ngroups
  Group zero_cross;  // the same shard position in the other ZeRO groups
  // Expert buckets' ZeRO group: the edp ranks inside my ZeRO group (HSDP with ep:
  // ep divides the ZeRO group, so its slices lie within one). Without HSDP: edp.
  // Their cross-group replicas are zero_cross (the same place in each ZeRO group
  // holds the same experts and the same chunk of them).
  Group ezero;
  Group control;     // CPU (Gloo) over the world, for agreement
  Group pp_validation;  // the pp group's ranks again (RuntimeOptions::pp_validation)
  // Every rank at this pp index (dp x cp x tp: all that hold pieces of this
  // stage's parameters), made with RuntimeOptions::stage; Muon's owners live here.
  Group stage;

  // Collectives on the Runtime's own groups (the monitor keeps a pointer to
  // `g`). `what` names the operation in error messages. Async ones return a
  // handle; wait() turns a failure into a CollectiveError. On NCCL groups wait()
  // only orders the current stream after the collective.
  c10::intrusive_ptr<c10d::Work> all_reduce_async(Group& g, at::Tensor t, const char* what);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_async(Group& g, at::Tensor out, at::Tensor in, const char* what);
  c10::intrusive_ptr<c10d::Work> all_gather_async(Group& g, at::Tensor out, at::Tensor in, const char* what);
  // Rows of `in` (dim 0) in_splits[d] to rank d of g, `out` receiving out_splits[s] from rank s.
  c10::intrusive_ptr<c10d::Work> all_to_all_async(Group& g, at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                                                  std::vector<int64_t> in_splits, const char* what);
  // Point to point, always as one group (p2p_async): NCCL's rules hold on
  // every backend (docs/parallelism.md, "Point to point under NCCL's rules"):
  //   - no tags: between two ranks of `g` the n-th send meets the n-th receive,
  //     so both sides must issue their transfers in the same order;
  //   - a send may not complete before its receive is posted, unless both sit
  //     in groups that are in flight together;
  //   - the groups of one communicator run one after another.
  // NCCL: one coalesced group (ncclGroupStart/End, batch_isend_irecv's
  // communicator); Gloo: the operations issued together (tag 0), or, with
  // NNSTRAIN_P2P_SEMANTICS=nccl, through the communicator's NcclRulesP2P.
  // Peers are indices into g.ranks; wait on the work returned.
  c10::intrusive_ptr<c10d::Work> p2p_async(Group& g, std::vector<P2POp> ops, const char* what);
  // One ring step on `g`: `send` to the next rank of the group (rank + 1 mod
  // size) and `recv` (same shape) from the previous one, as one group. Steps in
  // flight together are told apart by their order alone: every rank of `g`
  // must start them in the same order.
  c10::intrusive_ptr<c10d::Work> ring_shift_async(Group& g, at::Tensor send, at::Tensor recv, const char* what);
  void wait(const c10::intrusive_ptr<c10d::Work>& w, const Group& g, const char* what);
  // After a captured step's graph was launched on the current stream: its
  // collectives counted as if issued again, and the monitor watches an event
  // recorded behind the launch (no tensor) as one collective `what` over the
  // world, so a replay hung on a lost peer ends in the same diagnosis after
  // collective_timeout_s. A no-op without NCCL.
  void watch_replay(const char* what);
  void all_reduce(Group& g, at::Tensor t, const char* what);   // sum
  void all_reduce_max(Group& g, at::Tensor t, const char* what);
  void barrier(const char* what);
  // true on every rank if `flag` is true on any: the collective stop decision.
  bool any(bool flag, const char* what);
  // Element-wise maximum over every rank, on the host (the CPU control group).
  void host_max(std::vector<int64_t>& values, const char* what);

 private:
  Group make_group(const std::string& name, std::vector<int> ranks, bool cpu_only);
  // Runs `issue` (a backend call returning work) as collective `what` on `g`,
  // counted and, on NCCL, watched by the monitor until it completes.
  // `add` is the collective's traffic, counted on `g`.
  // p2p_async's group, counted as `add`.
  c10::intrusive_ptr<c10d::Work> coalesced(Group& g, std::vector<P2POp> ops, const char* what, const Traffic& add);
  c10::intrusive_ptr<c10d::Work> post_p2p(Group& g, std::vector<P2POp> ops);  // coalesced's transfers, as given
  template <typename F>
  c10::intrusive_ptr<c10d::Work> issue(Group& g, const char* what, const Traffic& add, F&& issue);
  [[noreturn]] void fail(const Group& g, const char* what, const std::string& cause);
  // The failure message: the collective, the group and which ranks stopped answering.
  std::string diagnose(const Group& g, const char* what, const std::string& cause, int64_t seq);
  void heartbeat_loop();
  void monitor_loop();

  // An NCCL collective the monitor watches. It holds the work (and so the
  // collective's tensors) only until the caller waits on it; from then on an
  // event recorded behind the wait on the caller's stream stands in for it, so
  // the monitor never keeps a temporary alive longer than the step does.
  struct InFlight {
    int64_t seq;
    const Group* group;
    const char* what;
    std::chrono::steady_clock::time_point deadline;
    c10::intrusive_ptr<c10d::Work> work;  // null while the backend call itself runs, and after wait()
    std::shared_ptr<void> done_event;     // at::cuda::CUDAEvent, set by wait()
  };
  void stop_threads();

  int rank_, world_;
  std::string backend_name_;
  RuntimeOptions opts_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<int64_t> seq_{0};      // collectives entered, published by the heartbeat
  std::atomic<bool> stop_{false};
  std::thread heartbeat_;
  std::mutex inflight_mu_;
  std::vector<InFlight> inflight_;
  // Collectives recorded by the latest CUDA graph capture (its id; under
  // inflight_mu_), counted at each replay.
  std::vector<std::pair<Group*, Traffic>> captured_;
  unsigned long long capture_id_ = 0;
  std::thread monitor_;
  std::vector<c10::intrusive_ptr<c10d::Backend>> backends_;  // every group's, in creation order
  bool shut_down_ = false;
  std::unique_ptr<FlightRecorder> flight_;  // null when RuntimeOptions::flight_size is 0
  std::atomic<bool> flight_dumped_{false};  // the first dump's reason stands
  void dump_flight(const std::string& reason);
};

}  // namespace nnstrain::dist
