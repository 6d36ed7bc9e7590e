// `nnstrain launch` through launch_main, with small /bin/sh workers (--exec).
// The workers synchronise through files in a temporary folder; nothing here
// depends on timing.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

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
#include "trainer/dist/rendezvous_socket.h"

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
