#include "trainer/dist/restart_rendezvous.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>

namespace nnstrain::dist {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> split(const std::string& line) {
  std::vector<std::string> f;
  size_t start = 0;
  for (size_t tab; (tab = line.find('\t', start)) != std::string::npos; start = tab + 1)
    f.push_back(line.substr(start, tab - start));
  f.push_back(line.substr(start));
  return f;
}

// Fields never hold a tab or a newline (they are ours, or describe_end's words).
std::string clean(std::string s) {
  for (char& c : s)
    if (c == '\t' || c == '\n') c = ' ';
  return s;
}

int64_t to_int(const std::string& s) {
  try {
    size_t used = 0;
    long long v = std::stoll(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  throw std::runtime_error("bad field '" + s + "' from another launcher (a different nnstrain version?)");
}

// Whole line or nothing: a short write would leave the peer a broken line.
bool send_line(int fd, const std::string& line) {
  const std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, 1000);
    } else {
      return false;  // the peer is gone: its EOF is noticed on the read side
    }
  }
  return true;
}

// A peer that vanished (power, network, a frozen host) never closes its
// connection: keepalive probes find it within about 30 + 6 x 10 s.
void keep_alive(int fd) {
  int one = 1, idle = 30, interval = 10, count = 6;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
#ifdef TCP_KEEPIDLE
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
#else
  (void)idle, (void)interval, (void)count;
#endif
}

int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

int connect_to(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd >= 0) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    keep_alive(fd);
  }
  return fd;
}

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<long long>(0, left));
}

// A signal the launcher got while it waits here (its handler writes the number
// into signal_fd); SIGCHLD only says a worker ended, which the caller knows.
int pending_signal(int signal_fd) {
  unsigned char sigs[64];
  ssize_t k;
  int got = 0;
  while ((k = read(signal_fd, sigs, sizeof sigs)) > 0)
    for (ssize_t i = 0; i < k; ++i)
      // SIGUSR1/SIGUSR2 are requests to workers, which run none here.
      if (sigs[i] != SIGCHLD && sigs[i] != SIGUSR1 && sigs[i] != SIGUSR2) got = sigs[i];
  return got;
}

std::string ended_line(int attempt, const NodeEnd& e) {
  std::string s = "ended\t" + std::to_string(attempt) + "\t";
  switch (e.kind) {
    case NodeEnd::kOk: return s + "ok";
    case NodeEnd::kStopped: return s + "stopped";
    case NodeEnd::kSignalled: return s + "signal\t" + std::to_string(e.status);
    default:
      return s + "failed\t" + std::to_string(e.rank) + "\t" + std::to_string(e.step) + "\t" +
             std::to_string(e.failed_at_ms) + "\t" + std::to_string(e.status) + "\t" + clean(e.what);
  }
}

}  // namespace

std::string launch_token(const std::vector<std::string>& command) {
  for (const char* var : {"NNSTRAIN_LAUNCH_TOKEN", "SLURM_JOB_ID", "PBS_JOBID"})
    if (const char* v = std::getenv(var); v && *v) return clean(var + std::string("=") + v);
  // FNV-1a over the command: the same words on every node, another job's differ.
  uint64_t h = 1469598103934665603ULL;
  for (const auto& a : command) {
    for (unsigned char c : a) h = (h ^ c) * 1099511628211ULL;
    h = (h ^ 0) * 1099511628211ULL;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "command=%016llx", static_cast<unsigned long long>(h));
  return buf;
}

RestartRendezvous& RestartRendezvous::operator=(RestartRendezvous&& o) noexcept {
  std::swap(node_, o.node_);
  std::swap(nnodes_, o.nnodes_);
  std::swap(peers_, o.peers_);
  std::swap(stop_sent_, o.stop_sent_);
  std::swap(attempt_, o.attempt_);
  std::swap(join_deadline_ms_, o.join_deadline_ms_);
  return *this;
}

RestartRendezvous::~RestartRendezvous() {
  for (auto& p : peers_)
    if (p.fd >= 0) close(p.fd);
}

bool RestartRendezvous::take_line(Peer& p, std::string& line) {
  size_t nl = p.in.find('\n');
  if (nl == std::string::npos) return false;
  line = p.in.substr(0, nl);
  p.in.erase(0, nl + 1);
  return true;
}

// Reads what is there; false at EOF (or a reset connection).
static bool fill(int fd, std::string& in) {
  char chunk[4096];
  while (true) {
    ssize_t n = read(fd, chunk, sizeof chunk);
    if (n > 0) {
      in.append(chunk, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else {
      return false;
    }
  }
}

RestartRendezvous RestartRendezvous::host(int listen_fd, int nnodes, int nproc, int max_restarts, double timeout_s,
                                          int signal_fd, const std::string& token, int* dropped) {
  RestartRendezvous r;
  r.node_ = 0;
  r.nnodes_ = nnodes;
  const std::string want = std::to_string(nnodes) + "\t" + std::to_string(nproc) + "\t" + std::to_string(max_restarts);
  struct Pending {
    Peer peer;
    Clock::time_point until;  // its join line must have come by then
  };
  std::vector<Pending> pending;  // connected, not joined yet
  std::vector<bool> joined(nnodes, false);
  joined[0] = true;
  int missing = nnodes - 1, drops = 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  const auto per_line = std::chrono::milliseconds(static_cast<int64_t>(std::min(kJoinLineS, timeout_s) * 1000));
  auto close_all = [&] {
    for (auto& q : pending)
      if (q.peer.fd >= 0) close(q.peer.fd);
    close(listen_fd);
  };
  // A launcher of this job that disagrees: the launch cannot go on.
  auto refuse = [&](Peer& p, const std::string& why) {
    send_line(p.fd, "end\t2\t" + why);
    close_all();
    throw std::runtime_error(why);
  };
  // Not a launcher of this job (a port scanner, a stray client, another job's
  // launcher): dropped, told why if it speaks the protocol; the wait goes on.
  auto drop = [&](Peer& p, const std::string& why) {
    if (!why.empty()) send_line(p.fd, "end\t2\t" + why);
    close(p.fd);
    p.fd = -1;
    ++drops;
  };
  while (missing > 0) {
    const auto now = Clock::now();
    for (auto& q : pending)
      if (q.peer.fd >= 0 && now >= q.until) drop(q.peer, "");  // silent: nothing to tell
    pending.erase(std::remove_if(pending.begin(), pending.end(), [](const Pending& q) { return q.peer.fd < 0; }),
                  pending.end());
    auto wake = deadline;
    for (auto& q : pending) wake = std::min(wake, q.until);
    std::vector<pollfd> fds = {{listen_fd, POLLIN, 0}, {signal_fd, POLLIN, 0}};
    for (auto& q : pending) fds.push_back({q.peer.fd, POLLIN, 0});
    int n = poll(fds.data(), fds.size(), ms_left(wake) + (wake < deadline ? 1 : 0));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && Clock::now() >= deadline) {
      std::string who;
      for (int i = 1; i < nnodes; ++i)
        if (!joined[i]) who += (who.empty() ? "" : ", ") + std::to_string(i);
      close_all();
      throw std::runtime_error("node 0: the launchers of node(s) " + who + " did not join within " +
                               std::to_string(static_cast<int>(timeout_s)) +
                               " s (started with the same --master-addr, --master-port and job token?" +
                               (drops ? " " + std::to_string(drops) + " other connection(s) were dropped" : "") + ")");
    }
    if (n <= 0) continue;
    if (fds[1].revents && pending_signal(signal_fd)) {
      close_all();
      throw std::runtime_error("node 0: interrupted by a signal while the other launchers joined");
    }
    if (fds[0].revents) {
      int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        keep_alive(fd);
        pending.push_back({Peer{fd, -1, "", false, {}}, Clock::now() + per_line});
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Peer& p = pending[i - 2].peer;
      const bool open = fill(p.fd, p.in);
      std::string line;
      if (!take_line(p, line)) {
        if (!open || p.in.size() > kMaxLineBytes) drop(p, "");
        continue;
      }
      if (line.size() > kMaxLineBytes) {
        drop(p, "");
        continue;
      }
      auto f = split(line);
      if (f.empty() || f[0] != "join") {
        drop(p, "");
        continue;
      }
      if (f.size() != 6) {
        drop(p, "node 0: a join without this job's token (another nnstrain version?)");
        continue;
      }
      if (f[5] != token) {
        drop(p, "node 0: this launch belongs to another job (its token differs: set the same NNSTRAIN_LAUNCH_TOKEN, "
                "or run every node in one job)");
        continue;
      }
      int node = -1;
      try {
        node = static_cast<int>(to_int(f[1]));
        to_int(f[2]), to_int(f[3]), to_int(f[4]);
      } catch (const std::exception&) {
        drop(p, "node 0: a malformed join");
        continue;
      }
      const std::string theirs = f[2] + "\t" + f[3] + "\t" + f[4];
      if (node < 1 || node >= nnodes || joined[node])
        refuse(p, "node 0: a launcher joined as node " + f[1] + ", which is " +
                      (node < 1 || node >= nnodes ? "not a node of this launch" : "taken already") +
                      " (each node needs its own --node-rank)");
      if (theirs != want)
        refuse(p, "node 0: the launcher of node " + f[1] + " was started with --nnodes " + f[2] +
                      " --nproc-per-node " + f[3] + " --max-restarts " + f[4] + ", this one with --nnodes " +
                      std::to_string(nnodes) + " --nproc-per-node " + std::to_string(nproc) +
                      " --max-restarts " + std::to_string(max_restarts) + ": every node needs the same");
      p.node = node;
      joined[node] = true;
      --missing;
      r.peers_.push_back(std::move(p));
      p.fd = -1;
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(), [](const Pending& q) { return q.peer.fd < 0; }),
                  pending.end());
  }
  if (dropped) *dropped = drops;
  close_all();  // nobody else joins: the port is free again
  return r;
}

RestartRendezvous RestartRendezvous::join(const std::string& addr, int port, int node, int nnodes, int nproc,
                                          int max_restarts, double timeout_s, int signal_fd, const std::string& token) {
  RestartRendezvous r;
  r.node_ = node;
  r.nnodes_ = nnodes;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  // Node 0 starts the run once every node has joined, within its own join timeout
  // (counted from its start, which may come later than ours: a margin).
  const auto timeout_ms = static_cast<int64_t>(timeout_s * 1000);
  r.join_deadline_ms_ = steady_ms() + timeout_ms + std::min<int64_t>(timeout_ms, 30000);
  int fd;
  while ((fd = connect_to(addr, port)) < 0) {
    if (Clock::now() >= deadline)
      throw std::runtime_error("node " + std::to_string(node) + ": cannot reach node 0's launcher at " + addr + ":" +
                               std::to_string(port) + " within " + std::to_string(static_cast<int>(timeout_s)) +
                               " s (is it running, with the same --master-port?)");
    pollfd p{signal_fd, POLLIN, 0};
    if (poll(&p, 1, std::min(200, ms_left(deadline))) > 0 && pending_signal(signal_fd))
      throw std::runtime_error("node " + std::to_string(node) + ": interrupted by a signal while joining node 0");
  }
  r.peers_.push_back(Peer{fd, 0, "", false, {}});
  send_line(fd, "join\t" + std::to_string(node) + "\t" + std::to_string(nnodes) + "\t" + std::to_string(nproc) +
                    "\t" + std::to_string(max_restarts) + "\t" + clean(token));
  return r;
}

std::vector<int> RestartRendezvous::fds() const {
  std::vector<int> out;
  for (auto& p : peers_)
    if (p.fd >= 0 && !p.ended) out.push_back(p.fd);
  return out;
}

void RestartRendezvous::lost(Peer& p, const std::string& why) {
  close(p.fd);
  p.fd = -1;
  p.ended = true;
  p.end = NodeEnd{};
  p.end.kind = NodeEnd::kLost;
  p.end.node = p.node;
  p.end.status = 1;
  p.end.what = why;
}

bool RestartRendezvous::on_readable(int fd) {
  for (auto& p : peers_) {
    if (p.fd != fd) continue;
    const bool open = fill(p.fd, p.in);
    bool stop = false;
    std::string line;
    if (hosts()) {
      try {
        while (!p.ended && take_line(p, line)) {
          auto f = split(line);
          if (f.size() < 3 || f[0] != "ended" || to_int(f[1]) != attempt_) continue;
          NodeEnd e;
          e.node = p.node;
          if (f[2] == "ok") {
            e.kind = NodeEnd::kOk;
          } else if (f[2] == "stopped") {
            e.kind = NodeEnd::kStopped;
          } else if (f[2] == "signal" && f.size() == 4) {
            e.kind = NodeEnd::kSignalled;
            e.status = static_cast<int>(to_int(f[3]));
          } else if (f[2] == "failed" && f.size() == 8) {
            e.kind = NodeEnd::kFailed;
            e.rank = static_cast<int>(to_int(f[3]));
            e.step = to_int(f[4]);
            e.failed_at_ms = to_int(f[5]);
            e.status = static_cast<int>(to_int(f[6]));
            e.what = f[7];
          } else {
            continue;
          }
          p.ended = true;
          p.end = e;
          stop = e.kind != NodeEnd::kOk && e.kind != NodeEnd::kStopped;
        }
      } catch (const std::runtime_error& e) {
        lost(p, "the launcher of node " + std::to_string(p.node) + " sent a malformed line: " + e.what());
        return true;
      }
      if (!p.ended && p.in.size() > kMaxLineBytes) {
        lost(p, "the launcher of node " + std::to_string(p.node) + " sent a line longer than " +
                    std::to_string(kMaxLineBytes) + " bytes");
        return true;
      }
      if (!p.ended && !open)
        lost(p, "the launcher of node " + std::to_string(p.node) + " is gone (its connection closed)");
      return stop || p.end.kind == NodeEnd::kLost;
    }
    // Another node: only `stop` matters while the workers run; a verdict waits in the buffer.
    while (p.in.rfind("stop\t", 0) == 0 && take_line(p, line)) stop = true;
    if (p.in.size() > kMaxLineBytes && p.in.find('\n') == std::string::npos)
      throw std::runtime_error("node " + std::to_string(node_) + ": node 0's launcher sent a line longer than " +
                               std::to_string(kMaxLineBytes) + " bytes");
    if (!open)
      throw std::runtime_error("node " + std::to_string(node_) +
                               ": node 0's launcher is gone (its connection closed); stopping this node's workers");
    return stop;
  }
  return false;
}

void RestartRendezvous::send_all(const std::string& line) {
  for (auto& p : peers_)
    if (p.fd >= 0) send_line(p.fd, line);
}

void RestartRendezvous::stop_all(int attempt) {
  if (!hosts() || stop_sent_) return;
  stop_sent_ = true;
  send_all("stop\t" + std::to_string(attempt));
}

void RestartRendezvous::announce(const Verdict& v) {
  attempt_ = v.attempt;
  stop_sent_ = false;
  for (auto& p : peers_) p.ended = false;
  send_all("start\t" + std::to_string(v.attempt) + "\t" + std::to_string(v.port) + "\t" +
           std::to_string(v.failed_at_ms) + "\t" + clean(v.cause));
}

void RestartRendezvous::finish(const Verdict& v) {
  send_all("end\t" + std::to_string(v.status) + "\t" + clean(v.message));
}

std::vector<NodeEnd> RestartRendezvous::collect(int attempt, const NodeEnd& mine, double stop_wait_s,
                                                int signal_fd) {
  NodeEnd self = mine;
  self.node = 0;
  if (self.kind != NodeEnd::kOk) stop_all(attempt);
  std::optional<Clock::time_point> deadline;
  while (true) {
    if (stop_sent_ && !deadline)
      deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(stop_wait_s * 1000));
    std::vector<pollfd> fds = {{signal_fd, POLLIN, 0}};
    for (int fd : this->fds()) fds.push_back({fd, POLLIN, 0});
    if (fds.size() == 1) break;
    int n = poll(fds.data(), fds.size(), deadline ? ms_left(*deadline) : -1);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {  // a node that does not answer after the stop is taken as lost
      for (auto& p : peers_)
        if (!p.ended)
          lost(p, "the launcher of node " + std::to_string(p.node) + " did not report within " +
                      std::to_string(static_cast<int>(stop_wait_s)) + " s of the stop");
      break;
    }
    if (fds[0].revents) {
      if (int sig = pending_signal(signal_fd)) {
        self.kind = NodeEnd::kSignalled;
        self.status = 128 + sig;
        stop_all(attempt);
      }
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents && on_readable(fds[i].fd)) stop_all(attempt);
  }
  std::vector<NodeEnd> all = {self};
  for (auto& p : peers_) all.push_back(p.end);
  return all;
}

Verdict RestartRendezvous::report_and_wait(int attempt, const NodeEnd& mine, int signal_fd) {
  Peer& p = peers_.at(0);
  if (attempt >= 0) send_line(p.fd, ended_line(attempt, mine));
  const std::string me = "node " + std::to_string(node_);
  while (true) {
    std::string line;
    while (take_line(p, line)) {
      auto f = split(line);
      Verdict v;
      if (f.size() == 5 && f[0] == "start") {
        v.restart = true;
        v.attempt = static_cast<int>(to_int(f[1]));
        v.port = static_cast<int>(to_int(f[2]));
        v.failed_at_ms = to_int(f[3]);
        v.cause = f[4];
        return v;
      }
      if (f.size() == 3 && f[0] == "end") {
        v.status = static_cast<int>(to_int(f[1]));
        v.message = f[2];
        return v;
      }
      // `stop` of an attempt this node has ended already: nothing to do
    }
    if (p.in.size() > kMaxLineBytes && p.in.find('\n') == std::string::npos)
      throw std::runtime_error(me + ": what answers at node 0's address sent a line longer than " +
                               std::to_string(kMaxLineBytes) + " bytes (not an nnstrain launcher?)");
    // The first start comes once every node has joined, within node 0's join
    // timeout; later verdicts may wait for a long training attempt, and
    // keepalive notices a node 0 that vanished meanwhile.
    const int64_t left = join_deadline_ms_ - steady_ms();
    if (attempt < 0 && left <= 0)
      throw std::runtime_error(me + ": node 0's launcher accepted the join but did not start the run in time "
                                    "(is --master-port node 0's launcher?)");
    pollfd fds[2] = {{p.fd, POLLIN, 0}, {signal_fd, POLLIN, 0}};
    int n = poll(fds, 2, attempt < 0 ? static_cast<int>(std::min<int64_t>(left, INT32_MAX)) : -1);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) continue;
    if (fds[1].revents) {
      if (int sig = pending_signal(signal_fd)) {
        if (attempt < 0) throw std::runtime_error(me + ": interrupted by a signal while waiting for node 0's launcher");
        // Node 0 learns of it from the connection closing.
        Verdict v;
        v.status = 128 + sig;
        return v;
      }
    }
    if (fds[0].revents && !fill(p.fd, p.in) && p.in.find('\n') == std::string::npos)
      throw std::runtime_error(me + ": node 0's launcher is gone (its connection closed)");
  }
}

}  // namespace nnstrain::dist
