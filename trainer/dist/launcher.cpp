#include "trainer/dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <stdexcept>

#include "trainer/dist/progress_board.h"
#include "trainer/dist/rendezvous_socket.h"
#include "trainer/dist/restart_rendezvous.h"

extern char** environ;

namespace nnstrain::dist {

namespace {

constexpr const char* kUsage =
    R"(usage: nnstrain launch --nproc-per-node N [--nnodes M --node-rank R
                       --master-addr HOST --master-port PORT] [--max-restarts N]
                       [--exec] -- ARGS...

Starts N worker processes on this node, as torchrun does, each running
`nnstrain ARGS...` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (and
OMP_NUM_THREADS=1 unless it is set). Every line a worker prints is echoed as
"[rank N] line". When a worker fails, the others get SIGTERM, then SIGKILL 5 s
later. SIGINT, SIGTERM and SIGHUP are passed on to the workers and end the
launch; SIGUSR1 (save and stop) and SIGUSR2 (write the flight records) are
passed on and the launch goes on.

  --nproc-per-node N   workers on this node (one per GPU)
  --nnodes M           nodes in the job (default 1): run one launcher per node
  --node-rank R        this node's index, 0..M-1 (needed when M > 1)
  --master-addr HOST   host of rank 0 (default 127.0.0.1; needed when M > 1)
  --master-port PORT   rank 0's rendezvous port (default: a free one; needed when M > 1).
                       On node 0 the launcher holds it until rank 0 serves it;
                       one in use is an error (status 2)
  --max-restarts N     when a worker fails, stop the others and start them all
                       again (NNSTRAIN_RESTART_COUNT set: from the latest
                       complete checkpoint under checkpoint.save_dir, else from
                       where the run started), up to N times (default 0); a
                       failure at the same step as the one before is
                       deterministic and ends the launch. With several nodes the
                       launchers agree on each restart through node 0's
                       launcher, listening on --master-port (joins carry
                       NNSTRAIN_LAUNCH_TOKEN, or the job's id); the workers get
                       a fresh port per attempt
  --exec               ARGS[0] is any program, not an nnstrain subcommand
                       (torchrun's --no-python; also accepted)
)";

// Several nodes: how long node 0 waits for the other launchers to join, and,
// once it has asked them to stop, for each to report its workers ended.
constexpr double kJoinTimeoutS = 600;
constexpr double kStopWaitS = 60;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Config {
  int nproc = 0;
  int nnodes = 1;
  std::optional<int> node_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  int max_restarts = 0;
  bool exec = false;
  bool help = false;
  std::vector<std::string> command;
};

int parse_int(const std::string& flag, const std::string& value, int min, int max) {
  long long v = 0;
  bool ok = !value.empty() && value.size() <= 9;
  for (char c : value) ok = ok && c >= '0' && c <= '9';
  if (ok) v = std::stoll(value);
  if (!ok || v < min || v > max)
    throw UsageError(flag + " '" + value + "' is not a whole number from " + std::to_string(min) + " to " +
                     std::to_string(max));
  return static_cast<int>(v);
}

Config parse(const std::vector<std::string>& args) {
  Config c;
  bool have_nproc = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      c.command.assign(args.begin() + i + 1, args.end());
      break;
    }
    if (a == "-h" || a == "--help") {
      c.help = true;
      return c;
    }
    if (a.rfind("--", 0) != 0) {  // the first positional starts the command, as torchrun's script does
      c.command.assign(args.begin() + i, args.end());
      break;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
      has_value = true;
    }
    for (char& ch : name)
      if (ch == '_') ch = '-';  // torchrun spells them both ways
    const std::string flag = "--" + name;
    if (name == "exec" || name == "no-python") {
      if (has_value) throw UsageError(flag + " takes no value");
      c.exec = true;
      continue;
    }
    static const std::set<std::string> valued = {"nproc-per-node", "nnodes", "node-rank", "master-addr",
                                                 "master-port", "max-restarts"};
    if (!valued.count(name))
      throw UsageError("unknown option '" + a + "' (launcher options go before '--', the command after it)");
    if (!has_value) {
      if (i + 1 >= args.size()) throw UsageError(flag + " needs a value");
      value = args[++i];
    }
    if (name == "nproc-per-node") {
      c.nproc = parse_int(flag, value, 1, 4096);
      have_nproc = true;
    } else if (name == "nnodes") {
      c.nnodes = parse_int(flag, value, 1, 1 << 20);
    } else if (name == "node-rank") {
      c.node_rank = parse_int(flag, value, 0, 1 << 20);
    } else if (name == "max-restarts") {
      c.max_restarts = parse_int(flag, value, 0, 1000000);
    } else if (name == "master-addr") {
      if (value.empty()) throw UsageError("--master-addr is empty");
      c.master_addr = value;
    } else {
      c.master_port = parse_int(flag, value, 1, 65535);
    }
  }
  if (!have_nproc) throw UsageError("--nproc-per-node is required");
  if (c.command.empty()) throw UsageError("nothing to run: put the command after '--'");
  if (c.nnodes > 1) {
    std::string missing;
    if (!c.node_rank) missing += " --node-rank";
    if (!c.master_addr) missing += " --master-addr";
    if (!c.master_port) missing += " --master-port";
    if (!missing.empty())
      throw UsageError("--nnodes " + std::to_string(c.nnodes) + " needs" + missing +
                       " (every node's launcher must agree on where rank 0 listens)");
  }
  if (c.node_rank.value_or(0) >= c.nnodes)
    throw UsageError("--node-rank " + std::to_string(*c.node_rank) + " is not below --nnodes " +
                     std::to_string(c.nnodes));
  if (static_cast<long long>(c.nproc) * c.nnodes > INT_MAX) throw UsageError("too many workers");
  return c;
}

// A port that is in use on this machine, or cannot be bound: the launch stops
// with this one line and status 2 before any worker starts.
struct PortError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The rendezvous port, held from the launcher's choice until rank 0's TCPStore
// takes the socket over (TCPStoreOptions::masterListenFd), so that no other
// process can bind it in between. (Finding a free port, closing it and letting
// rank 0 bind it again, as torchrun does, lets another process, such as a
// second launch, take the port while rank 0 loads LibTorch.) Without
// --master-port the kernel picks a free port (port 0).
struct Reserved {
  int fd = -1;
  int port = 0;
};

Reserved reserve_port(const std::optional<int>& named) {
  auto [fd, port] = listen_on(named.value_or(0));
  if (fd >= 0) return {fd, port};
  const int err = errno;
  if (!named) throw std::runtime_error(std::string("cannot find a free port: ") + std::strerror(err));
  if (err == EADDRINUSE)
    throw PortError("--master-port " + std::to_string(*named) +
                    " is already in use on this machine (another job, or one that has not ended, listens "
                    "on it): choose another port, or leave --master-port out on one node");
  throw PortError("--master-port " + std::to_string(*named) + " cannot be bound: " + std::strerror(err));
}

void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, -1);
    } else {
      return;  // the reader went away (EPIPE): drop the output, keep supervising
    }
  }
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    default: return "";
  }
}

std::string describe_end(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    std::string name = signal_name(sig);
    std::string s = "was killed by signal " + std::to_string(sig) + (name.empty() ? "" : " (" + name + ")");
#ifdef WCOREDUMP
    if (WCOREDUMP(status)) s += ", core dumped";
#endif
    return s;
  }
  return "ended with wait status " + std::to_string(status);
}

bool failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

// ------------------------------------------------------------------ signals

// The handler only writes the signal number into a pipe that the poll loop
// watches (the self-pipe trick), so all real work happens outside it.
int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  ssize_t r = write(g_signal_pipe[1], &b, 1);
  (void)r;
  errno = saved;
}

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2};
// Passed on without ending the launch: the workers' own requests (SIGUSR1: save
// and stop, as #SBATCH --signal=USR1@120 sends it; SIGUSR2: flight records).
bool ends_launch(int sig) { return sig != SIGUSR1 && sig != SIGUSR2; }

class SignalScope {
 public:
  SignalScope() {
    if (g_signal_pipe[0] != -1) throw std::runtime_error("nnstrain launch is already running in this process");
    if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig : kForwarded) {
      sigaction(sig, nullptr, &saved_[sig]);
      // A launcher started with a signal ignored (nohup, `cmd &` in a script) keeps ignoring it.
      if (saved_[sig].sa_handler != SIG_IGN) sigaction(sig, &sa, nullptr);
      touched_.push_back(sig);
    }
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, &saved_[SIGCHLD]);
    touched_.push_back(SIGCHLD);
    // A closed reader of our output must not kill the launcher while workers run.
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, &saved_[SIGPIPE]);
    touched_.push_back(SIGPIPE);
  }
  ~SignalScope() {
    for (int sig : touched_) sigaction(sig, &saved_[sig], nullptr);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  // In a forked child before exec: the dispositions the launcher was started with.
  void restore_in_child() const {
    for (int sig : touched_) {
      struct sigaction sa = saved_[sig];
      if (sa.sa_handler != SIG_IGN) {
        sa.sa_handler = SIG_DFL;
        sa.sa_flags = 0;
      }
      sigaction(sig, &sa, nullptr);
    }
  }
  int read_fd() const { return g_signal_pipe[0]; }

 private:
  struct sigaction saved_[NSIG] {};
  std::vector<int> touched_;
};

// ------------------------------------------------------------------ workers

// Longest partial line kept before it is echoed anyway.
constexpr size_t kMaxLine = 1 << 20;

struct Stream {
  int fd = -1;   // read end of the worker's pipe; -1 once closed
  int out = -1;  // where its prefixed lines go
  int rank = 0;
  std::string buf;
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream out, err;
};

// Echoes the complete lines of s.buf (and the rest at EOF), each prefixed,
// in one write, so lines of different workers never interleave.
void emit_lines(Stream& s, bool eof) {
  const std::string prefix = "[rank " + std::to_string(s.rank) + "] ";
  std::string out;
  size_t start = 0;
  for (size_t nl; (nl = s.buf.find('\n', start)) != std::string::npos; start = nl + 1) {
    out += prefix;
    out.append(s.buf, start, nl - start + 1);
  }
  s.buf.erase(0, start);
  if (!s.buf.empty() && (eof || s.buf.size() >= kMaxLine)) {
    out += prefix + s.buf + "\n";
    s.buf.clear();
  }
  if (!out.empty()) write_all(s.out, out);
}

// Reads what is there: one chunk, or everything up to EAGAIN when `drain`.
void pump(Stream& s, bool drain) {
  char chunk[1 << 16];
  while (s.fd >= 0) {
    ssize_t n = read(s.fd, chunk, sizeof chunk);
    if (n > 0) {
      s.buf.append(chunk, static_cast<size_t>(n));
      emit_lines(s, false);
      if (!drain) return;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {  // EOF (or a broken pipe): flush the unterminated tail
      emit_lines(s, true);
      close(s.fd);
      s.fd = -1;
    }
  }
}

void keep_across_exec(int fd, int target) {
  if (fd == target) {
    int flags = fcntl(fd, F_GETFD);
    if (flags >= 0) fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
  } else {
    dup2(fd, target);
  }
}

struct Spawn {
  std::vector<char*> argv, envp;
  bool search_path = false;
  std::string exec_error;  // formatted before fork: the child only writes it
};

[[noreturn]] void exec_child(const Spawn& sp, const SignalScope& signals, const sigset_t& mask, pid_t parent,
                             int in_fd, int out_fd, int err_fd, int listen_fd, int progress_fd) {
  setpgid(0, 0);  // its own group: a signal to -pid reaches whatever the worker starts
#ifdef __linux__
  prctl(PR_SET_PDEATHSIG, SIGTERM);  // the launcher dying (even by SIGKILL) stops the worker
  if (getppid() != parent) _exit(1);
#else
  (void)parent;
#endif
  signals.restore_in_child();
  keep_across_exec(in_fd, 0);
  keep_across_exec(out_fd, 1);
  keep_across_exec(err_fd, 2);
  if (listen_fd >= 0) keep_across_exec(listen_fd, kRendezvousFd);
  if (progress_fd >= 0) keep_across_exec(progress_fd, kProgressFd);
  sigprocmask(SIG_SETMASK, &mask, nullptr);
  if (sp.search_path)
    execvpe(sp.argv[0], sp.argv.data(), sp.envp.data());
  else
    execve(sp.argv[0], sp.argv.data(), sp.envp.data());
  int err = errno;
  ssize_t r = write(2, sp.exec_error.data(), sp.exec_error.size());
  const char* m = std::strerror(err);
  r = write(2, m, std::strlen(m));
  r = write(2, "\n", 1);
  (void)r;
  _exit(127);
}

class Launch {
 public:
  Launch(const Config& c, const std::string& self_exe, const LaunchOptions& o)
      : c_(c), self_exe_(self_exe), o_(o) {}

  ~Launch() {
    for (auto& w : workers_)
      for (Stream* s : {&w.out, &w.err})
        if (s->fd >= 0) close(s->fd);
    end_groups();  // a no-op unless an error cut the run short
    if (devnull_ >= 0) close(devnull_);
    if (listen_fd_ >= 0) close(listen_fd_);
#ifdef __linux__
    if (!was_subreaper_) prctl(PR_SET_CHILD_SUBREAPER, 0);
#endif
  }

  int run() {
    const int node_rank = c_.node_rank.value_or(0);
    const int world = c_.nproc * c_.nnodes;
    const std::string addr = c_.master_addr.value_or("127.0.0.1");
    // Several nodes that restart: --master-port is the launchers' rendezvous
    // (restart_rendezvous.h), and node 0 gives the workers of each attempt a
    // fresh port of their own.
    const bool group = c_.nnodes > 1 && c_.max_restarts > 0;
    // Rank 0 runs here when this is node 0. An nnstrain rank 0 of several gets
    // the port's socket; an --exec program binds the port itself, and one rank
    // alone needs none, so then it is only checked.
    int port = c_.master_port.value_or(0);
    int group_fd = -1;  // node 0 of a group: --master-port, until the other launchers have joined
    if (node_rank == 0) {
      Reserved r = reserve_port(c_.master_port);
      port = r.port;
      if (group)
        group_fd = r.fd;
      else if (c_.exec || world == 1)
        close(r.fd);
      else
        listen_fd_ = r.fd;
    }

    static const std::set<std::string> ours = {"RANK",           "WORLD_SIZE",       "LOCAL_RANK",
                                               "LOCAL_WORLD_SIZE", "GROUP_RANK",       "GROUP_WORLD_SIZE",
                                               "MASTER_ADDR",    "MASTER_PORT",      kRendezvousFdVar,
                                               kProgressFdVar,   "NNSTRAIN_RESTART_COUNT",
                                               "NNSTRAIN_RESTART_CAUSE", "NNSTRAIN_RESTART_FAILED_AT_MS"};
    std::vector<std::string> base;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (!ours.count(kv.substr(0, kv.find('=')))) base.push_back(kv);
    }
    if (!std::getenv("OMP_NUM_THREADS")) base.push_back("OMP_NUM_THREADS=1");  // as torchrun does

    std::vector<std::string> argv = c_.command;
    if (!c_.exec) argv.insert(argv.begin(), self_exe_);

    devnull_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull_ < 0) throw std::runtime_error(std::string("/dev/null: ") + std::strerror(errno));

#ifdef __linux__
    // What a worker starts and leaves behind is re-parented to us rather than to
    // init, so it can be stopped and reaped before the launcher returns.
    int subreaper = 0;
    prctl(PR_GET_CHILD_SUBREAPER, &subreaper);
    was_subreaper_ = subreaper != 0;
    prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
    SignalScope signals;
    // The step each worker runs, read after a failure (restarts only).
    std::optional<ProgressBoard> board;
    if (c_.max_restarts > 0) {
      board.emplace(c_.nproc);
      progress_fd_ = board->fd();
    }
    auto spawn_all = [&](int store_port, const std::vector<std::string>& restart_env) {
      workers_.assign(c_.nproc, Worker{});
      for (int local = 0; local < c_.nproc; ++local) {
        Worker& w = workers_[local];
        w.rank = node_rank * c_.nproc + local;
        std::vector<std::string> env = base;
        env.push_back("RANK=" + std::to_string(w.rank));
        env.push_back("WORLD_SIZE=" + std::to_string(world));
        env.push_back("LOCAL_RANK=" + std::to_string(local));
        env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(c_.nproc));
        env.push_back("GROUP_RANK=" + std::to_string(node_rank));
        env.push_back("GROUP_WORLD_SIZE=" + std::to_string(c_.nnodes));
        env.push_back("MASTER_ADDR=" + addr);
        env.push_back("MASTER_PORT=" + std::to_string(store_port));
        if (board) env.push_back(std::string(kProgressFdVar) + "=" + std::to_string(kProgressFd));
        env.insert(env.end(), restart_env.begin(), restart_env.end());
        const bool takes_socket = w.rank == 0 && listen_fd_ >= 0;
        if (takes_socket) env.push_back(std::string(kRendezvousFdVar) + "=" + std::to_string(kRendezvousFd));
        spawn(w, argv, env, signals, takes_socket ? listen_fd_ : -1);
      }
      // Rank 0 holds the socket now (or has failed, and with it the launch).
      if (listen_fd_ >= 0) close(listen_fd_);
      listen_fd_ = -1;
    };
    // Before attempt k > 0: what a restarted worker is told. The command stays as
    // it is: NNSTRAIN_RESTART_COUNT makes nnstrain continue from the latest
    // checkpoint, or from the command's own source when none was saved yet
    // (train::restart_source).
    auto prepare_restart = [&](const Verdict& v) {
      say(restart_line(v));
      board->clear();
      first_failure_ = nullptr;
      stopped_by_peer_ = false;
      kill_at_.reset();
      groups_ended_ = false;
      return std::vector<std::string>{"NNSTRAIN_RESTART_COUNT=" + std::to_string(v.attempt),
                                      "NNSTRAIN_RESTART_CAUSE=" + v.cause,
                                      "NNSTRAIN_RESTART_FAILED_AT_MS=" + std::to_string(v.failed_at_ms)};
    };
    if (board) board_ = &*board;
    if (group) return run_group(group_fd, addr, port, signals, spawn_all, prepare_restart);

    std::vector<std::string> restart_env;  // what a restarted worker is told (NNSTRAIN_RESTART_*)
    std::optional<int64_t> failed_step;    // the step of the failure before the last restart
    for (int attempt = 0;; ++attempt) {
      spawn_all(port, restart_env);
      const int status = supervise(signals);
      if (status == 0 || got_signal_ || !first_failure_ || c_.max_restarts == 0) return status;

      // A restart, or the end: deterministic, or none left.
      Verdict v = decide(attempt, failed_step, local_end(status));
      if (!v.restart) {
        say(v.message);
        return v.status;
      }
      restart_env = prepare_restart(v);
      // A fresh port per attempt, as with several nodes: a process of the last
      // attempt that still holds the old one (a worker's orphan) or a client of
      // it cannot meet this attempt's store, and the old one may be taken by now.
      if (!c_.exec && world > 1) {
        Reserved r = reserve_port(std::nullopt);
        port = r.port;
        listen_fd_ = r.fd;
      } else if (world > 1) {
        Reserved r = reserve_port(std::nullopt);
        port = r.port;
        close(r.fd);
      }
    }
  }

  // Several nodes under --max-restarts: every launcher runs the same attempts,
  // agreed with node 0's launcher (restart_rendezvous.h). Node 0 decides each
  // verdict from every node's report; every launcher logs it and acts on it.
  template <class SpawnAll, class PrepareRestart>
  int run_group(int group_fd, const std::string& addr, int master_port, const SignalScope& signals,
                SpawnAll& spawn_all, PrepareRestart& prepare_restart) {
    const int node_rank = c_.node_rank.value_or(0);
    // The job's token: a join from another job (or a forged one without it) is dropped.
    const std::string token = launch_token(c_.command);
    int dropped = 0;
    RestartRendezvous link =
        node_rank == 0 ? RestartRendezvous::host(group_fd, c_.nnodes, c_.nproc, c_.max_restarts, kJoinTimeoutS,
                                                 signals.read_fd(), token, &dropped)
                       : RestartRendezvous::join(addr, master_port, node_rank, c_.nnodes, c_.nproc, c_.max_restarts,
                                                 kJoinTimeoutS, signals.read_fd(), token);
    if (dropped > 0)
      say("dropped " + std::to_string(dropped) + " connection(s) to --master-port that were not a launcher of this job");
    link_ = &link;
    Verdict v;  // node 0 starts attempt 0; the others wait for its start
    v.restart = true;
    if (!link.hosts()) v = link.report_and_wait(-1, NodeEnd{}, signals.read_fd());
    std::optional<int64_t> failed_step;  // the step of the failure before the last restart
    std::vector<std::string> restart_env;
    while (v.restart) {
      if (v.attempt > 0) restart_env = prepare_restart(v);
      if (link.hosts()) {
        // A fresh port per attempt: no worker of an earlier attempt can meet this one's store.
        Reserved r = reserve_port(std::nullopt);
        v.port = r.port;
        if (c_.exec)
          close(r.fd);
        else
          listen_fd_ = r.fd;
        link.announce(v);
      }
      attempt_ = v.attempt;
      spawn_all(v.port, restart_env);
      const int status = supervise(signals);
      const NodeEnd mine = local_end(status);
      if (!link.hosts()) {
        v = link.report_and_wait(v.attempt, mine, signals.read_fd());
        continue;
      }
      const std::vector<NodeEnd> ends = link.collect(v.attempt, mine, kStopWaitS, signals.read_fd());
      Verdict next = decide_group(v.attempt, failed_step, ends);
      if (next.restart) {
        next.attempt = v.attempt + 1;
      } else {
        link.finish(next);
      }
      v = next;
    }
    link_ = nullptr;
    if (!v.message.empty()) say(v.message);
    return v.status;
  }

  // How this node's workers of the attempt ended, for the verdict.
  NodeEnd local_end(int status) const {
    NodeEnd e;
    e.node = c_.node_rank.value_or(0);
    if (got_signal_) {
      e.kind = NodeEnd::kSignalled;
      e.status = 128 + got_signal_;
    } else if (first_failure_) {
      e.kind = NodeEnd::kFailed;
      e.rank = first_failure_->rank;
      e.step = board_ ? board_->step(first_failure_->rank - e.node * c_.nproc) : 0;
      e.failed_at_ms = failed_at_ms_;
      e.status = status;
      e.what = describe_end(first_failure_->status);
    } else if (stopped_by_peer_) {
      e.kind = NodeEnd::kStopped;
    }
    return e;
  }

  static std::string cause_of(const NodeEnd& f) {
    return "rank " + std::to_string(f.rank) + " " + f.what +
           (f.step > 0 ? " at step " + std::to_string(f.step) : " before training");
  }

  std::string restart_line(const Verdict& v) const {
    return "restart " + std::to_string(v.attempt) + " of " + std::to_string(c_.max_restarts) + ": " + v.cause +
           "; starting every worker again from the latest checkpoint";
  }

  // After a failure in `attempt`: restart, or end because no restart is left or
  // the failure repeats the one before the last restart at the same step.
  Verdict decide(int attempt, std::optional<int64_t>& failed_step, const NodeEnd& f) const {
    Verdict v;
    v.cause = cause_of(f);
    v.status = f.status;
    if (attempt >= c_.max_restarts) {
      v.message = "no restart left (--max-restarts " + std::to_string(c_.max_restarts) + "): " + v.cause;
      return v;
    }
    if (failed_step && *failed_step == f.step) {
      v.message = "deterministic failure: " + v.cause + ", at the same " + (f.step > 0 ? "step" : "point") +
                  " as before restart " + std::to_string(attempt) + "; not restarting again";
      return v;
    }
    failed_step = f.step;
    v.restart = true;
    v.attempt = attempt + 1;
    v.failed_at_ms = f.failed_at_ms;
    return v;
  }

  // Node 0 of a group: the verdict from every node's end. A signal or a node
  // gone ends the launch; otherwise the earliest failure by wall clock is the
  // cause (the others are workers that lost a peer, or were stopped).
  Verdict decide_group(int attempt, std::optional<int64_t>& failed_step, const std::vector<NodeEnd>& ends) const {
    Verdict v;
    for (const NodeEnd& e : ends)
      if (e.kind == NodeEnd::kSignalled || e.kind == NodeEnd::kLost) {
        v.status = e.status;
        v.message = e.kind == NodeEnd::kLost
                        ? "stopping every node: " + e.what + "; the launchers do not replace a node (requeue the job)"
                        : "stopping every node: the launcher of node " + std::to_string(e.node) +
                              " got a signal (status " + std::to_string(e.status) + ")";
        return v;
      }
    const NodeEnd* first = nullptr;
    for (const NodeEnd& e : ends)
      if (e.kind == NodeEnd::kFailed &&
          (!first || e.failed_at_ms < first->failed_at_ms ||
           (e.failed_at_ms == first->failed_at_ms && e.rank < first->rank)))
        first = &e;
    if (!first) return v;  // every node's workers finished
    return decide(attempt, failed_step, *first);
  }

 private:
  void spawn(Worker& w, std::vector<std::string>& argv, std::vector<std::string>& env, const SignalScope& signals,
             int listen_fd) {
    Spawn sp;
    for (auto& a : argv) sp.argv.push_back(a.data());
    sp.argv.push_back(nullptr);
    for (auto& e : env) sp.envp.push_back(e.data());
    sp.envp.push_back(nullptr);
    sp.search_path = c_.exec;
    sp.exec_error = "nnstrain launch: cannot run '" + argv[0] + "': ";

    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    if (pipe2(err, O_CLOEXEC) != 0) {
      int e = errno;
      close(out[0]);
      close(out[1]);
      throw std::runtime_error(std::string("pipe: ") + std::strerror(e));
    }
    // Signals wait until the child has dropped the launcher's handlers.
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) exec_child(sp, signals, old, parent, devnull_, out[1], err[1], listen_fd, progress_fd_);
    const int fork_errno = errno;
    sigprocmask(SIG_SETMASK, &old, nullptr);
    close(out[1]);
    close(err[1]);
    if (pid < 0) {
      close(out[0]);
      close(err[0]);
      throw std::runtime_error(std::string("fork: ") + std::strerror(fork_errno));
    }
    setpgid(pid, pid);  // also here, so the group exists before we might signal it
    w.pid = pid;
    w.running = true;
    w.out = {out[0], o_.out_fd, w.rank, {}};
    w.err = {err[0], o_.err_fd, w.rank, {}};
    for (int fd : {out[0], err[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  }

  void say(const std::string& message) { write_all(o_.err_fd, "nnstrain launch: " + message + "\n"); }

  void signal_running(int sig) {
    for (auto& w : workers_)
      if (w.running) kill(-w.pid, sig);
  }

  size_t running() const {
    size_t n = 0;
    for (auto& w : workers_) n += w.running;
    return n;
  }

  // Kills what is left in every worker's process group and reaps it all.
  void end_groups() {
    if (groups_ended_) return;  // once: a pid must not be signalled after it may be reused
    groups_ended_ = true;
    for (auto& w : workers_) {
      if (w.pid <= 0) continue;
      kill(-w.pid, SIGKILL);
      if (w.running && waitpid(w.pid, nullptr, 0) == w.pid) w.running = false;
      while (waitpid(-w.pid, nullptr, 0) > 0 || errno == EINTR) {
      }
    }
  }

  void reap() {
    for (auto& w : workers_) {
      if (w.pid <= 0) continue;
      // The worker leads its group; the rest of the group are processes it left
      // behind, re-parented to us: reaped in passing.
      while (true) {
        int status = 0;
        pid_t p = waitpid(-w.pid, &status, WNOHANG);
        if (p < 0 && errno == EINTR) continue;
        if (p <= 0) break;
        if (p == w.pid) worker_ended(w, status);
      }
      if (w.running) {  // in case the worker never got its own group
        int status = 0;
        pid_t p = waitpid(w.pid, &status, WNOHANG);
        if (p == w.pid) worker_ended(w, status);
        if (p < 0 && errno == ECHILD) worker_ended(w, 255 << 8);  // reaped by someone else: failed
      }
    }
  }

  void worker_ended(Worker& w, int status) {
    w.running = false;
    w.status = status;
    // Its last words come before the launcher's verdict.
    pump(w.out, true);
    pump(w.err, true);
    if (!failed(w.status) || first_failure_ || stopped_by_peer_) return;
    first_failure_ = &w;
    failed_at_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch()).count();
    say("rank " + std::to_string(w.rank) + " " + describe_end(w.status));
    if (running() > 0 && c_.max_restarts > 0 && !c_.exec) {
      // They restart from the checkpoint: what they hold is worth nothing, and
      // blocked in a collective with the dead rank they would not act on
      // SIGTERM before the grace period ran out (measured: the whole 5 s).
      say("stopping the other workers (SIGKILL: every worker restarts from the latest checkpoint)");
      signal_running(SIGKILL);
    } else if (running() > 0) {
      char grace[32];
      std::snprintf(grace, sizeof grace, "%g", o_.grace_period_s);
      say("stopping the other workers (SIGTERM, then SIGKILL after " + std::string(grace) + " s)");
      signal_running(SIGTERM);
      kill_at_ = Clock::now() +
                 std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.grace_period_s));
    }
  }

  int supervise(const SignalScope& signals) {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    while (true) {
      reap();
      if (running() == 0) break;

      // Node 0 of a group: this node's failure stops every node's workers.
      if (link_ && first_failure_) link_->stop_all(attempt_);
      fds.assign(1, pollfd{signals.read_fd(), POLLIN, 0});
      streams.assign(1, nullptr);
      const size_t links = link_ ? link_->fds().size() : 0;
      if (link_)
        for (int fd : link_->fds()) {
          fds.push_back(pollfd{fd, POLLIN, 0});
          streams.push_back(nullptr);
        }
      for (auto& w : workers_)
        for (Stream* s : {&w.out, &w.err})
          if (s->fd >= 0) {
            fds.push_back(pollfd{s->fd, POLLIN, 0});
            streams.push_back(s);
          }
      int timeout = -1;
      if (kill_at_) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*kill_at_ - Clock::now()).count();
        timeout = static_cast<int>(std::max<long long>(0, left) + 1);
      }
      int n = poll(fds.data(), fds.size(), timeout);
      if (n < 0 && errno != EINTR) throw std::runtime_error(std::string("poll: ") + std::strerror(errno));

      if (n > 0 && fds[0].revents) {
        unsigned char sigs[64];
        ssize_t k;
        while ((k = read(signals.read_fd(), sigs, sizeof sigs)) > 0)
          for (ssize_t i = 0; i < k; ++i) {
            if (sigs[i] == SIGCHLD) continue;  // reap() at the top of the loop
            if (ends_launch(sigs[i])) got_signal_ = sigs[i];
            say("got " + signal_name(sigs[i]) + ", passing it on to the workers");
            signal_running(sigs[i]);
          }
      }
      for (size_t i = 1; n > 0 && i < 1 + links; ++i) {
        if (!fds[i].revents || !link_->on_readable(fds[i].fd)) continue;
        // Another node's worker failed: these restart with it (or end).
        link_->stop_all(attempt_);
        if (!first_failure_ && !stopped_by_peer_ && running() > 0) {
          stopped_by_peer_ = true;
          say("another node's worker failed: stopping this node's workers (SIGKILL)");
          signal_running(SIGKILL);
        }
      }
      for (size_t i = 1 + links; n > 0 && i < fds.size(); ++i) {
        if (fds[i].revents) pump(*streams[i], false);
      }
      if (kill_at_ && Clock::now() >= *kill_at_) {
        kill_at_.reset();
        for (auto& w : workers_)
          if (w.running) say("rank " + std::to_string(w.rank) + " is still running: SIGKILL");
        signal_running(SIGKILL);
      }
    }
    // Everything the workers wrote before exiting is in the pipes; a process
    // they left behind may hold a pipe open, so read what is there, no more.
    for (auto& w : workers_)
      for (Stream* s : {&w.out, &w.err}) {
        pump(*s, true);
        if (s->fd >= 0) {
          emit_lines(*s, true);
          close(s->fd);
          s->fd = -1;
        }
      }
    // Nothing a worker started outlives the job.
    end_groups();

    if (got_signal_) return 128 + got_signal_;
    if (first_failure_) {
      const int st = first_failure_->status;
      say("failed: rank " + std::to_string(first_failure_->rank) + " " + describe_end(st));
      if (WIFEXITED(st)) return WEXITSTATUS(st);
      if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
      return 1;
    }
    return 0;
  }

  using Clock = std::chrono::steady_clock;
  const Config& c_;
  const std::string& self_exe_;
  const LaunchOptions& o_;
  int devnull_ = -1;
  int listen_fd_ = -1;  // the reserved rendezvous port, until rank 0 has it
  std::vector<Worker> workers_;
  Worker* first_failure_ = nullptr;
  int64_t failed_at_ms_ = 0;  // wall clock of the first failure (a restart's cost is measured from it)
  int progress_fd_ = -1;      // the progress board (--max-restarts), handed to every worker
  const ProgressBoard* board_ = nullptr;
  RestartRendezvous* link_ = nullptr;  // several nodes under --max-restarts: the other launchers
  int attempt_ = 0;                    // the attempt running (0: the first start)
  bool stopped_by_peer_ = false;       // this node's workers were stopped for another node's failure
  std::optional<Clock::time_point> kill_at_;
  int got_signal_ = 0;
  bool was_subreaper_ = true;
  bool groups_ended_ = false;
};

}  // namespace

int launch_main(const std::vector<std::string>& args, const std::string& self_exe, const LaunchOptions& options) {
  Config config;
  try {
    config = parse(args);
  } catch (const UsageError& e) {
    write_all(options.err_fd, std::string("nnstrain launch: ") + e.what() +
                                  "\n(see 'nnstrain launch --help')\n");
    return 2;
  }
  if (config.help) {
    write_all(options.out_fd, kUsage);
    return 0;
  }
  try {
    Launch launch(config, self_exe, options);
    return launch.run();
  } catch (const PortError& e) {
    write_all(options.err_fd, std::string("nnstrain launch: ") + e.what() + "\n");
    return 2;
  } catch (const std::exception& e) {
    write_all(options.err_fd, std::string("nnstrain launch: ") + e.what() + "\n");
    return 1;
  }
}

int launch_main(const std::vector<std::string>& args, const std::string& self_exe) {
  return launch_main(args, self_exe, LaunchOptions{});
}

std::string self_executable(const std::string& argv0) {
#ifdef __linux__
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) {
    std::string path(buf, static_cast<size_t>(n));
    const std::string deleted = " (deleted)";  // the binary was rebuilt under us
    if (path.size() < deleted.size() || path.compare(path.size() - deleted.size(), deleted.size(), deleted) != 0)
      return path;
  }
#endif
  return argv0;
}

}  // namespace nnstrain::dist
