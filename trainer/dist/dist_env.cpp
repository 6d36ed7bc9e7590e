#include "trainer/dist/dist_env.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace nnstrain::dist {

namespace {

[[noreturn]] void fail(const std::string& message) { throw DistEnvError(message); }

int64_t parse_digits(const std::string& name, const std::string& value) {
  if (value.empty()) fail(name + " is set but empty");
  int64_t v = 0;
  for (char c : value) {
    if (c < '0' || c > '9') fail(name + "='" + value + "' is not a non-negative integer");
    v = v * 10 + (c - '0');
    if (v > INT32_MAX) fail(name + "='" + value + "' is out of range");
  }
  return v;
}

// A number together with where it came from, so a contradiction can name it:
// "SLURM_NTASKS=8", or "num_nodes=2 (WORLD_SIZE / LOCAL_WORLD_SIZE)".
struct Val {
  int value = 0;
  std::string what;
};

Val derived(const std::string& field, int value, const std::string& how) {
  return {value, field + "=" + std::to_string(value) + " (" + how + ")"};
}

class Vars {
 public:
  explicit Vars(const GetEnv& getenv) : getenv_(getenv) {}

  std::optional<std::string> str(const std::string& name) const { return getenv_(name); }
  bool has(const std::string& name) const { return getenv_(name).has_value(); }

  std::optional<Val> num(const std::string& name) const {
    auto v = getenv_(name);
    if (!v) return std::nullopt;
    int n = static_cast<int>(parse_digits(name, *v));
    return Val{n, name + "=" + std::to_string(n)};
  }
  // The first of several spellings that is set.
  std::optional<Val> num(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (auto v = num(n)) return v;
    return std::nullopt;
  }
  std::optional<std::pair<std::string, std::string>> str(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (auto v = getenv_(n)) return std::make_pair(std::string(n), *v);
    return std::nullopt;
  }

 private:
  const GetEnv& getenv_;
};

// What one source found, before the overrides and checks every source shares.
struct Reading {
  std::string launcher;
  Val rank, world, local_rank, local_world, node_rank, num_nodes;
  std::optional<std::string> master_addr;  // host of rank 0, when the source knows it
  int master_port = 29500;
  bool node_major = false;  // ranks numbered node after node (torchrun): checked
};

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Unprivileged and below Linux's ephemeral range (32768+), so a port derived
// from the job id rarely collides with one the kernel hands out.
int port_from_job_id(int64_t job_id) { return 20000 + static_cast<int>(job_id % 10000); }

// Every rank of a job derives the same port from the job id; two jobs sharing a
// node rarely do. Without a job id: torchrun's default.
int job_port(const Vars& v) {
  // The job number: all of SLURM_JOB_ID (federated ids pass 2^31); the digits
  // that start PBS_JOBID ("1234567.pbs-server", "123[4].pbs-server").
  auto job_number = [](const std::string& name, const std::string& id, bool whole) {
    size_t end = 0;
    while (end < id.size() && id[end] >= '0' && id[end] <= '9') ++end;
    if (end == 0 || end > 18 || (whole && end != id.size()))
      fail(name + "='" + id + "' is not a job number");
    return std::stoll(id.substr(0, end));
  };
  if (auto id = v.str({"SLURM_JOB_ID", "SLURM_JOBID"}))
    return port_from_job_id(job_number(id->first, id->second, true));
  if (auto id = v.str("PBS_JOBID")) return port_from_job_id(job_number("PBS_JOBID", *id, false));
  return 29500;
}

// SLURM_TASKS_PER_NODE: "4(x2),3" = 4 tasks on each of 2 nodes, then 3 on one.
std::vector<std::pair<int, int>> parse_tasks_per_node(const std::string& name, const std::string& text) {
  auto bad = [&] { fail(name + "='" + text + "' is malformed (expected a list like '4(x2),3')"); };
  std::vector<std::pair<int, int>> groups;  // (tasks, number of nodes)
  size_t i = 0;
  auto digits = [&]() -> int64_t {
    size_t start = i;
    int64_t v = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      v = v * 10 + (text[i++] - '0');
      if (v > INT32_MAX) bad();
    }
    if (i == start) bad();
    return v;
  };
  if (text.empty()) bad();
  while (true) {
    int tasks = static_cast<int>(digits());
    int repeat = 1;
    if (i < text.size() && text[i] == '(') {
      if (text.compare(i, 2, "(x") != 0) bad();
      i += 2;
      repeat = static_cast<int>(digits());
      if (i >= text.size() || text[i] != ')' || repeat < 1) bad();
      ++i;
    }
    groups.emplace_back(tasks, repeat);
    if (i == text.size()) break;
    if (text[i] != ',') bad();
    ++i;
  }
  return groups;
}

std::vector<std::string> read_node_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("PBS_NODEFILE='" + path + "' cannot be read: " + std::strerror(errno));
  // PBS repeats a host once per MPI slot (mpiprocs); keep the first of each.
  std::vector<std::string> hosts;
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
    size_t start = line.find_first_not_of(" \t");
    if (start == std::string::npos) continue;
    line = line.substr(start);
    bool seen = false;
    for (const auto& h : hosts) seen = seen || h == line;
    if (!seen) hosts.push_back(line);
  }
  if (hosts.empty()) fail("PBS_NODEFILE='" + path + "' lists no hosts");
  return hosts;
}

// ---------------------------------------------------------------- the sources

// torchrun and `nnstrain launch`; also a hand-set env:// launch (RANK and WORLD_SIZE only).
std::optional<Reading> from_torchrun(const Vars& v) {
  auto rank = v.num("RANK");
  auto world = v.num("WORLD_SIZE");
  if (!rank && !world) {
    for (const char* name : {"LOCAL_RANK", "LOCAL_WORLD_SIZE"})
      if (v.has(name))
        fail(std::string(name) + " is set but RANK and WORLD_SIZE are not (torchrun sets all three)");
    return std::nullopt;
  }
  if (!world) fail("RANK is set but WORLD_SIZE is not: set both (torchrun and nnstrain launch do) or neither");
  if (!rank) fail("WORLD_SIZE is set but RANK is not: set both (torchrun and nnstrain launch do) or neither");
  Reading r;
  r.launcher = "torchrun";
  r.rank = *rank;
  r.world = *world;
  auto local_rank = v.num("LOCAL_RANK");
  auto local_world = v.num("LOCAL_WORLD_SIZE");
  if (local_rank && !local_world) fail("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not");
  if (local_world && !local_rank) fail("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not");
  if (!local_rank) {
    // A hand-set env:// launch: all ranks on this node.
    r.local_rank = derived("local_rank", r.rank.value, "RANK; LOCAL_RANK unset, one node assumed");
    r.local_world = derived("local_world_size", r.world.value, "WORLD_SIZE; LOCAL_WORLD_SIZE unset");
  } else {
    r.local_rank = *local_rank;
    r.local_world = *local_world;
  }
  if (r.world.value < 1) fail(r.world.what + " must be at least 1");
  if (r.local_world.value < 1) fail(r.local_world.what + " must be at least 1");
  if (r.local_world.value > r.world.value) fail(r.local_world.what + " is larger than " + r.world.what);

  if (auto n = v.num("GROUP_WORLD_SIZE")) {
    r.num_nodes = *n;
  } else {
    if (r.world.value % r.local_world.value != 0)
      fail(r.world.what + " is not a multiple of " + r.local_world.what +
           " (nodes with different numbers of workers need GROUP_WORLD_SIZE)");
    r.num_nodes = derived("num_nodes", r.world.value / r.local_world.value, "WORLD_SIZE / LOCAL_WORLD_SIZE");
  }
  if (auto n = v.num({"GROUP_RANK", "NODE_RANK"}))
    r.node_rank = *n;
  else
    r.node_rank = derived("node_rank", r.rank.value / r.local_world.value, "RANK / LOCAL_WORLD_SIZE");
  r.node_major = !v.has("GROUP_WORLD_SIZE");
  r.master_port = 29500;  // MASTER_ADDR / MASTER_PORT, set by torchrun, are read with the overrides
  return r;
}

// Open MPI's mpirun/mpiexec. OMPI_COMM_WORLD_NODE_RANK is not the node index
// (it counts processes on the node across jobs), so the node comes from the
// default by-slot mapping: consecutive ranks fill a node.
std::optional<Reading> from_openmpi(const Vars& v) {
  auto rank = v.num("OMPI_COMM_WORLD_RANK");
  if (!rank) return std::nullopt;
  Reading r;
  r.launcher = "openmpi";
  r.rank = *rank;
  for (auto [field, name] : {std::pair<Val*, const char*>{&r.world, "OMPI_COMM_WORLD_SIZE"},
                             {&r.local_rank, "OMPI_COMM_WORLD_LOCAL_RANK"},
                             {&r.local_world, "OMPI_COMM_WORLD_LOCAL_SIZE"}}) {
    auto val = v.num(name);
    if (!val) fail(std::string("OMPI_COMM_WORLD_RANK is set but ") + name + " is not");
    *field = *val;
  }
  if (r.local_world.value < 1) fail(r.local_world.what + " must be at least 1");
  r.node_rank = derived("node_rank", r.rank.value / r.local_world.value, "OMPI_COMM_WORLD_RANK / LOCAL_SIZE");
  r.num_nodes = derived("num_nodes", ceil_div(r.world.value, r.local_world.value),
                        "OMPI_COMM_WORLD_SIZE / LOCAL_SIZE");
  r.master_port = job_port(v);
  return r;
}

// PBS Pro with Cray PALS mpiexec (Polaris, Aurora, ...).
std::optional<Reading> from_pals(const Vars& v) {
  auto rank = v.num("PALS_RANKID");
  if (!rank) return std::nullopt;
  Reading r;
  r.launcher = "pbs";
  r.rank = *rank;
  auto local_rank = v.num({"PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"});
  if (!local_rank) fail("PALS_RANKID is set but PALS_LOCAL_RANKID is not");
  r.local_rank = *local_rank;

  std::vector<std::string> hosts;
  auto node_file = v.str("PBS_NODEFILE");
  if (node_file) hosts = read_node_file(*node_file);
  const int file_nodes = static_cast<int>(hosts.size());
  auto local_world = v.num({"PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"});
  auto world = v.num({"PALS_SIZE", "PMI_SIZE"});
  if (!local_world && world && node_file && world->value % file_nodes == 0)
    local_world = derived("local_world_size", world->value / file_nodes, "PALS_SIZE / hosts in PBS_NODEFILE");
  if (!local_world)
    fail("PALS_RANKID is set but PALS_LOCAL_SIZE is not (nor PMI_LOCAL_SIZE, nor PALS_SIZE with PBS_NODEFILE)");
  r.local_world = *local_world;
  if (r.local_world.value < 1) fail(r.local_world.what + " must be at least 1");
  if (!world) {
    if (!node_file)
      fail("PALS_RANKID is set but the world size is unknown: set PALS_SIZE, or PBS_NODEFILE with " +
           r.local_world.what);
    world = derived("world_size", file_nodes * r.local_world.value,
                    std::to_string(file_nodes) + " hosts in PBS_NODEFILE x " + r.local_world.what);
  }
  r.world = *world;
  if (node_file && !v.has("PALS_SIZE") && !v.has("PMI_SIZE"))
    r.num_nodes = derived("num_nodes", file_nodes, "hosts in PBS_NODEFILE");
  else
    r.num_nodes = derived("num_nodes", ceil_div(r.world.value, r.local_world.value), "world / local size");
  if (auto n = v.num("PALS_NODEID"))
    r.node_rank = *n;
  else  // mpiexec --ppn places ranks block by block, host after host of PBS_NODEFILE
    r.node_rank = derived("node_rank", r.rank.value / r.local_world.value, "PALS_RANKID / local size");
  if (node_file) r.master_addr = hosts.front();
  r.master_port = job_port(v);
  return r;
}

// MPICH's Hydra mpiexec (MPI_LOCALRANKID) and Cray PMI (PMI_LOCAL_RANK). Slurm's
// own PMI plugins set PMI_RANK without a local rank: then srun's variables tell more.
std::optional<Reading> from_pmi(const Vars& v) {
  auto rank = v.num("PMI_RANK");
  if (!rank) return std::nullopt;
  auto local_rank = v.num({"MPI_LOCALRANKID", "PMI_LOCAL_RANK"});
  if (!local_rank) {
    if (v.has("SLURM_PROCID")) return std::nullopt;
    fail("PMI_RANK is set but MPI_LOCALRANKID is not (nor PMI_LOCAL_RANK)");
  }
  Reading r;
  r.launcher = "pmi";
  r.rank = *rank;
  r.local_rank = *local_rank;
  auto world = v.num("PMI_SIZE");
  if (!world) fail("PMI_RANK is set but PMI_SIZE is not");
  r.world = *world;
  auto local_world = v.num({"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"});
  if (!local_world) fail("PMI_RANK is set but MPI_LOCALNRANKS is not (nor PMI_LOCAL_SIZE)");
  r.local_world = *local_world;
  if (r.local_world.value < 1) fail(r.local_world.what + " must be at least 1");
  r.node_rank = derived("node_rank", r.rank.value / r.local_world.value, "PMI_RANK / local size");
  r.num_nodes = derived("num_nodes", ceil_div(r.world.value, r.local_world.value), "PMI_SIZE / local size");
  r.master_port = job_port(v);
  return r;
}

// A task started by srun. Inside srun, SLURM_NTASKS, SLURM_NNODES and
// SLURM_TASKS_PER_NODE describe the step; the SLURM_STEP_* spellings do too
// (even under --preserve-env), so they come first.
std::optional<Reading> from_slurm(const Vars& v) {
  auto rank = v.num("SLURM_PROCID");
  if (!rank) return std::nullopt;
  Reading r;
  r.launcher = "slurm";
  r.rank = *rank;
  auto world = v.num({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  if (!world) fail("SLURM_PROCID is set but SLURM_NTASKS is not");
  r.world = *world;
  // The batch script itself has SLURM_PROCID=0 and the job's SLURM_NTASKS, but is
  // one process: started there directly, rank 0 would wait forever for the rest.
  if (r.world.value > 1 && !v.has("SLURM_STEP_ID") && !v.has("SLURM_STEPID")) {
    auto job = v.str("SLURM_JOB_ID");
    fail("SLURM_PROCID is set but SLURM_STEP_ID is not: this is the batch script of SLURM job " +
         (job ? *job : std::string("?")) + " (" + r.world.what +
         "), not a task started by srun. Start nnstrain with srun, one task per GPU "
         "(see scripts/slurm/train.sbatch)");
  }
  auto local_rank = v.num("SLURM_LOCALID");
  if (!local_rank) fail("SLURM_PROCID is set but SLURM_LOCALID is not");
  r.local_rank = *local_rank;
  auto nodes = v.num({"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
  auto node_id = v.num("SLURM_NODEID");

  if (auto list = v.str({"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    auto groups = parse_tasks_per_node(list->first, list->second);
    int64_t listed_nodes = 0, listed_tasks = 0;
    for (auto [tasks, repeat] : groups) {
      listed_nodes += repeat;
      listed_tasks += int64_t(tasks) * repeat;
    }
    const std::string what = list->first + "='" + list->second + "'";
    if (nodes && nodes->value != listed_nodes)
      fail(what + " lists " + std::to_string(listed_nodes) + " nodes but " + nodes->what);
    if (listed_tasks != r.world.value)
      fail(what + " adds up to " + std::to_string(listed_tasks) + " tasks but " + r.world.what);
    if (!nodes) nodes = derived("num_nodes", static_cast<int>(listed_nodes), "entries of " + list->first);
    if (!node_id) {
      // Block distribution (srun's default): find the node whose tasks hold this rank.
      if (r.rank.value >= r.world.value) fail(r.rank.what + " is not below " + r.world.what);
      int64_t first = 0, node = 0;
      bool found = false;
      for (auto [tasks, repeat] : groups) {
        for (int k = 0; k < repeat && !found; ++k) {
          if (r.rank.value < first + tasks) {
            found = true;
          } else {
            first += tasks;
            ++node;
          }
        }
        if (found) break;
      }
      node_id = derived("node_rank", static_cast<int>(node), "SLURM_PROCID within " + list->first);
    }
    if (node_id->value >= listed_nodes)
      fail(node_id->what + " is past the " + std::to_string(listed_nodes) + " nodes of " + what);
    int64_t index = node_id->value;
    for (auto [tasks, repeat] : groups) {
      if (index < repeat) {
        r.local_world = {tasks, what + " for node " + std::to_string(node_id->value)};
        break;
      }
      index -= repeat;
    }
  } else if (auto per_node = v.num("SLURM_NTASKS_PER_NODE")) {
    r.local_world = *per_node;
  } else if (nodes && nodes->value > 0 && r.world.value % nodes->value == 0) {
    r.local_world = derived("local_world_size", r.world.value / nodes->value, r.world.what + " / " + nodes->what);
  } else {
    fail("SLURM_PROCID is set but SLURM_TASKS_PER_NODE is not (nor SLURM_NTASKS_PER_NODE)");
  }
  if (r.local_world.value < 1) fail(r.local_world.what + " must be at least 1");
  if (!nodes) nodes = derived("num_nodes", ceil_div(r.world.value, r.local_world.value), "tasks / tasks per node");
  if (!node_id) node_id = derived("node_rank", r.rank.value / r.local_world.value, "SLURM_PROCID / tasks per node");
  r.num_nodes = *nodes;
  r.node_rank = *node_id;

  if (auto list = v.str({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})) {
    try {
      r.master_addr = slurm_first_host(list->second);
    } catch (const DistEnvError& e) {
      fail(list->first + ": " + e.what());
    }
  }
  r.master_port = job_port(v);
  return r;
}

void check(const Reading& r) {
  if (r.world.value < 1) fail(r.world.what + " must be at least 1");
  if (r.rank.value >= r.world.value) fail(r.rank.what + " is not below " + r.world.what);
  if (r.local_world.value < 1) fail(r.local_world.what + " must be at least 1");
  if (r.local_rank.value >= r.local_world.value) fail(r.local_rank.what + " is not below " + r.local_world.what);
  if (r.local_world.value > r.world.value) fail(r.local_world.what + " is larger than " + r.world.what);
  if (r.num_nodes.value < 1) fail(r.num_nodes.what + " must be at least 1");
  if (r.num_nodes.value > r.world.value) fail(r.num_nodes.what + " is larger than " + r.world.what);
  if (r.node_rank.value >= r.num_nodes.value) fail(r.node_rank.what + " is not below " + r.num_nodes.what);
  if (r.node_major && int64_t(r.node_rank.value) * r.local_world.value + r.local_rank.value != r.rank.value)
    fail(r.rank.what + " does not match " + r.node_rank.what + " x " + r.local_world.what + " + " +
         r.local_rank.what);
}

}  // namespace

DistEnv read_dist_env(const GetEnv& getenv) {
  const Vars v(getenv);
  std::optional<Reading> r;
  for (auto source : {from_torchrun, from_openmpi, from_pals, from_pmi, from_slurm})
    if ((r = source(v))) break;

  DistEnv env;
  if (r) {
    check(*r);
    env.launcher = r->launcher;
    env.rank = r->rank.value;
    env.world_size = r->world.value;
    env.local_rank = r->local_rank.value;
    env.local_world_size = r->local_world.value;
    env.node_rank = r->node_rank.value;
    env.num_nodes = r->num_nodes.value;
    env.master_port = r->master_port;
  }
  if (auto addr = v.str("MASTER_ADDR")) {
    if (addr->empty()) fail("MASTER_ADDR is set but empty");
    env.master_addr = *addr;
  } else if (r && r->master_addr) {
    env.master_addr = *r->master_addr;
  } else if (env.num_nodes > 1) {
    fail("MASTER_ADDR is not set and " + r->launcher + " does not say which host runs rank 0 of " +
         std::to_string(env.num_nodes) + " nodes: export MASTER_ADDR=<that host>");
  }
  if (auto port = v.str("MASTER_PORT")) {
    int64_t p = parse_digits("MASTER_PORT", *port);
    if (p < 1 || p > 65535) fail("MASTER_PORT='" + *port + "' is not a TCP port (1-65535)");
    env.master_port = static_cast<int>(p);
  }
  return env;
}

DistEnv read_dist_env() {
  return read_dist_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

std::string slurm_first_host(const std::string& nodelist) {
  auto bad = [&](const std::string& why) {
    fail("malformed SLURM nodelist '" + nodelist + "': " + why);
  };
  if (nodelist.empty()) bad("empty");
  std::string first, host;
  bool have_first = false, entry_empty = true;
  const size_t n = nodelist.size();
  for (size_t i = 0;;) {
    if (i == n || nodelist[i] == ',') {
      if (entry_empty) bad(i == 0 ? "starts with ','" : i == n ? "ends with ','" : "empty entry ',,'");
      if (!have_first) first = host, have_first = true;
      host.clear();
      entry_empty = true;
      if (i == n) break;
      ++i;
      continue;
    }
    const char c = nodelist[i];
    if (c == '[') {
      size_t close = nodelist.find(']', i);
      if (close == std::string::npos) bad("'[' without ']'");
      const std::string body = nodelist.substr(i + 1, close - i - 1);
      if (body.find('[') != std::string::npos) bad("nested '['");
      if (body.empty()) bad("empty '[]'");
      // "01-04,07": every range is checked; the first number is the first host.
      std::string first_number;
      size_t start = 0;
      while (start <= body.size()) {
        size_t end = body.find(',', start);
        if (end == std::string::npos) end = body.size();
        const std::string range = body.substr(start, end - start);
        const size_t dash = range.find('-');
        const std::string lo = range.substr(0, dash);
        const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
        auto numeric = [](const std::string& s) {
          return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
        };
        if (!numeric(lo) || !numeric(hi)) bad("'" + range + "' is not a number or a range like 01-04");
        if (std::stol(lo) > std::stol(hi)) bad("range '" + range + "' runs backwards");
        if (first_number.empty()) first_number = lo;
        start = end + 1;
      }
      host += first_number;
      entry_empty = false;
      i = close + 1;
      continue;
    }
    if (c == ']') bad("']' without '['");
    if (c == ' ' || c == '\t' || c == '\n') bad("whitespace in a host name");
    host += c;
    entry_empty = false;
    ++i;
  }
  return first;
}

std::string to_json(const DistEnv& env) {
  nlohmann::ordered_json j;
  j["launcher"] = env.launcher;
  j["rank"] = env.rank;
  j["world_size"] = env.world_size;
  j["local_rank"] = env.local_rank;
  j["local_world_size"] = env.local_world_size;
  j["node_rank"] = env.node_rank;
  j["num_nodes"] = env.num_nodes;
  j["master_addr"] = env.master_addr;
  j["master_port"] = env.master_port;
  return j.dump();
}

}  // namespace nnstrain::dist
