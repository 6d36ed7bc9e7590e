// DistEnv from each launcher's variables, through a fake environment.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "trainer/dist/dist_env.h"
#include "trainer/dist/env_command.h"

using nnstrain::dist::DistEnv;
using nnstrain::dist::DistEnvError;
using nnstrain::dist::read_dist_env;
using nnstrain::dist::slurm_first_host;
using Vars = std::map<std::string, std::string>;
using Catch::Matchers::Contains;

namespace {

DistEnv read(const Vars& vars) {
  return read_dist_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// The message of the DistEnvError `vars` must raise.
std::string error_of(const Vars& vars) {
  try {
    read(vars);
  } catch (const DistEnvError& e) {
    return e.what();
  }
  FAIL("no DistEnvError");
  return "";
}

std::string temp_file(const std::string& name, const std::string& text) {
  std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/nnstrain_dist_" +
                     std::to_string(::getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

Vars torchrun(int rank, int world, int local_rank, int local_world, int group_rank) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
          {"GROUP_RANK", std::to_string(group_rank)},
          {"MASTER_ADDR", "node7"},
          {"MASTER_PORT", "31337"}};
}

// What srun sets for task `rank` of `nodes` x `per_node` tasks on gpu-[01-..].
Vars srun_task(int rank, int nodes, int per_node) {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", std::to_string(nodes * per_node)},
          {"SLURM_LOCALID", std::to_string(rank % per_node)},
          {"SLURM_NODEID", std::to_string(rank / per_node)},
          {"SLURM_NNODES", std::to_string(nodes)},
          {"SLURM_TASKS_PER_NODE", std::to_string(per_node) + "(x" + std::to_string(nodes) + ")"},
          {"SLURM_JOB_NODELIST", "gpu-[01-0" + std::to_string(nodes) + "]"}};
}

}  // namespace

TEST_CASE("nothing set is a single process", "[dist]") {
  DistEnv e = read({{"HOME", "/root"}, {"SLURM_JOB_ID", "12"}, {"SLURM_NTASKS", "4"}});
  CHECK(e.launcher == "none");
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);
  CHECK(e.local_rank == 0);
  CHECK(e.local_world_size == 1);
  CHECK(e.num_nodes == 1);
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port == 29500);
}

TEST_CASE("torchrun variables", "[dist]") {
  DistEnv e = read(torchrun(6, 8, 2, 4, 1));
  CHECK(e.launcher == "torchrun");
  CHECK(e.rank == 6);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 2);
  CHECK(e.local_world_size == 4);
  CHECK(e.node_rank == 1);
  CHECK(e.num_nodes == 2);
  CHECK(e.master_addr == "node7");
  CHECK(e.master_port == 31337);

  SECTION("NODE_RANK stands in for GROUP_RANK, and without either the node is derived") {
    Vars v = torchrun(6, 8, 2, 4, 1);
    v.erase("GROUP_RANK");
    CHECK(read(v).node_rank == 1);
    v["NODE_RANK"] = "1";
    CHECK(read(v).node_rank == 1);
  }
  SECTION("a hand-set env:// launch (RANK and WORLD_SIZE only) is one node") {
    DistEnv m = read({{"RANK", "1"}, {"WORLD_SIZE", "3"}});
    CHECK(m.rank == 1);
    CHECK(m.local_rank == 1);
    CHECK(m.local_world_size == 3);
    CHECK(m.num_nodes == 1);
    CHECK(m.master_addr == "127.0.0.1");
    CHECK(m.master_port == 29500);
  }
}

TEST_CASE("torchrun inside a SLURM allocation: RANK wins", "[dist]") {
  Vars v = srun_task(1, 2, 1);
  for (auto& [k, val] : torchrun(5, 8, 1, 4, 1)) v[k] = val;
  DistEnv e = read(v);
  CHECK(e.launcher == "torchrun");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.master_addr == "node7");
}

TEST_CASE("SLURM srun variables", "[dist]") {
  DistEnv e = read(srun_task(5, 2, 4));
  CHECK(e.launcher == "slurm");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.node_rank == 1);
  CHECK(e.num_nodes == 2);
  CHECK(e.master_addr == "gpu-01");
  CHECK(e.master_port == 20000 + 4242);
  // Every task of the job agrees on the rendezvous.
  for (int r = 0; r < 8; ++r) {
    DistEnv t = read(srun_task(r, 2, 4));
    CHECK(t.master_addr == e.master_addr);
    CHECK(t.master_port == e.master_port);
    CHECK(t.node_rank * 4 + t.local_rank == r);
  }

  SECTION("the port follows the job id, in an unprivileged range below the ephemeral ports") {
    Vars v = srun_task(0, 2, 4);
    v["SLURM_JOB_ID"] = "987654321";
    int port = read(v).master_port;
    CHECK(port == 20000 + 4321);
    v["SLURM_JOB_ID"] = "987654322";
    CHECK(read(v).master_port == port + 1);
    v["SLURM_JOB_ID"] = "67158001234";  // federated job ids pass 2^31
    CHECK(read(v).master_port == 21234);
  }
  SECTION("MASTER_ADDR and MASTER_PORT override the derived ones") {
    Vars v = srun_task(0, 2, 4);
    v["MASTER_ADDR"] = "gpu-01-ib";
    v["MASTER_PORT"] = "40000";
    DistEnv o = read(v);
    CHECK(o.master_addr == "gpu-01-ib");
    CHECK(o.master_port == 40000);
  }
  SECTION("uneven nodes: the local size is this node's entry of SLURM_TASKS_PER_NODE") {
    Vars v = srun_task(0, 3, 1);
    v["SLURM_NTASKS"] = "7";
    v["SLURM_TASKS_PER_NODE"] = "3(x2),1";
    v["SLURM_PROCID"] = "6";
    v["SLURM_LOCALID"] = "0";
    v["SLURM_NODEID"] = "2";
    DistEnv u = read(v);
    CHECK(u.local_world_size == 1);
    CHECK(u.node_rank == 2);
    v.erase("SLURM_NODEID");  // derived from the block layout instead
    v["SLURM_PROCID"] = "4";
    v["SLURM_LOCALID"] = "1";
    u = read(v);
    CHECK(u.node_rank == 1);
    CHECK(u.local_world_size == 3);
  }
  SECTION("the step's variables win over the job's") {
    Vars v = srun_task(1, 1, 2);
    v["SLURM_STEP_NUM_TASKS"] = "2";
    v["SLURM_NTASKS"] = "16";  // --preserve-env keeps the job's count
    v["SLURM_STEP_TASKS_PER_NODE"] = "2";
    v["SLURM_TASKS_PER_NODE"] = "8(x2)";
    v["SLURM_STEP_NUM_NODES"] = "1";
    v["SLURM_NNODES"] = "2";
    v["SLURM_STEP_NODELIST"] = "gpu-02";
    DistEnv s = read(v);
    CHECK(s.world_size == 2);
    CHECK(s.local_world_size == 2);
    CHECK(s.num_nodes == 1);
    CHECK(s.master_addr == "gpu-02");
  }
  SECTION("SLURM_NTASKS_PER_NODE when there is no per-node list") {
    Vars v = srun_task(3, 2, 2);
    v.erase("SLURM_TASKS_PER_NODE");
    v["SLURM_NTASKS_PER_NODE"] = "2";
    DistEnv s = read(v);
    CHECK(s.local_world_size == 2);
    CHECK(s.node_rank == 1);
  }
  SECTION("SLURM_NODELIST when SLURM_JOB_NODELIST is missing") {
    Vars v = srun_task(0, 2, 4);
    v.erase("SLURM_JOB_NODELIST");
    v["SLURM_NODELIST"] = "cn[100-101]";
    CHECK(read(v).master_addr == "cn100");
  }
}

TEST_CASE("PBS with PALS mpiexec", "[dist]") {
  // PBS repeats a host once per MPI slot.
  std::string nodes = temp_file("nodefile", "x1000c0s0b0n0.hsn\nx1000c0s0b0n0.hsn\nx1000c0s1b0n0.hsn\n"
                                            "x1000c0s1b0n0.hsn\nx1000c0s2b0n0.hsn\n");
  Vars v = {{"PBS_JOBID", "123456.pbs-server"}, {"PBS_NODEFILE", nodes},  {"PALS_RANKID", "7"},
            {"PALS_LOCAL_RANKID", "3"},        {"PALS_LOCAL_SIZE", "4"}, {"PALS_NODEID", "1"}};
  DistEnv e = read(v);
  CHECK(e.launcher == "pbs");
  CHECK(e.rank == 7);
  CHECK(e.world_size == 12);  // 3 hosts x 4
  CHECK(e.local_rank == 3);
  CHECK(e.local_world_size == 4);
  CHECK(e.node_rank == 1);
  CHECK(e.num_nodes == 3);
  CHECK(e.master_addr == "x1000c0s0b0n0.hsn");
  CHECK(e.master_port == 20000 + 3456);

  SECTION("PALS_SIZE gives the world size; the node comes from the rank without PALS_NODEID") {
    v["PALS_SIZE"] = "8";
    v.erase("PALS_NODEID");
    DistEnv s = read(v);
    CHECK(s.world_size == 8);
    CHECK(s.num_nodes == 2);
    CHECK(s.node_rank == 1);
  }
  SECTION("Cray PMI's local size stands in for PALS_LOCAL_SIZE") {
    v.erase("PALS_LOCAL_SIZE");
    v["PMI_LOCAL_SIZE"] = "4";
    v["PMI_RANK"] = "7";
    v["PMI_SIZE"] = "12";
    DistEnv s = read(v);
    CHECK(s.launcher == "pbs");
    CHECK(s.world_size == 12);
  }
  SECTION("an unreadable node file is named") {
    v["PBS_NODEFILE"] = "/nonexistent/nodefile";
    CHECK_THAT(error_of(v), Contains("PBS_NODEFILE='/nonexistent/nodefile' cannot be read"));
  }
  SECTION("a PBS_JOBID without a job number") {
    v["PBS_JOBID"] = "pbs-server";
    CHECK_THAT(error_of(v), Contains("PBS_JOBID='pbs-server' is not a job number"));
  }
  SECTION("no world size at all") {
    v.erase("PBS_NODEFILE");
    CHECK_THAT(error_of(v), Contains("PALS_SIZE"));
  }
  std::remove(nodes.c_str());
}

TEST_CASE("Open MPI mpirun variables", "[dist]") {
  Vars v = {{"OMPI_COMM_WORLD_RANK", "5"},       {"OMPI_COMM_WORLD_SIZE", "8"},
            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
            {"OMPI_COMM_WORLD_NODE_RANK", "1"},  {"MASTER_ADDR", "head"}};
  DistEnv e = read(v);
  CHECK(e.launcher == "openmpi");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.node_rank == 1);
  CHECK(e.num_nodes == 2);
  CHECK(e.master_addr == "head");
  CHECK(e.master_port == 29500);

  SECTION("mpirun inside a SLURM batch script: mpirun's ranks, not the batch step's") {
    Vars s = v;
    for (auto& [k, val] : srun_task(0, 2, 4)) s[k] = val;
    s.erase("SLURM_STEP_ID");
    DistEnv m = read(s);
    CHECK(m.launcher == "openmpi");
    CHECK(m.rank == 5);
    CHECK(m.master_port == 20000 + 4242);
  }
  SECTION("one node needs no MASTER_ADDR") {
    Vars s = {{"OMPI_COMM_WORLD_RANK", "1"},
              {"OMPI_COMM_WORLD_SIZE", "2"},
              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
    CHECK(read(s).master_addr == "127.0.0.1");
  }
  SECTION("several nodes do") {
    v.erase("MASTER_ADDR");
    CHECK_THAT(error_of(v), Contains("MASTER_ADDR is not set") && Contains("openmpi") && Contains("2 nodes"));
  }
}

TEST_CASE("PMI (MPICH Hydra, Intel MPI) variables", "[dist]") {
  Vars v = {{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}};
  v["MASTER_ADDR"] = "n0";
  DistEnv e = read(v);
  CHECK(e.launcher == "pmi");
  CHECK(e.rank == 3);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.node_rank == 1);
  CHECK(e.num_nodes == 2);
  CHECK(e.master_addr == "n0");

  SECTION("srun --mpi=pmi2 sets PMI_RANK without a local rank: srun's variables are used") {
    Vars s = srun_task(2, 2, 2);
    s["PMI_RANK"] = "2";
    s["PMI_SIZE"] = "4";
    DistEnv m = read(s);
    CHECK(m.launcher == "slurm");
    CHECK(m.local_rank == 0);
  }
  SECTION("without SLURM, a missing local rank is an error") {
    CHECK_THAT(error_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}}), Contains("MPI_LOCALRANKID"));
  }
}

TEST_CASE("SLURM nodelists: the first host", "[dist]") {
  CHECK(slurm_first_host("gpu-[01-04,07],cpu3") == "gpu-01");
  CHECK(slurm_first_host("a[1-2]-ib") == "a1-ib");
  CHECK(slurm_first_host("n1,n2") == "n1");
  CHECK(slurm_first_host("localhost") == "localhost");
  CHECK(slurm_first_host("node[007]") == "node007");
  CHECK(slurm_first_host("rack[3-4]-node[10-12]") == "rack3-node10");
  CHECK(slurm_first_host("gpu[12,03-05]") == "gpu12");
  CHECK(slurm_first_host("cpu3,gpu-[01-04]") == "cpu3");
  CHECK(slurm_first_host("x1000c0s0b0n0.hsn.cm.example.org") == "x1000c0s0b0n0.hsn.cm.example.org");

  for (const char* bad : {"", "gpu-[01-04", "gpu-01-04]", "gpu[]", "gpu[a-b]", "gpu[04-01]", "gpu[1-]",
                          "gpu[1,,2]", "n1,,n2", ",n1", "n1,", "gpu[1-[2]]", "n 1"}) {
    INFO("nodelist '" << bad << "'");
    CHECK_THROWS_WITH(slurm_first_host(bad), Contains("malformed SLURM nodelist"));
  }
}

TEST_CASE("partial or contradictory variables are errors that name them", "[dist]") {
  struct Case {
    Vars vars;
    std::vector<std::string> expect;
  };
  Vars big_slurm = srun_task(0, 2, 4);
  auto slurm_with = [&](const std::string& k, const std::string& v) {
    Vars s = big_slurm;
    if (v.empty())
      s.erase(k);
    else
      s[k] = v;
    return s;
  };
  std::vector<Case> cases = {
      {{{"RANK", "0"}}, {"RANK is set but WORLD_SIZE is not"}},
      {{{"WORLD_SIZE", "2"}}, {"WORLD_SIZE is set but RANK is not"}},
      {{{"LOCAL_RANK", "0"}}, {"LOCAL_RANK is set but RANK and WORLD_SIZE are not"}},
      {{{"RANK", "abc"}, {"WORLD_SIZE", "2"}}, {"RANK='abc' is not a non-negative integer"}},
      {{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, {"RANK='-1'"}},
      {{{"RANK", "0"}, {"WORLD_SIZE", ""}}, {"WORLD_SIZE is set but empty"}},
      {{{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}, {"WORLD_SIZE='99999999999' is out of range"}},
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, {"RANK=2 is not below WORLD_SIZE=2"}},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0 must be at least 1"}},
      {torchrun(1, 4, 2, 2, 0), {"LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"}},
      {torchrun(1, 4, 1, 8, 0), {"LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"}},
      {torchrun(1, 4, 1, 3, 0), {"WORLD_SIZE=4 is not a multiple of LOCAL_WORLD_SIZE=3"}},
      {torchrun(1, 4, 0, 2, 0), {"RANK=1 does not match GROUP_RANK=0", "LOCAL_RANK=0"}},
      {torchrun(3, 4, 1, 2, 2), {"GROUP_RANK=2 is not below num_nodes=2"}},
      {[] {
         Vars t = torchrun(0, 4, 0, 2, 0);
         t.erase("LOCAL_WORLD_SIZE");
         return t;
       }(),
       {"LOCAL_RANK is set but LOCAL_WORLD_SIZE is not"}},
      {[] {
         Vars t = torchrun(0, 4, 0, 2, 0);
         t.erase("MASTER_ADDR");
         return t;
       }(),
       {"MASTER_ADDR is not set", "2 nodes"}},
      {[] {
         Vars t = torchrun(0, 4, 0, 2, 0);
         t["MASTER_PORT"] = "70000";
         return t;
       }(),
       {"MASTER_PORT='70000' is not a TCP port"}},
      {[] {
         Vars t = torchrun(0, 4, 0, 2, 0);
         t["MASTER_PORT"] = "http";
         return t;
       }(),
       {"MASTER_PORT='http'"}},
      {[] {
         Vars t = torchrun(0, 4, 0, 2, 0);
         t["MASTER_ADDR"] = "";
         return t;
       }(),
       {"MASTER_ADDR is set but empty"}},
      {slurm_with("SLURM_NTASKS", ""), {"SLURM_PROCID is set but SLURM_NTASKS is not"}},
      {slurm_with("SLURM_LOCALID", ""), {"SLURM_PROCID is set but SLURM_LOCALID is not"}},
      {slurm_with("SLURM_PROCID", "8"), {"SLURM_PROCID=8 is not below SLURM_NTASKS=8"}},
      {slurm_with("SLURM_PROCID", "x1"), {"SLURM_PROCID='x1'"}},
      {slurm_with("SLURM_LOCALID", "4"), {"SLURM_LOCALID=4 is not below", "SLURM_TASKS_PER_NODE='4(x2)'"}},
      {slurm_with("SLURM_NODEID", "2"), {"SLURM_NODEID=2 is past the 2 nodes"}},
      {slurm_with("SLURM_TASKS_PER_NODE", "4(x"), {"SLURM_TASKS_PER_NODE='4(x' is malformed"}},
      {slurm_with("SLURM_TASKS_PER_NODE", "4(x3)"), {"lists 3 nodes but SLURM_NNODES=2"}},
      {slurm_with("SLURM_TASKS_PER_NODE", "3,4"), {"adds up to 7 tasks but SLURM_NTASKS=8"}},
      {slurm_with("SLURM_JOB_NODELIST", "gpu-[01-02"), {"SLURM_JOB_NODELIST", "malformed SLURM nodelist"}},
      {slurm_with("SLURM_JOB_ID", "12ab"), {"SLURM_JOB_ID='12ab' is not a job number"}},
      {slurm_with("SLURM_STEP_ID", ""), {"SLURM_STEP_ID is not", "batch script of SLURM job 4242", "srun"}},
      {[&] {
         Vars s = slurm_with("SLURM_TASKS_PER_NODE", "");
         s.erase("SLURM_NNODES");
         return s;
       }(),
       {"SLURM_TASKS_PER_NODE is not"}},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       {"OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_LOCAL_RANK is not"}},
      {{{"PALS_RANKID", "0"}, {"PALS_LOCAL_SIZE", "4"}}, {"PALS_RANKID is set but PALS_LOCAL_RANKID is not"}},
      {{{"PMI_RANK", "0"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "1"}},
       {"PMI_RANK is set but PMI_SIZE is not"}},
  };
  for (const auto& c : cases) {
    std::string message = error_of(c.vars);
    for (const auto& want : c.expect) {
      INFO("message: " << message);
      CHECK_THAT(message, Contains(want));
    }
  }
}

TEST_CASE("to_json is one line with every field", "[dist]") {
  DistEnv e = read(srun_task(5, 2, 4));
  std::string line = nnstrain::dist::to_json(e);
  CHECK(line.find('\n') == std::string::npos);
  auto j = nlohmann::json::parse(line);
  CHECK(j.at("launcher") == "slurm");
  CHECK(j.at("rank") == 5);
  CHECK(j.at("world_size") == 8);
  CHECK(j.at("local_rank") == 1);
  CHECK(j.at("local_world_size") == 4);
  CHECK(j.at("node_rank") == 1);
  CHECK(j.at("num_nodes") == 2);
  CHECK(j.at("master_addr") == "gpu-01");
  CHECK(j.at("master_port") == 24242);
}

TEST_CASE("nnstrain env prints the process's DistEnv, or the error with status 2", "[dist]") {
  // torchrun's variables win over anything else in this process's environment.
  const Vars set = {{"RANK", "3"},        {"WORLD_SIZE", "4"},         {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},    {"MASTER_ADDR", "10.1.2.3"},
                    {"MASTER_PORT", "23456"}};
  std::map<std::string, std::optional<std::string>> saved;
  for (const auto& [k, v] : set) {
    const char* old = std::getenv(k.c_str());
    saved[k] = old ? std::optional<std::string>(old) : std::nullopt;
    setenv(k.c_str(), v.c_str(), 1);
  }
  std::ostringstream out, err;
  auto* old_out = std::cout.rdbuf(out.rdbuf());
  auto* old_err = std::cerr.rdbuf(err.rdbuf());
  int ok = nnstrain::dist::env_main({});
  setenv("RANK", "abc", 1);
  int bad = nnstrain::dist::env_main({});
  int extra = nnstrain::dist::env_main({"--frobnicate"});
  std::cout.rdbuf(old_out);
  std::cerr.rdbuf(old_err);
  for (const auto& [k, v] : saved) v ? setenv(k.c_str(), v->c_str(), 1) : unsetenv(k.c_str());

  CHECK(ok == 0);
  std::string first_line = out.str().substr(0, out.str().find('\n'));
  auto j = nlohmann::json::parse(first_line);
  CHECK(j.at("rank") == 3);
  CHECK(j.at("world_size") == 4);
  CHECK(j.at("node_rank") == 1);
  CHECK(j.at("master_addr") == "10.1.2.3");
  CHECK(j.at("master_port") == 23456);
  CHECK(bad == 2);
  CHECK_THAT(err.str(), Contains("nnstrain env: RANK='abc' is not a non-negative integer"));
  CHECK(extra == 2);
  CHECK_THAT(err.str(), Contains("--frobnicate"));
}
