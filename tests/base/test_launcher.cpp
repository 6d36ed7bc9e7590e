// `nnstrain launch` through launch_main, with small /bin/sh workers (--exec).
// The workers synchronise through files in a temporary folder; nothing here
// depends on timing.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "trainer/dist/dist_env.h"
#include "trainer/dist/launcher.h"
#include "trainer/dist/progress_board.h"
#include "trainer/dist/rendezvous_socket.h"
#include "trainer/dist/restart_rendezvous.h"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using nnstrain::dist::launch_main;
using nnstrain::dist::LaunchOptions;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "nnstrain_launch_XXXXXX").string();
    REQUIRE(mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

struct Result {
  int status = -1;
  std::string out, err;
};

// Runs the launcher with its output captured in files (a pipe could fill up).
Result launch(const TempDir& dir, const std::vector<std::string>& args, double grace_s = 5.0,
              const std::string& self_exe = "/nonexistent/nnstrain") {
  const std::string out_path = dir / "launcher.out", err_path = dir / "launcher.err";
  int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(out >= 0);
  REQUIRE(err >= 0);
  LaunchOptions options;
  options.out_fd = out;
  options.err_fd = err;
  options.grace_period_s = grace_s;
  Result r;
  r.status = launch_main(args, self_exe, options);
  close(out);
  close(err);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  return r;
}

// `launch --nproc-per-node N [extra] --exec /bin/sh -c SCRIPT`.
std::vector<std::string> sh_workers(int n, const std::string& script, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--nproc-per-node", std::to_string(n)};
  args.insert(args.end(), extra.begin(), extra.end());
  args.insert(args.end(), {"--exec", "--", "/bin/sh", "-c", script});
  return args;
}

std::map<std::string, std::string> env_file(const std::string& path) {
  std::map<std::string, std::string> env;
  for (const auto& line : lines_of(slurp(path))) {
    auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// A shell line that waits until every file named exists.
std::string wait_for(const std::vector<std::string>& files) {
  std::string s;
  for (const auto& f : files) s += "while [ ! -e '" + f + "' ]; do sleep 0.01; done; ";
  return s;
}

struct EnvVar {  // sets or unsets a variable of this process for one scope
  std::string name;
  std::optional<std::string> old;
  EnvVar(std::string n, std::optional<std::string> value) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) old = v;
    value ? setenv(name.c_str(), value->c_str(), 1) : unsetenv(name.c_str());
  }
  ~EnvVar() { old ? setenv(name.c_str(), old->c_str(), 1) : unsetenv(name.c_str()); }
};

}  // namespace

TEST_CASE("launch: every worker gets torchrun's variables", "[launch]") {
  TempDir dir;
  EnvVar omp("OMP_NUM_THREADS", std::nullopt);
  EnvVar stale("RANK", std::string("99"));  // a RANK from outside must not leak through
  const std::string script = "env > '" + dir.path.string() + "/env.'$LOCAL_RANK; " + "echo $$ $(cut -d' ' -f5 /proc/$$/stat) > '" +
                             dir.path.string() + "/pid.'$LOCAL_RANK";
  Result r = launch(dir, sh_workers(3, script));
  INFO(r.err);
  REQUIRE(r.status == 0);

  std::string port;
  for (int local = 0; local < 3; ++local) {
    auto env = env_file(dir / ("env." + std::to_string(local)));
    CHECK(env["RANK"] == std::to_string(local));
    CHECK(env["WORLD_SIZE"] == "3");
    CHECK(env["LOCAL_RANK"] == std::to_string(local));
    CHECK(env["LOCAL_WORLD_SIZE"] == "3");
    CHECK(env["GROUP_RANK"] == "0");
    CHECK(env["GROUP_WORLD_SIZE"] == "1");
    CHECK(env["MASTER_ADDR"] == "127.0.0.1");
    CHECK(env["OMP_NUM_THREADS"] == "1");
    if (local == 0) port = env["MASTER_PORT"];
    CHECK(env["MASTER_PORT"] == port);
    CHECK(std::stoi(port) > 0);
    CHECK(std::stoi(port) < 65536);

    // What the launcher sets is exactly what DistEnv reads.
    auto d = nnstrain::dist::read_dist_env([&](const std::string& k) -> std::optional<std::string> {
      auto it = env.find(k);
      return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
    });
    CHECK(d.launcher == "torchrun");
    CHECK(d.rank == local);
    CHECK(d.world_size == 3);
    CHECK(d.local_world_size == 3);
    CHECK(d.master_port == std::stoi(port));

    // Each worker leads its own process group, and none is left as a zombie.
    std::istringstream ids(slurp(dir / ("pid." + std::to_string(local))));
    pid_t pid = 0, pgid = 0;
    ids >> pid >> pgid;
    CHECK(pid > 0);
    CHECK(pgid == pid);
    CHECK(kill(pid, 0) == -1);
    CHECK(errno == ESRCH);
  }
}

TEST_CASE("launch: OMP_NUM_THREADS already set is kept and underscores spell flags too", "[launch]") {
  TempDir dir;
  EnvVar omp("OMP_NUM_THREADS", std::string("6"));
  Result r = launch(dir, {"--nproc_per_node=1", "--exec", "--", "/bin/sh", "-c",
                          "echo $OMP_NUM_THREADS > '" + (dir / "omp") + "'"});
  REQUIRE(r.status == 0);
  CHECK(slurp(dir / "omp") == "6\n");
}

TEST_CASE("launch: one node of several", "[launch]") {
  TempDir dir;
  const std::string script = "env > '" + dir.path.string() + "/env.'$LOCAL_RANK";
  Result r = launch(dir, sh_workers(2, script,
                                    {"--nnodes", "3", "--node-rank", "1", "--master-addr", "10.9.8.7",
                                     "--master-port=29999"}));
  INFO(r.err);
  REQUIRE(r.status == 0);
  for (int local = 0; local < 2; ++local) {
    auto env = env_file(dir / ("env." + std::to_string(local)));
    CHECK(env["RANK"] == std::to_string(2 + local));
    CHECK(env["WORLD_SIZE"] == "6");
    CHECK(env["LOCAL_RANK"] == std::to_string(local));
    CHECK(env["LOCAL_WORLD_SIZE"] == "2");
    CHECK(env["GROUP_RANK"] == "1");
    CHECK(env["GROUP_WORLD_SIZE"] == "3");
    CHECK(env["MASTER_ADDR"] == "10.9.8.7");
    CHECK(env["MASTER_PORT"] == "29999");
  }
}

TEST_CASE("launch: every output line is echoed whole, prefixed with its rank", "[launch]") {
  TempDir dir;
  // Lines up to 9 kB, longer than a pipe's atomic write, from two workers at once;
  // and a last line without a newline.
  const std::string script =
      "awk -v r=$RANK 'BEGIN { for (i = 0; i < 300; i++) { s = \"\"; for (j = 0; j < i * 30; j++) s = s \"x\"; "
      "print \"r\" r \" line \" i \" \" s } }'; echo \"err $RANK\" >&2; printf 'tail %s' $RANK";
  Result r = launch(dir, sh_workers(2, script));
  INFO(r.err);
  REQUIRE(r.status == 0);

  std::map<int, int> next;  // rank -> next expected line number
  std::map<int, bool> tail;
  for (const auto& line : lines_of(r.out)) {
    REQUIRE(line.rfind("[rank ", 0) == 0);
    const int rank = line[6] - '0';
    REQUIRE((rank == 0 || rank == 1));
    REQUIRE(line.substr(7, 2) == "] ");
    const std::string body = line.substr(9);
    if (body.rfind("tail ", 0) == 0) {
      CHECK(body == "tail " + std::to_string(rank));
      tail[rank] = true;
      continue;
    }
    const int i = next[rank]++;
    REQUIRE(body == "r" + std::to_string(rank) + " line " + std::to_string(i) + " " + std::string(i * 30, 'x'));
  }
  CHECK(next[0] == 300);
  CHECK(next[1] == 300);
  CHECK(tail[0]);
  CHECK(tail[1]);
  // stderr lines go to the launcher's stderr, prefixed too.
  CHECK_THAT(r.err, Contains("[rank 0] err 0\n") && Contains("[rank 1] err 1\n"));
  CHECK(r.out.find("err 0") == std::string::npos);
}

TEST_CASE("launch: a failing worker stops the others, and the message names it", "[launch]") {
  TempDir dir;
  const std::string d = dir.path.string() + "/";
  // Ranks 0 and 2 wait forever, recording the SIGTERM that should end them;
  // rank 1 fails once they are ready to record it.
  const std::string script =
      "if [ $RANK = 1 ]; then " + wait_for({d + "ready.0", d + "ready.2"}) +
      "echo 'about to fail' >&2; exit 3; fi; "
      "trap \"echo TERM > '" + d + "term.'$RANK; exit 0\" TERM; echo $$ > '" + d + "pid.'$RANK; touch '" + d +
      "ready.'$RANK; while :; do sleep 0.05; done";
  Result r = launch(dir, sh_workers(3, script));
  CHECK(r.status == 3);
  CHECK_THAT(r.err, Contains("nnstrain launch: rank 1 exited with status 3\n"));
  CHECK_THAT(r.err, Contains("nnstrain launch: failed: rank 1 exited with status 3\n"));
  // The worker's own last words come before the launcher's verdict.
  CHECK(r.err.find("[rank 1] about to fail") < r.err.find("rank 1 exited"));
  CHECK(slurp(d + "term.0") == "TERM\n");
  CHECK(slurp(d + "term.2") == "TERM\n");
  for (int rank : {0, 2}) {
    pid_t pid = std::stoi(slurp(d + "pid." + std::to_string(rank)));
    CHECK(kill(pid, 0) == -1);
  }
}

TEST_CASE("launch: a worker ignoring SIGTERM gets SIGKILL after the grace period", "[launch]") {
  TempDir dir;
  const std::string d = dir.path.string() + "/";
  const std::string script = "if [ $RANK = 1 ]; then " + wait_for({d + "ready.0"}) +
                             "kill -KILL $$; fi; trap '' TERM; touch '" + d +
                             "ready.0'; while :; do sleep 0.05; done";
  Result r = launch(dir, sh_workers(2, script), /*grace_s=*/0.2);
  CHECK(r.status == 128 + 9);
  CHECK_THAT(r.err, Contains("nnstrain launch: rank 1 was killed by signal 9 (SIGKILL)"));
  CHECK_THAT(r.err, Contains("nnstrain launch: rank 0 is still running: SIGKILL"));
}

TEST_CASE("launch: SIGINT and SIGTERM to the launcher reach every worker", "[launch]") {
  for (const std::string sig : {"INT", "TERM"}) {
    DYNAMIC_SECTION("SIG" << sig) {
      TempDir dir;
      const std::string d = dir.path.string() + "/";
      // Once both workers are ready, rank 0 signals its parent, the launcher.
      const std::string script = "trap \"echo " + sig + " > '" + d + "got.'$RANK\"'; exit 0' " + sig +
                                 "; touch '" + d + "ready.'$RANK; if [ $RANK = 0 ]; then " +
                                 wait_for({d + "ready.0", d + "ready.1"}) + "kill -" + sig +
                                 " $PPID; fi; while :; do sleep 0.05; done";
      Result r = launch(dir, sh_workers(2, script));
      const int signo = sig == "INT" ? SIGINT : SIGTERM;
      CHECK(r.status == 128 + signo);
      CHECK_THAT(r.err, Contains("got SIG" + sig + ", passing it on to the workers"));
      CHECK(slurp(d + "got.0") == sig + "\n");
      CHECK(slurp(d + "got.1") == sig + "\n");
    }
  }
}

TEST_CASE("launch: processes a worker leaves behind are stopped too", "[launch]") {
  TempDir dir;
  const std::string d = dir.path.string() + "/";
  // The background sleep keeps the worker's stdout pipe open: the launcher must
  // neither wait for it nor leave it running.
  Result r = launch(dir, sh_workers(1, "sleep 300 & echo $! > '" + d + "child'; echo done"));
  REQUIRE(r.status == 0);
  CHECK(r.out == "[rank 0] done\n");
  pid_t child = std::stoi(slurp(d + "child"));
  // Stopped and reaped: gone, not even a zombie.
  CHECK(kill(child, 0) == -1);
  CHECK(errno == ESRCH);
}

TEST_CASE("launch: without --exec every worker runs this binary with the arguments", "[launch]") {
  TempDir dir;
  Result r = launch(dir, {"--nproc-per-node", "2", "--", "-c", "echo \"$0 $RANK\""}, 5.0, "/bin/sh");
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Contains("[rank 0] /bin/sh 0\n") && Contains("[rank 1] /bin/sh 1\n"));
}

TEST_CASE("launch: a program that cannot start is a failed rank", "[launch]") {
  TempDir dir;
  Result r = launch(dir, {"--nproc-per-node", "1", "--exec", "--", "/nonexistent/program"});
  CHECK(r.status == 127);
  CHECK_THAT(r.err, Contains("[rank 0] nnstrain launch: cannot run '/nonexistent/program': No such file"));
  CHECK_THAT(r.err, Contains("rank 0 exited with status 127"));
}

TEST_CASE("launch: bad flags are a clear error with status 2", "[launch]") {
  TempDir dir;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "--nproc-per-node is required"},
      {{"--nproc-per-node", "0", "--", "x"}, "--nproc-per-node '0' is not a whole number"},
      {{"--nproc-per-node", "two", "--", "x"}, "--nproc-per-node 'two'"},
      {{"--nproc-per-node"}, "--nproc-per-node needs a value"},
      {{"--nproc-per-node", "2"}, "nothing to run"},
      {{"--nproc-per-node", "2", "--"}, "nothing to run"},
      {{"--nproc-per-node", "2", "--frob", "--", "x"}, "unknown option '--frob'"},
      {{"--nproc-per-node", "2", "--config", "x.yaml"}, "unknown option '--config'"},
      {{"--nproc-per-node", "2", "--exec=yes", "--", "x"}, "--exec takes no value"},
      {{"--nproc-per-node", "2", "--master-port", "70000", "--", "x"}, "--master-port '70000'"},
      {{"--nproc-per-node", "2", "--nnodes", "1:2", "--", "x"}, "--nnodes '1:2'"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--", "x"},
       "--nnodes 2 needs --node-rank --master-addr --master-port"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--", "x"},
       "--nnodes 2 needs --master-port"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "5",
        "--", "x"},
       "--node-rank 2 is not below --nnodes 2"},
      {{"--nproc-per-node", "2", "--node-rank", "1", "--", "x"}, "--node-rank 1 is not below --nnodes 1"},
  };
  for (const auto& [args, message] : cases) {
    Result r = launch(dir, args);
    INFO("message: " << r.err);
    CHECK(r.status == 2);
    CHECK_THAT(r.err, Contains("nnstrain launch: " + message));
  }
  Result help = launch(dir, {"--help"});
  CHECK(help.status == 0);
  CHECK_THAT(help.out, Contains("usage: nnstrain launch --nproc-per-node N"));
}

namespace {

// A port this test listens on, as another job would; closed at the end of the scope.
struct HeldPort {
  int fd = -1, port = 0;
  HeldPort() {
    std::tie(fd, port) = nnstrain::dist::listen_on(0);
    REQUIRE(fd >= 0);
  }
  ~HeldPort() { close(fd); }
};

// What kRendezvousScript writes to $OUT.$RANK: "fd=<NNSTRAIN_RENDEZVOUS_FD> port=<MASTER_PORT> listen=<the
// /proc/net/tcp* line of the socket on the worker's fd 3, if fd 3 is a socket>".
const char* kRendezvousScript =
    "ino=$(readlink /proc/$$/fd/3 2>/dev/null | sed -n 's/^socket:\\[\\([0-9]*\\)\\]$/\\1/p'); "
    "line=; [ -n \"$ino\" ] && line=$(awk -v i=$ino '$10 == i { print $2, $4 }' /proc/net/tcp /proc/net/tcp6); "
    "echo \"fd=$NNSTRAIN_RENDEZVOUS_FD port=$MASTER_PORT listen=$line\" > \"$OUT.$RANK\"";

}  // namespace

TEST_CASE("launch: rank 0 gets the rendezvous port as a listening socket and the others get nothing", "[launch]") {
  TempDir dir;
  EnvVar out("OUT", dir / "rank");
  // Without --exec the workers run "this binary", here /bin/sh.
  Result r = launch(dir, {"--nproc-per-node", "3", "--", "-c", kRendezvousScript}, 5.0, "/bin/sh");
  INFO(r.err);
  REQUIRE(r.status == 0);
  const std::string rank0 = lines_of(slurp(dir / "rank.0")).at(0);
  // "fd=3 port=P listen=<addr>:<P in hex> 0A" (0A: TCP_LISTEN).
  const auto port = rank0.substr(rank0.find("port=") + 5, rank0.find(" listen=") - rank0.find("port=") - 5);
  char hex[8];
  std::snprintf(hex, sizeof hex, "%04X", std::stoi(port));
  CHECK(rank0.rfind("fd=3 port=", 0) == 0);
  CHECK_THAT(rank0, Contains(std::string(":") + hex + " 0A"));
  for (int rank : {1, 2}) {
    CHECK(lines_of(slurp(dir / ("rank." + std::to_string(rank)))).at(0) == "fd= port=" + port + " listen=");
  }
}

TEST_CASE("launch: a --master-port in use stops the launch in one line before any worker starts", "[launch]") {
  TempDir dir;
  HeldPort held;
  const std::string p = std::to_string(held.port);
  for (bool exec : {false, true}) {
    DYNAMIC_SECTION((exec ? "--exec" : "nnstrain workers")) {
      std::vector<std::string> args = {"--nproc-per-node", "2", "--master-port", p};
      const std::string touch = "touch '" + (dir / "started") + "'";
      if (exec)
        args.insert(args.end(), {"--exec", "--", "/bin/sh", "-c", touch});
      else
        args.insert(args.end(), {"--", "-c", touch});  // without --exec the workers run this binary: /bin/sh
      Result r = launch(dir, args, 5.0, "/bin/sh");
      CHECK(r.status == 2);
      CHECK(r.err == "nnstrain launch: --master-port " + p +
                         " is already in use on this machine (another job, or one that has not ended, listens on "
                         "it): choose another port, or leave --master-port out on one node\n");
      CHECK(r.out.empty());
      CHECK(!fs::exists(dir / "started"));
    }
  }
}

TEST_CASE("launch: only the node that runs rank 0 binds --master-port", "[launch]") {
  TempDir dir;
  HeldPort held;  // as rank 0's store on another node would, were it this machine
  Result r = launch(dir, sh_workers(1, "echo $MASTER_PORT", {"--nnodes", "2", "--node-rank", "1", "--master-addr",
                                                             "127.0.0.1", "--master-port", std::to_string(held.port)}));
  INFO(r.err);
  CHECK(r.status == 0);
  CHECK(r.out == "[rank 1] " + std::to_string(held.port) + "\n");
}

TEST_CASE("launch: rank 0 takes only a socket listening on its MASTER_PORT", "[launch]") {
  using nnstrain::dist::listening_on;
  HeldPort held;
  CHECK(listening_on(held.fd, held.port));
  CHECK(!listening_on(held.fd, held.port == 65535 ? 1 : held.port + 1));
  int unbound = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // a socket, not listening
  REQUIRE(unbound >= 0);
  CHECK(!listening_on(unbound, 0));
  close(unbound);
  int p[2];
  REQUIRE(pipe(p) == 0);
  CHECK(!listening_on(p[0], held.port));  // not a socket
  close(p[0]);
  close(p[1]);
  CHECK(!listening_on(-1, held.port));
}

TEST_CASE("launch: SIGUSR1 and SIGUSR2 reach every worker and the launch goes on", "[launch]") {
  TempDir dir;
  const std::string d = dir.path.string() + "/";
  // SIGUSR2 asks for flight records (the workers go on), SIGUSR1 to save and stop (they exit 0).
  const std::string script = "trap \"echo USR2 >> '" + d + "got.'$RANK\" USR2; trap \"echo USR1 >> '" + d +
                             "got.'$RANK\"'; exit 0' USR1; touch '" + d + "ready.'$RANK; if [ $RANK = 0 ]; then " +
                             wait_for({d + "ready.0", d + "ready.1"}) + "kill -USR2 $PPID; " +
                             wait_for({d + "got.0", d + "got.1"}) + "kill -USR1 $PPID; fi; while :; do sleep 0.05; done";
  Result r = launch(dir, sh_workers(2, script));
  INFO(r.err);
  CHECK(r.status == 0);
  CHECK_THAT(r.err, Contains("got SIGUSR2, passing it on to the workers"));
  CHECK_THAT(r.err, Contains("got SIGUSR1, passing it on to the workers"));
  CHECK(slurp(d + "got.0") == "USR2\nUSR1\n");
  CHECK(slurp(d + "got.1") == "USR2\nUSR1\n");
}

TEST_CASE("launch: a restart on one node gives the workers a fresh port, the command unchanged", "[launch]") {
  TempDir dir;
  const std::string d = dir.path.string() + "/";
  // In attempt 0 rank 1 fails once both have written their port (rank 0 waits, and is killed); the
  // restarted workers (NNSTRAIN_RESTART_COUNT set) succeed.
  const std::string script = "echo \"$MASTER_PORT $*\" >> '" + d + "ports.'$RANK; if [ -z \"$NNSTRAIN_RESTART_COUNT\" ]; then " +
                             "if [ $RANK = 1 ]; then " + wait_for({d + "ports.0"}) + "exit 3; fi; " +
                             "while :; do sleep 0.05; done; fi";
  auto args = sh_workers(2, script, {"--max-restarts", "1"});
  args.insert(args.end(), {"sh", "--resume", "/some/where"});
  Result r = launch(dir, args);
  INFO(r.err);
  CHECK(r.status == 0);
  CHECK_THAT(r.err, Contains("restart 1 of 1: rank "));
  for (int rank : {0, 1}) {
    const auto runs = lines_of(slurp(d + "ports." + std::to_string(rank)));
    REQUIRE(runs.size() == 2);
    CHECK(runs[0].substr(0, runs[0].find(' ')) != runs[1].substr(0, runs[1].find(' ')));
    // What the command named stays: nnstrain itself decides what a restart resumes from.
    CHECK(runs[1].substr(runs[1].find(' ')) == " --resume /some/where");
  }
}

TEST_CASE("launch: a worker maps only the launcher's progress board, never an inherited descriptor 4", "[launch]") {
  using nnstrain::dist::is_progress_board;
  nnstrain::dist::ProgressBoard board(2);
  CHECK(is_progress_board(board.fd()));
  TempDir dir;
  const std::string file = dir / "data.bin";
  std::ofstream(file) << std::string(64, 'A');
  const int fd = open(file.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  CHECK(!is_progress_board(fd));
  int p[2];
  REQUIRE(pipe(p) == 0);
  CHECK(!is_progress_board(p[0]));
  close(p[0]);
  close(p[1]);
  // A process that inherited NNSTRAIN_PROGRESS_FD (a worker's child) whose descriptor 4 is a file of its own.
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(fd, nnstrain::dist::kProgressFd);
    setenv(nnstrain::dist::kProgressFdVar, std::to_string(nnstrain::dist::kProgressFd).c_str(), 1);
    setenv("LOCAL_RANK", "0", 1);
    nnstrain::dist::publish_step(7);
    _exit(fcntl(nnstrain::dist::kProgressFd, F_GETFD) >= 0 ? 0 : 1);  // and it is still open
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  close(fd);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(slurp(file) == std::string(64, 'A'));
}

namespace {

using nnstrain::dist::RestartRendezvous;

int connect_local(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

void send_text(int fd, const std::string& s) { REQUIRE(send(fd, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size())); }

// What node 0 sends before closing a dropped connection ("" when nothing), waiting up to 10 s.
std::string read_until_closed(int fd) {
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string got;
  char buf[512];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) got.append(buf, static_cast<size_t>(n));
  return n == 0 ? got : "(not closed)";
}

}  // namespace

TEST_CASE("launchers' rendezvous: stray, overlong and forged connections are dropped, the join goes on",
          "[launch][rendezvous]") {
  auto [listen_fd, port] = nnstrain::dist::listen_on(0);
  REQUIRE(listen_fd >= 0);
  int sig[2];
  REQUIRE(pipe2(sig, O_CLOEXEC | O_NONBLOCK) == 0);
  int dropped = -1;
  auto host = std::async(std::launch::async, [&, fd = listen_fd] {
    return RestartRendezvous::host(fd, 2, 1, 1, 20, sig[0], "token=job-1", &dropped);
  });
  const int scanner = connect_local(port);  // a port scanner's probe
  send_text(scanner, "\r\n");
  CHECK(read_until_closed(scanner) == "");
  const int flood = connect_local(port);  // a line without end
  send_text(flood, std::string(nnstrain::dist::kMaxLineBytes + 100, 'x'));
  CHECK(read_until_closed(flood) == "");
  const int forged = connect_local(port);  // another job's (or a forger's) join for node 1's slot
  send_text(forged, "join\t1\t2\t1\t1\ttoken=job-2\n");
  CHECK_THAT(read_until_closed(forged), Contains("end\t2\tnode 0: this launch belongs to another job"));
  const int silent = connect_local(port);  // says nothing: no obstacle to the others
  // The real node 1 still gets its slot.
  auto node1 = RestartRendezvous::join("127.0.0.1", port, 1, 2, 1, 1, 20, sig[0], "token=job-1");
  REQUIRE(host.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
  auto node0 = host.get();
  CHECK(dropped == 3);
  CHECK(node0.fds().size() == 1);
  int keepalive = 0;
  socklen_t len = sizeof keepalive;
  REQUIRE(getsockopt(node1.fds().at(0), SOL_SOCKET, SO_KEEPALIVE, &keepalive, &len) == 0);
  CHECK(keepalive == 1);
  for (int fd : {scanner, flood, forged, silent, sig[0], sig[1]}) close(fd);
}

TEST_CASE("launchers' rendezvous: node 0 drops a connection silent past the join line's deadline",
          "[launch][rendezvous]") {
  auto [listen_fd, port] = nnstrain::dist::listen_on(0);
  REQUIRE(listen_fd >= 0);
  int sig[2];
  REQUIRE(pipe2(sig, O_CLOEXEC | O_NONBLOCK) == 0);
  // A join deadline shorter than kJoinLineS: the silent peer is dropped at the deadline,
  // and the timeout names the missing node.
  const auto t0 = std::chrono::steady_clock::now();
  const int silent = connect_local(port);
  std::string why;
  try {
    RestartRendezvous::host(listen_fd, 2, 1, 1, 1.5, sig[0], "t");
  } catch (const std::exception& e) {
    why = e.what();
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK_THAT(why, Contains("the launchers of node(s) 1 did not join within 1 s"));
  for (int fd : {silent, sig[0], sig[1]}) close(fd);
}

TEST_CASE("launchers' rendezvous: a node waits for node 0's first start no longer than its deadline",
          "[launch][rendezvous]") {
  // What answers at --master-port accepts the connection and never speaks.
  auto [listen_fd, port] = nnstrain::dist::listen_on(0);
  REQUIRE(listen_fd >= 0);
  int sig[2];
  REQUIRE(pipe2(sig, O_CLOEXEC | O_NONBLOCK) == 0);
  auto node1 = RestartRendezvous::join("127.0.0.1", port, 1, 2, 1, 1, 1, sig[0], "t");
  auto waiting = std::async(std::launch::async, [&] {
    try {
      node1.report_and_wait(-1, nnstrain::dist::NodeEnd{}, sig[0]);
      return std::string("returned");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
  });
  const bool ended = waiting.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  close(listen_fd);  // ends a wait without deadline (the connection is reset), so the test ends either way
  CHECK(ended);
  CHECK_THAT(waiting.get(), Contains("node 1: node 0's launcher accepted the join but did not start the run in time"));
  close(sig[0]);
  close(sig[1]);
}

TEST_CASE("launchers' rendezvous: the job token", "[launch][rendezvous]") {
  using nnstrain::dist::launch_token;
  EnvVar a("NNSTRAIN_LAUNCH_TOKEN", std::nullopt), b("SLURM_JOB_ID", std::nullopt), c("PBS_JOBID", std::nullopt);
  CHECK(launch_token({"--config", "x.yaml"}) == launch_token({"--config", "x.yaml"}));
  CHECK(launch_token({"--config", "x.yaml"}) != launch_token({"--config", "y.yaml"}));
  {
    EnvVar job("SLURM_JOB_ID", std::string("4242"));
    CHECK(launch_token({"--config", "x.yaml"}) == "SLURM_JOB_ID=4242");
    EnvVar mine("NNSTRAIN_LAUNCH_TOKEN", std::string("s3cret"));
    CHECK(launch_token({"--config", "y.yaml"}) == "NNSTRAIN_LAUNCH_TOKEN=s3cret");
  }
}
