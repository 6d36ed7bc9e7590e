// Helpers shared by the LibTorch unit tests: temporary folders, running a
// program or the reference Python, without a shell.
#pragma once

#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ftw.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace nnstrain::testing {

// POSIX rather than std::filesystem: libtorch.so's exported remove_all interposes
// on libstdc++'s and crashes (pytorch#133437).
inline int remove_entry(const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }

struct TempDir {
  std::string path;
  explicit TempDir(const std::string& tag = "nnstrain") {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + tag + "_XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() { ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string file(const std::string& name) const { return *this / name; }
};

inline bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

// argv[0] args..., without a shell, as one process (launch variables dropped),
// with OMP_NUM_THREADS=1; returns the exit status (128 + signal if killed).
inline int run(const std::vector<std::string>& args) {
  std::vector<std::string> a = args;
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s = {"OMP_NUM_THREADS=1"};
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "OMP_NUM_THREADS=", 16) != 0 && std::strncmp(*e, "RANK=", 5) != 0 &&
        std::strncmp(*e, "WORLD_SIZE=", 11) != 0)
      env_s.push_back(*e);
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) == 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The reference Python (NNSTRAIN_PYTHON) on an inline script.
inline int python(const std::string& script, const std::vector<std::string>& args) {
  std::vector<std::string> a = {NNSTRAIN_PYTHON, "-c", script};
  a.insert(a.end(), args.begin(), args.end());
  return run(a);
}

// The reference Python on a script file.
inline int python_file(const std::string& script, const std::vector<std::string>& args) {
  std::vector<std::string> a = {NNSTRAIN_PYTHON, script};
  a.insert(a.end(), args.begin(), args.end());
  return run(a);
}

// max |got - want| / max |want|: one number per tensor, insensitive to tiny entries.
inline double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  REQUIRE(got.sizes() == want.sizes());
  const double scale = want.abs().max().item<double>();
  const double diff = (got.to(torch::kFloat64) - want.to(torch::kFloat64)).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

}  // namespace nnstrain::testing
