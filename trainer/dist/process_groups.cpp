#include "trainer/dist/process_groups.h"

#include <ATen/DeviceAccelerator.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef NNSTRAIN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <sstream>

#include "base/log.h"
#include "base/text.h"
#include "trainer/dist/rendezvous_socket.h"

namespace nnstrain::dist {

namespace {

// A Gloo transfer's work whose receives went into host copies of CUDA
// tensors (Gloo's send and recv move host memory only, Runtime::coalesced):
// waiting for it copies each into its device tensor.
class HostLanding : public c10d::Work {
 public:
  HostLanding(c10::intrusive_ptr<c10d::Work> work, std::vector<std::pair<at::Tensor, at::Tensor>> landing)
      : work_(std::move(work)), landing_(std::move(landing)) {}
  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override { return work_->exception(); }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    work_->wait(timeout);
    for (auto& [device, host] : landing_) device.copy_(host);
    landing_.clear();
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<std::pair<at::Tensor, at::Tensor>> landing_;  // (device tensor, host copy), emptied by wait
};

constexpr auto kHeartbeat = std::chrono::milliseconds(500);
constexpr auto kMonitorPoll = std::chrono::milliseconds(100);
// NCCL's watchdog fires this much after our monitor, which then has had time to
// diagnose (heartbeats watched 2.5 s, the store probed up to 3 s) and exit.
constexpr auto kWatchdogMargin = std::chrono::seconds(30);

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Whether the current stream is being captured into a CUDA graph (NCCL groups only:
// a Gloo-only run may have no CUDA context).
bool capturing() {
#ifdef NNSTRAIN_CUDA
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

// The id of the capture the current stream is in (when capturing()).
unsigned long long capture_id() {
  unsigned long long id = 0;
#ifdef NNSTRAIN_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(c10::cuda::getCurrentCUDAStream(), &status, &id));
#endif
  return id;
}

// One collective of `kind` carrying `bytes` (this rank's input), for Traffic.
Traffic one(int64_t Traffic::*kind, int64_t bytes) {
  Traffic t;
  ++(t.*kind);
  t.bytes = bytes;
  return t;
}

// The flight recorder's name for an operation, from what it adds to the traffic.
const char* op_name(const Traffic& t) {
  return t.all_reduce ? "all_reduce" : t.all_gather ? "all_gather" : t.reduce_scatter ? "reduce_scatter"
         : t.send_recv ? "ring_shift" : "p2p";
}

c10::intrusive_ptr<c10d::TCPStore> connect_store(const DistEnv& env, bool server, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(env.master_port);
  o.isServer = server;
  o.numWorkers = server ? std::optional<size_t>(env.world_size) : std::nullopt;
  o.waitWorkers = false;
  o.timeout = timeout;
  if (server) o.masterListenFd = take_rendezvous_socket(env.master_port);  // `nnstrain launch` reserved the port
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
}

// A rendezvous failure in one line: a port in use names the port and where it
// came from (a user's choice, so status 2); anything else without LibTorch's backtrace.
[[noreturn]] void rendezvous_failed(const DistEnv& env, const std::string& cause) {
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  if (env.rank == 0 && (cause.find("EADDRINUSE") != std::string::npos ||
                        cause.find("ddress already in use") != std::string::npos)) {
    const std::string port = std::to_string(env.master_port);
    throw DistEnvError("rank 0: the rendezvous port " + port +
                       (std::getenv("MASTER_PORT") ? " (MASTER_PORT=" + port + ")"
                                                   : " (no MASTER_PORT set: derived from the job id, or torchrun's "
                                                     "default)") +
                       " is already in use on this machine (another job, or one that has not ended, listens on "
                       "it): set MASTER_PORT to a free port");
  }
  throw CollectiveError("rank " + std::to_string(env.rank) + ": rendezvous with " + where + " failed: " + cause);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> rendezvous(const DistEnv& env, std::chrono::milliseconds timeout) {
  log::QuietTorchLog quiet;  // LibTorch's retry warnings say no more than rendezvous_failed's line
  try {
    return connect_store(env, env.rank == 0, timeout);
  } catch (const c10::Error& e) {
    rendezvous_failed(env, e.what_without_backtrace());
  } catch (const std::exception& e) {
    rendezvous_failed(env, e.what());
  }
}

Runtime::Runtime(const DistEnv& env, const RuntimeOptions& opts, c10::intrusive_ptr<c10d::Store> store)
    : rank_(env.rank), world_(env.world_size), opts_(opts), store_(std::move(store)) {
  backend_name_ = opts.backend == "auto" ? (opts.cuda ? "nccl" : "gloo") : opts.backend;
  if (const char* e = std::getenv("NNSTRAIN_P2P_SEMANTICS")) {
    const std::string v = e;
    if (v == "nccl") opts_.nccl_p2p_rules = true;
    else if (!v.empty() && v != "native")
      throw DistEnvError("NNSTRAIN_P2P_SEMANTICS='" + v + "': expected nccl (Gloo's point-to-point under NCCL's rules) or native");
  }
  if (opts_.nccl_p2p_rules && backend_name_ != "nccl" && world_ > 1)
    log::info("point-to-point on Gloo under NCCL's rules (NNSTRAIN_P2P_SEMANTICS=nccl): tags ignored, a send completes "
              "once its receive is posted, a communicator's groups run in issue order");
  const int tp_size = opts.tp, cp_size = opts.cp, pp_size = opts.pp, dp_size = world_ / (tp_size * cp_size * pp_size);
  if (world_ % (tp_size * cp_size * pp_size) != 0)
    throw std::runtime_error("world size " + std::to_string(world_) + " is not a multiple of plan_ngpus " +
                             std::to_string(tp_size) + " x context_parallel_size " + std::to_string(cp_size) +
                             " x pp_size " + std::to_string(pp_size));
  if (opts.flight_size > 0 && !opts.flight_path.empty() && world_ > 1) {
    flight_ = std::make_unique<FlightRecorder>(opts.flight_path, opts.flight_size, rank_, world_);
    FlightRecorder::install_dump_signal();
  }
  if (world_ > 1) {
    if (!store_) store_ = rendezvous(env, opts.timeout);
    store_->set("hb/" + std::to_string(rank_), "0:" + std::to_string(now_ms()));
  } else if (opts.one_rank_backend) {
    store_ = c10::make_intrusive<c10d::HashStore>();  // nobody to meet: the backend's setup stays in process
  }
  // Groups, created in one global order (each rank joins only its own) so that
  // overlapping rendezvous can never deadlock.
  // Rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index; at cp 1
  // and pp 1 the names are those of before cp and pp.
  auto rank_of = [&](int d, int p, int c, int t) { return ((d * pp_size + p) * cp_size + c) * tp_size + t; };
  const int my_t = rank_ % tp_size, my_c = (rank_ / tp_size) % cp_size, my_p = (rank_ / (tp_size * cp_size)) % pp_size;
  // The position of a group that spans one dimension, by the others' indices.
  auto suffix = [&](int p, int c, int t) {
    return (pp_size > 1 ? std::to_string(p) + "_" : std::string()) + (cp_size > 1 ? std::to_string(c) + "_" : std::string()) +
           std::to_string(t);
  };
  std::vector<int> all(world_);
  for (int r = 0; r < world_; ++r) all[r] = r;
  world = make_group("world", all, false);
  control = make_group("control", all, true);
  for (int p = 0; p < pp_size; ++p)
    for (int c = 0; c < cp_size; ++c)
      for (int t = 0; t < tp_size; ++t) {
        std::vector<int> ranks;
        for (int d = 0; d < dp_size; ++d) ranks.push_back(rank_of(d, p, c, t));
        auto g = make_group("dp" + suffix(p, c, t), ranks, false);
        if (my_p == p && my_c == c && my_t == t) dp = g;
      }
  for (int i = 0; i < dp_size * pp_size * cp_size; ++i) {
    std::vector<int> ranks;
    for (int t = 0; t < tp_size; ++t) ranks.push_back(i * tp_size + t);
    auto g = make_group("tp" + std::to_string(i), ranks, false);
    if (rank_ / tp_size == i) tp = g;
  }
  // The groups along cp (the ranks splitting one sequence) or pp (a pipeline's
  // stages): one per (dp, the other one's, tp) position, "cp<d>_[<p>_]<t>" and
  // "pp<d>_[<c>_]<t>"; at size 1 this rank alone, with no backend.
  auto along = [&](const std::string& prefix, bool over_cp, int size, int other_size) {
    Group mine;
    mine.name = prefix;
    mine.ranks = {rank_};
    if (size == 1) return mine;
    for (int d = 0; d < dp_size; ++d)
      for (int o = 0; o < other_size; ++o)
        for (int t = 0; t < tp_size; ++t) {
          std::vector<int> ranks;
          for (int i = 0; i < size; ++i) ranks.push_back(over_cp ? rank_of(d, o, i, t) : rank_of(d, i, o, t));
          auto g = make_group(prefix + std::to_string(d) + "_" + (other_size > 1 ? std::to_string(o) + "_" : "") +
                                  std::to_string(t),
                              ranks, false);
          if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) mine = g;
        }
    return mine;
  };
  cp = along("cp", true, cp_size, pp_size);
  pp = along("pp", false, pp_size, cp_size);
  // Optimizer post-validation's gradient-norm sum, in flight while the next
  // step's forwards use pp: a communicator of its own, so neither waits on the other.
  if (opts.pp_validation) pp_validation = along("ppv", false, pp_size, cp_size);
  // Parameters are replicated over dp x cp (a stage's, under pp): its members at
  // this pp and tp index, e = dp index x cp + cp index. ZeRO groups are slices of
  // it; at cp 1 it is dp and every name is as before cp.
  const int dpcp = dp_size * cp_size, zn = opts.zero_ngroups, zsize = dpcp / zn;
  auto member = [&](int e, int p, int t) { return rank_of(e / cp_size, p, e % cp_size, t); };
  auto suffix_pt = [&](int p, int t) { return (pp_size > 1 ? std::to_string(p) + "_" : std::string()) + std::to_string(t); };
  for (int p = 0; p < pp_size; ++p)
    for (int t = 0; t < tp_size; ++t) {
      if (cp_size > 1) {
        std::vector<int> ranks;
        for (int e = 0; e < dpcp; ++e) ranks.push_back(member(e, p, t));
        auto g = make_group("dpcp" + suffix_pt(p, t), ranks, false);
        if (my_p == p && my_t == t) dp_cp = g;
      }
      for (int gi = 0; gi < zn; ++gi) {
        std::vector<int> ranks;
        for (int z = 0; z < zsize; ++z) ranks.push_back(member(gi * zsize + z, p, t));
        auto g = make_group("zero" + suffix_pt(p, t) + "_" + std::to_string(gi), ranks, false);
        if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) zero = g;
      }
      for (int z = 0; z < zsize; ++z) {
        std::vector<int> ranks;
        for (int gi = 0; gi < zn; ++gi) ranks.push_back(member(gi * zsize + z, p, t));
        auto g = make_group("zerox" + suffix_pt(p, t) + "_" + std::to_string(z), ranks, false);
        if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) zero_cross = g;
      }
    }
  if (cp_size == 1) dp_cp = dp;
  stage.name = "stage";
  stage.ranks = {rank_};
  if (opts.stage)
    for (int p = 0; p < pp_size; ++p) {
      std::vector<int> ranks;
      for (int d = 0; d < dp_size; ++d)
        for (int c = 0; c < cp_size; ++c)
          for (int t = 0; t < tp_size; ++t) ranks.push_back(rank_of(d, p, c, t));
      std::sort(ranks.begin(), ranks.end());
      auto g = make_group("stage" + std::to_string(p), ranks, false);
      if (my_p == p) stage = g;
    }
  // Expert parallelism: slices of ep consecutive dp_cp members (e / ep), and
  // the members at the same place in every slice (e mod ep).
  const int ep_size = opts.ep;
  if (ep_size < 1 || dpcp % ep_size != 0)
    throw std::runtime_error("expert_parallel_size " + std::to_string(ep_size) + " does not divide dp x cp = " +
                             std::to_string(dpcp));
  if (ep_size > 1 && zn > 1 && zsize % ep_size != 0)
    throw std::runtime_error("expert_parallel_size " + std::to_string(ep_size) + " does not divide the ZeRO group of " +
                             std::to_string(zsize) + " ranks (dp x cp / zero_ngroups)");
  ep.name = "ep";
  ep.ranks = {rank_};
  edp = dp_cp;
  if (ep_size > 1) {
    for (int p = 0; p < pp_size; ++p)
      for (int t = 0; t < tp_size; ++t) {
        for (int s = 0; s < dpcp / ep_size; ++s) {
          std::vector<int> ranks;
          for (int i = 0; i < ep_size; ++i) ranks.push_back(member(s * ep_size + i, p, t));
          auto g = make_group("ep" + suffix_pt(p, t) + "_" + std::to_string(s), ranks, false);
          if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) ep = g;
        }
        for (int i = 0; i < ep_size; ++i) {
          std::vector<int> ranks;
          for (int s = 0; s < dpcp / ep_size; ++s) ranks.push_back(member(s * ep_size + i, p, t));
          auto g = make_group("edp" + suffix_pt(p, t) + "_" + std::to_string(i), ranks, false);
          if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) edp = g;
        }
        // HSDP: the same, within each ZeRO group.
        if (zn > 1)
          for (int gi = 0; gi < zn; ++gi)
            for (int i = 0; i < ep_size; ++i) {
              std::vector<int> ranks;
              for (int s = 0; s < zsize / ep_size; ++s) ranks.push_back(member(gi * zsize + s * ep_size + i, p, t));
              auto g = make_group("ezero" + suffix_pt(p, t) + "_" + std::to_string(gi) + "_" + std::to_string(i), ranks,
                                  false);
              if (std::find(ranks.begin(), ranks.end(), rank_) != ranks.end()) ezero = g;
            }
      }
  }
  if (ep_size == 1 || zn == 1) ezero = edp;
  if (store_) heartbeat_ = std::thread([this] { heartbeat_loop(); });
  if (backend_name_ == "nccl") {
    // The monitor queries CUDA events: on this rank's device, so that it never
    // opens a context on cuda:0 (a new thread's default).
    const int device = opts.cuda ? at::accelerator::getDeviceIndex() : -1;
    monitor_ = std::thread([this, device] {
      if (device >= 0) at::accelerator::setDeviceIndex(static_cast<c10::DeviceIndex>(device));
      monitor_loop();
    });
  }
}

void Runtime::stop_threads() {
  stop_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
  if (monitor_.joinable()) monitor_.join();
}

void Runtime::shutdown() {
  if (shut_down_) return;
  stop_threads();
  shut_down_ = true;
  // The NCCL-rules streams first: each ends once its queue is empty (one
  // stuck on a lost peer ends at its timeout, holding its backend till then).
  for (Group* g : {&world, &dp, &tp, &cp, &pp, &dp_cp, &ep, &edp, &ezero, &zero, &zero_cross, &control, &pp_validation,
                   &stage})
    g->nccl_rules.reset();
  for (auto it = backends_.rbegin(); it != backends_.rend(); ++it) {
    try {
      (*it)->shutdown();
    } catch (const std::exception& e) {
      log::warn(std::string("process group shutdown failed (aborting the rest): ") + e.what());
      for (; it != backends_.rend(); ++it) (*it)->abort();
      break;
    }
  }
  backends_.clear();
}

Runtime::~Runtime() {
  stop_threads();
  if (shut_down_) return;
  dump_flight("an error ended the run");
  // An error is leaving the run: abort, which never waits for peers.
  for (auto it = backends_.rbegin(); it != backends_.rend(); ++it) {
    try {
      (*it)->abort();
    } catch (...) {
    }
  }
}

Group Runtime::make_group(const std::string& name, std::vector<int> ranks, bool cpu_only) {
  Group g;
  g.name = name;
  g.ranks = ranks;
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = it != ranks.end();
  g.rank = member ? static_cast<int>(it - ranks.begin()) : -1;
  if (!member || (ranks.size() < 2 && !(opts_.one_rank_backend && world_ == 1))) return g;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("pg/" + name, store_);
  const bool nccl = backend_name_ == "nccl" && !cpu_only;
  try {
    if (nccl) {
#ifdef NNSTRAIN_CUDA
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = opts_.timeout + kWatchdogMargin;  // our monitor (monitor_loop) reports first
      g.backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, g.rank, g.size(), o);
      g.nccl = true;
#else
      throw std::runtime_error("this nnstrain was built without CUDA, so without NCCL; use compute_config.backend: gloo");
#endif
    } else {
      auto o = c10d::ProcessGroupGloo::Options::create(opts_.timeout);
      if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
        o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      else
        o->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      g.backend = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, g.rank, g.size(), o);
    }
    backends_.push_back(g.backend);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    fail(g, "process group creation", e.what());
  }
  return g;
}

void Runtime::heartbeat_loop() {
  // Its store calls fail once rank 0 is gone, which the collectives then report
  // in one line: LibTorch's warnings about it go to the log file only.
  log::QuietTorchLog quiet;
  // Its own connection, so a slow collective never delays the heartbeat.
  c10::intrusive_ptr<c10d::Store> hb;
  try {
    auto* tcp = dynamic_cast<c10d::TCPStore*>(store_.get());
    if (!tcp) throw std::runtime_error("no rendezvous server (one process)");
    DistEnv e;
    e.master_addr = tcp->getHost();
    e.master_port = tcp->getPort();
    e.world_size = world_;
    hb = connect_store(e, false, std::chrono::milliseconds(5000));
  } catch (...) {
    return;
  }
  const auto key = "hb/" + std::to_string(rank_);
  while (!stop_) {
    if (flight_ && flight_->poll_dump_request()) {
      flight_->dump("SIGUSR2");  // on request: later dumps may overwrite it
      log::info("flight recorder written on SIGUSR2: " + opts_.flight_path);
    }
    try {
      hb->set(key, std::to_string(seq_.load()) + ":" + std::to_string(now_ms()));
    } catch (...) {
      return;  // the store (rank 0) is gone; collectives will report it
    }
    std::this_thread::sleep_for(kHeartbeat);
  }
}

void Runtime::fail(const Group& g, const char* what, const std::string& cause) {
  if (flight_) flight_->failed(nullptr, cause);
  const auto msg = diagnose(g, what, cause, seq_.load());
  dump_flight(msg);
  throw CollectiveError(msg);
}

void Runtime::dump_flight(const std::string& reason) {
  if (!flight_ || flight_dumped_.exchange(true)) return;
  if (flight_->dump(reason)) log::info("flight recorder: " + opts_.flight_path);
}

std::string Runtime::diagnose(const Group& g, const char* what, const std::string& cause, int64_t my_seq) {
  std::ostringstream msg;
  msg << "rank " << rank_ << ": collective '" << what << "' (#" << my_seq << ") on group " << g.name << " (ranks "
      << util::join(g.ranks, ", ") << ") failed: " << cause;
  // One process (NCCL groups of one rank): no peer to blame, nothing to ask.
  if (g.ranks.size() < 2 && !dynamic_cast<c10d::TCPStore*>(store_.get())) return msg.str() + "; this is the only rank";
  // Which ranks stopped answering: those whose heartbeat no longer moves, or
  // that never reached this collective.
  try {
    log::QuietTorchLog quiet;  // the store may be gone: that is the finding, not LibTorch's warnings about it
    auto* tcp = dynamic_cast<c10d::TCPStore*>(store_.get());
    if (!tcp) throw std::runtime_error("no rendezvous server (one process)");
    DistEnv e;
    e.master_addr = tcp->getHost();
    e.master_port = tcp->getPort();
    auto probe = connect_store(e, false, std::chrono::milliseconds(3000));
    auto read = [&](int r) -> std::pair<int64_t, int64_t> {
      auto v = probe->get("hb/" + std::to_string(r));
      std::string s(v.begin(), v.end());
      auto colon = s.find(':');
      return {std::stoll(s.substr(0, colon)), std::stoll(s.substr(colon + 1))};
    };
    std::vector<std::pair<int64_t, int64_t>> first;
    for (int r : g.ranks) first.push_back(read(r));
    std::this_thread::sleep_for(kHeartbeat * 5);
    std::vector<int> gone, behind;
    for (size_t i = 0; i < g.ranks.size(); ++i) {
      const int r = g.ranks[i];
      if (r == rank_) continue;
      auto now = read(r);
      if (now.second == first[i].second) gone.push_back(r);
      else if (now.first < my_seq) behind.push_back(r);
    }
    if (!gone.empty()) msg << "; ranks not answering (process gone or frozen): " << util::join(gone, ", ");
    if (!behind.empty()) msg << "; ranks alive but not in this collective: " << util::join(behind, ", ");
    if (gone.empty() && behind.empty()) msg << "; every rank of the group is still alive";
  } catch (const std::exception&) {
    msg << "; the rendezvous store on rank 0 is unreachable: rank 0 is gone";
  }
  return msg.str();
}

void Runtime::monitor_loop() {
  while (!stop_) {
    std::this_thread::sleep_for(kMonitorPoll);
    std::optional<InFlight> late;
    std::string cause;
    {
      std::lock_guard<std::mutex> lock(inflight_mu_);
      const auto now = std::chrono::steady_clock::now();
      for (auto it = inflight_.begin(); it != inflight_.end();) {
        std::exception_ptr error;
        bool done = false;
        try {
          if (it->work) {
            done = it->work->isCompleted();
            if (done) error = it->work->exception();
          }
#ifdef NNSTRAIN_CUDA
          else if (it->done_event) {
            done = std::static_pointer_cast<at::cuda::CUDAEvent>(it->done_event)->query();
          }
#endif
        } catch (...) {
          done = true;
          error = std::current_exception();
        }
        if (error) {
          try {
            std::rethrow_exception(error);
          } catch (const c10::Error& err) {
            cause = err.what_without_backtrace();
          } catch (const std::exception& err) {
            cause = err.what();
          } catch (...) {
            cause = "unknown error";
          }
          late = *it;
          break;
        }
        if (done) {
          if (flight_) flight_->completed_seq(it->seq);
          it = inflight_.erase(it);
        } else if (now > it->deadline) {
          cause = "not complete after collective_timeout_s " +
                  std::to_string(std::chrono::duration<double>(opts_.timeout).count()) + " s";
          late = *it;
          break;
        } else {
          ++it;
        }
      }
    }
    if (late) {
      // Peers are gone or frozen: leave at once (teardown could block on them).
      const auto msg = diagnose(*late->group, late->what, cause, late->seq);
      if (flight_) flight_->failed(nullptr, cause);
      dump_flight(msg);
      std::cerr << "nnstrain: " << msg << std::endl;
      std::_Exit(1);
    }
  }
}

void Runtime::wait(const c10::intrusive_ptr<c10d::Work>& w, const Group& g, const char* what) {
  try {
    if (g.nccl) {
      w->wait();  // the current stream waits for the collective; the host goes on
#ifdef NNSTRAIN_CUDA
      if (capturing()) return;  // a recorded collective: never watched (watch_replay)
      // From here the monitor watches an event behind the wait, not the work:
      // the work holds the collective's tensors, which the caller may now free.
      auto done = std::make_shared<at::cuda::CUDAEvent>();
      done->record(c10::cuda::getCurrentCUDAStream());
      std::lock_guard<std::mutex> lock(inflight_mu_);
      for (auto& f : inflight_)
        if (f.work.get() == w.get()) {
          f.work.reset();
          f.done_event = done;
        }
#endif
    } else {
      w->wait(opts_.timeout);
      if (flight_) flight_->completed(w.get());
    }
  } catch (const CollectiveError&) {
    throw;
  } catch (const c10::Error& e) {
    fail(g, what, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(g, what, e.what());
  }
}

void Runtime::watch_replay(const char* what) {
  std::lock_guard<std::mutex> lock(inflight_mu_);
  for (auto& [g, add] : captured_) {  // as if issued: the heartbeat's count and the traffic figures move on
    g->traffic += add;
    ++seq_;
  }
#ifdef NNSTRAIN_CUDA
  if (!monitor_.joinable() || captured_.empty()) return;
  auto done = std::make_shared<at::cuda::CUDAEvent>();
  done->record(c10::cuda::getCurrentCUDAStream());
  inflight_.push_back({seq_.load(), &world, what, std::chrono::steady_clock::now() + opts_.timeout, {}, done});
#else
  (void)what;
#endif
}

template <typename F>
c10::intrusive_ptr<c10d::Work> Runtime::issue(Group& g, const char* what, const Traffic& add, F&& call) {
  // Recorded into a graph: counted, like its seq, by each replay (watch_replay), not now.
  const bool recorded = g.nccl && capturing();
  const bool watched = g.nccl && !recorded;
  int64_t seq = seq_.load();
  if (recorded) {
    const auto id = capture_id();
    std::lock_guard<std::mutex> lock(inflight_mu_);
    if (id != capture_id_) captured_.clear();  // a new capture: what replays from now on
    capture_id_ = id;
    captured_.push_back({&g, add});
  } else {
    g.traffic += add;
    seq = ++seq_;
  }
  int64_t flight_id = -1;
  if (flight_ && !recorded) flight_id = flight_->issued(g.name, g.ranks, op_name(add), what, add.bytes, seq);
  if (watched) {  // from the call on: creating a communicator blocks until every rank joins
    std::lock_guard<std::mutex> lock(inflight_mu_);
    inflight_.push_back({seq, &g, what, std::chrono::steady_clock::now() + opts_.timeout, {}});
  }
  // Hands the work to the monitor, or (null: the call failed) forgets the entry.
  auto settle = [&](const c10::intrusive_ptr<c10d::Work>& w) {
    if (!watched) return;
    std::lock_guard<std::mutex> lock(inflight_mu_);
    auto it = std::find_if(inflight_.begin(), inflight_.end(), [&](const InFlight& f) { return f.seq == seq; });
    if (it == inflight_.end()) return;
    if (w) it->work = w;
    else inflight_.erase(it);
  };
  c10::intrusive_ptr<c10d::Work> w;
  try {
    w = call();
  } catch (const c10::Error& e) {
    settle({});
    fail(g, what, e.what_without_backtrace());
  } catch (const std::exception& e) {
    settle({});
    fail(g, what, e.what());
  }
  settle(w);
  if (flight_id >= 0) flight_->started(flight_id, w.get());
  return w;
}

c10::intrusive_ptr<c10d::Work> Runtime::all_reduce_async(Group& g, at::Tensor t, const char* what) {
  const auto add = one(&Traffic::all_reduce, static_cast<int64_t>(t.nbytes()));
  std::vector<at::Tensor> v{std::move(t)};
  return issue(g, what, add, [&] { return g.backend->allreduce(v); });
}

c10::intrusive_ptr<c10d::Work> Runtime::reduce_scatter_async(Group& g, at::Tensor out, at::Tensor in, const char* what) {
  return issue(g, what, one(&Traffic::reduce_scatter, static_cast<int64_t>(in.nbytes())),
               [&] { return g.backend->_reduce_scatter_base(out, in); });
}

c10::intrusive_ptr<c10d::Work> Runtime::all_gather_async(Group& g, at::Tensor out, at::Tensor in, const char* what) {
  return issue(g, what, one(&Traffic::all_gather, static_cast<int64_t>(in.nbytes())),
               [&] { return g.backend->_allgather_base(out, in); });
}

c10::intrusive_ptr<c10d::Work> Runtime::all_to_all_async(Group& g, at::Tensor out, at::Tensor in,
                                                         std::vector<int64_t> out_splits, std::vector<int64_t> in_splits,
                                                         const char* what) {
  return issue(g, what, one(&Traffic::all_to_all, static_cast<int64_t>(in.nbytes())),
               [&] { return g.backend->alltoall_base(out, in, out_splits, in_splits); });
}

c10::intrusive_ptr<c10d::Work> Runtime::p2p_async(Group& g, std::vector<P2POp> ops, const char* what) {
  Traffic add;
  for (const auto& op : ops)
    if (op.send) ++add.sends, add.bytes += static_cast<int64_t>(op.tensor.nbytes());
  return coalesced(g, std::move(ops), what, add);
}

c10::intrusive_ptr<c10d::Work> Runtime::coalesced(Group& g, std::vector<P2POp> ops, const char* what, const Traffic& add) {
  if (opts_.nccl_p2p_rules && !g.nccl && !g.nccl_rules)  // this communicator's "stream", made at its first transfer
    g.nccl_rules = std::make_shared<NcclRulesP2P>(g.backend, opts_.timeout);
  return issue(g, what, add, [&]() -> c10::intrusive_ptr<c10d::Work> {
    // Gloo's send and recv move host memory only: they hand the tensor's pointer
    // to the transport as it is, so a CUDA tensor travels through a host copy,
    // and a received one lands on the device when the transfer is waited for.
    std::vector<std::pair<at::Tensor, at::Tensor>> landing;  // (device tensor, its host copy)
    if (!g.nccl)
      for (auto& op : ops) {
        if (!op.tensor.is_cuda()) continue;
        auto host = op.send ? op.tensor.to(at::kCPU) : at::empty(op.tensor.sizes(), op.tensor.options().device(at::kCPU));
        if (!op.send) landing.emplace_back(op.tensor, host);
        op.tensor = host;
      }
    auto w = post_p2p(g, std::move(ops));
    if (landing.empty()) return w;
    return c10::make_intrusive<HostLanding>(std::move(w), std::move(landing));
  });
}

c10::intrusive_ptr<c10d::Work> Runtime::post_p2p(Group& g, std::vector<P2POp> ops) {
  if (g.nccl_rules) return g.nccl_rules->post(std::move(ops));
  if (g.nccl || g.backend->supportsCoalescing()) {
    // One NCCL group: c10d gives a coalesced batch the group's own
    // communicator and stream, as batch_isend_irecv does; the tag is ignored.
    g.backend->startCoalescing();
    for (auto& op : ops) {
      std::vector<at::Tensor> v{op.tensor};
      if (op.send) g.backend->send(v, op.peer, 0);
      else g.backend->recv(v, op.peer, 0);
    }
    return g.backend->endCoalescing();
  }
  // Gloo: issued together, one tag, so the pairing is by order as on NCCL.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto& op : ops) {
    TORCH_CHECK(!op.tensor.is_cuda(), "Gloo point-to-point with a CUDA tensor (coalesced() stages them on the host)");
    std::vector<at::Tensor> v{op.tensor};
    works.push_back(op.send ? g.backend->send(v, op.peer, 0) : g.backend->recv(v, op.peer, 0));
  }
  return c10::intrusive_ptr<c10d::Work>(c10::make_intrusive<WorkList>(std::move(works)));
}

c10::intrusive_ptr<c10d::Work> Runtime::ring_shift_async(Group& g, at::Tensor send, at::Tensor recv, const char* what) {
  const int next = (g.rank + 1) % g.size(), prev = (g.rank + g.size() - 1) % g.size();
  const auto add = one(&Traffic::send_recv, static_cast<int64_t>(send.nbytes()));
  return coalesced(g, {{true, std::move(send), next}, {false, std::move(recv), prev}}, what, add);
}

void Runtime::all_reduce(Group& g, at::Tensor t, const char* what) {
  if (g.size() < 2) return;
  wait(all_reduce_async(g, std::move(t), what), g, what);
}

void Runtime::all_reduce_max(Group& g, at::Tensor t, const char* what) {
  if (g.size() < 2) return;
  const auto add = one(&Traffic::all_reduce, static_cast<int64_t>(t.nbytes()));
  std::vector<at::Tensor> v{std::move(t)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  wait(issue(g, what, add, [&] { return g.backend->allreduce(v, o); }), g, what);
}

void Runtime::barrier(const char* what) {
  if (control.size() < 2) return;
  auto t = torch::zeros({1}, torch::kInt32);
  all_reduce(control, t, what);
}

bool Runtime::any(bool flag, const char* what) {
  std::vector<int64_t> v{flag ? 1 : 0};
  host_max(v, what);
  return v[0] != 0;
}

void Runtime::host_max(std::vector<int64_t>& values, const char* what) {
  if (control.size() < 2 || values.empty()) return;
  auto t = torch::tensor(values, torch::kInt64);
  all_reduce_max(control, t, what);
  const auto* p = t.data_ptr<int64_t>();
  values.assign(p, p + values.size());
}

}  // namespace nnstrain::dist
