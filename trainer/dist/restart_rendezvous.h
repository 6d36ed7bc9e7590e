// How the launchers of a multi-node `nnstrain launch --max-restarts N` agree on
// each restart. No LibTorch: the launchers talk over their own TCP connections,
// never through the workers' store or a collective.
//
// Node 0's launcher listens on --master-port (the rendezvous) and every other
// node's launcher connects to it and joins. Then, per attempt k = 0, 1, ...:
//   node 0 -> all:  start k PORT FAILED_AT_MS CAUSE   (the workers' store port of attempt k)
//   all -> node 0:  ended k ok | stopped | failed RANK STEP MS STATUS WHAT | signal STATUS
//   node 0 -> all:  stop k      (once, as soon as any node's worker failed)
// When every node has said `ended k`, node 0 decides alone (the cause is the
// earliest failure by wall clock; the deterministic check is its step against
// the last restart's) and sends `start k+1 ...` or `end STATUS MESSAGE`, and
// every launcher logs the same line. A node reports `ended` only after all its
// workers are reaped, and the workers of attempt k+1 rendezvous on a fresh port:
// no worker of attempt k can meet one of attempt k+1.
// Lines of tab-separated fields, newline-terminated, at most kMaxLineBytes.
//
// What may reach --master-port is not trusted: node 0 drops (and goes on
// waiting) a connection that sends a malformed or overlong line, says nothing
// within kJoinLineS, or joins with another job's token (`join NODE NNODES NPROC
// MAX_RESTARTS TOKEN`, the token the same on every node of a job: launch_token()).
// Only a join with this job's token that disagrees (a node rank taken twice,
// other options) ends the launch. Every connection has SO_KEEPALIVE, so a node
// that vanished (power, network) is noticed within about 90 s; a node waiting
// for node 0's first start gives up at the join deadline.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace nnstrain::dist {

// How one node's workers of an attempt ended.
struct NodeEnd {
  // kStopped: killed at node 0's request, for another node's failure.
  enum Kind { kOk, kFailed, kStopped, kSignalled, kLost };
  Kind kind = kOk;
  int node = 0;
  int rank = -1;            // kFailed: the node's first failed worker
  int64_t step = 0;         // its step (progress board), 0 before training
  int64_t failed_at_ms = 0; // wall clock of that failure
  int status = 0;           // the exit status it stands for (128+signal when killed)
  std::string what;         // "was killed by signal 9 (SIGKILL)"; kLost: why
};

// What every launcher does next.
struct Verdict {
  bool restart = false;
  int attempt = 0;           // restart: the attempt to start
  int port = 0;              // restart: the workers' store port
  int64_t failed_at_ms = 0;  // restart: of the failure that caused it
  std::string cause;         // restart: "rank 1 was killed by signal 9 (SIGKILL) at step 4"
  int status = 0;            // end: the launcher's exit status
  std::string message;       // logged by every launcher (empty: a clean end)
};

// The longest line either side accepts, and how long node 0 waits for a new
// connection's join line before dropping it.
constexpr size_t kMaxLineBytes = 4096;
constexpr double kJoinLineS = 10;

// The job's token, the same on every node: NNSTRAIN_LAUNCH_TOKEN when set, else
// the scheduler's job id (SLURM_JOB_ID, PBS_JOBID), else a hash of `command`
// (the workers' command line, which every node runs alike). Never a tab or newline.
std::string launch_token(const std::vector<std::string>& command);

class RestartRendezvous {
 public:
  // Node 0: takes `listen_fd` (bound to --master-port) and waits for the other
  // nnodes-1 launchers to join, each with the same nnodes, nproc and max_restarts.
  // Node R > 0: connects to addr:port, retrying, and joins. Either gives up after
  // `timeout_s`, or when a byte arrives on `signal_fd` (the launcher was
  // signalled); throws std::runtime_error with one line naming the node.
  // `token`: launch_token(); a join with another is dropped, not obeyed.
  // `dropped` (node 0, optional): how many connections were dropped.
  static RestartRendezvous host(int listen_fd, int nnodes, int nproc, int max_restarts, double timeout_s,
                                int signal_fd, const std::string& token, int* dropped = nullptr);
  static RestartRendezvous join(const std::string& addr, int port, int node, int nnodes, int nproc,
                                int max_restarts, double timeout_s, int signal_fd, const std::string& token);
  RestartRendezvous(RestartRendezvous&& o) noexcept { *this = std::move(o); }
  RestartRendezvous& operator=(RestartRendezvous&& o) noexcept;
  ~RestartRendezvous();

  bool hosts() const { return node_ == 0; }

  // Descriptors to poll while this node's workers run.
  std::vector<int> fds() const;
  // Reads what arrived on `fd`. True when this node's workers must stop:
  // another node's worker failed (node 0: a failure report or a node gone;
  // others: `stop`, or node 0's launcher gone).
  bool on_readable(int fd);
  // Node 0: asks every other node to stop its workers of `attempt` (once).
  void stop_all(int attempt);

  // Node 0: tells every node to start `attempt` with the workers' store at `port`.
  void announce(const Verdict& v);
  // Node 0: collects every node's end of `attempt` (its own is `mine`); waits
  // `stop_wait_s` at most for the others once a stop was sent. Returns them by node.
  std::vector<NodeEnd> collect(int attempt, const NodeEnd& mine, double stop_wait_s, int signal_fd);
  // Node 0: tells every node the run is over.
  void finish(const Verdict& v);
  // Node R > 0: reports its end of `attempt` (attempt -1: none yet) and waits
  // for node 0's verdict (a start or the end); for the first start no longer
  // than join()'s timeout.
  Verdict report_and_wait(int attempt, const NodeEnd& mine, int signal_fd);

 private:
  struct Peer {
    int fd = -1;
    int node = 0;
    std::string in;      // bytes read, not yet a whole line
    bool ended = false;  // node 0: its `ended` of this attempt arrived
    NodeEnd end;
  };
  RestartRendezvous() = default;
  void send_all(const std::string& line);
  void lost(Peer& p, const std::string& why);
  static bool take_line(Peer& p, std::string& line);
  int node_ = 0;
  int nnodes_ = 1;
  int64_t join_deadline_ms_ = 0;  // node R: steady-clock ms by which node 0's first start must come
  std::vector<Peer> peers_;  // node 0: one per other node; else the one to node 0
  bool stop_sent_ = false;
  int attempt_ = 0;
};

}  // namespace nnstrain::dist
