// Load balance of context-parallel attention (issue 22): each rank's time in
// the attention forward + backward, causal, zigzag against contiguous, ranks as
// threads of this process over Gloo (one in-memory store), one intra-op thread
// each. A rank's time is its thread's CPU time (CLOCK_THREAD_CPUTIME_ID): what
// it computed, not the time it slept waiting for a peer's block, so the figure
// holds on a machine with fewer cores than ranks. Baseline, measured in the same
// run: one rank doing the whole sequence's attention (the ideal per-rank time
// is that / cp).
//
//   cmake --build build --target nnstrain_bench_cp
//   build/nnstrain_bench_cp [--cp 4] [--seq 4096] [--heads 8] [--kv-heads 2] [--dim 64]
//                           [--repeats 3] [--comm p2p|all_gather] [--out bench/results] [--commit SHA]
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "models/common/context_attention.h"
#include "trainer/state/context_parallel.h"

using namespace nnstrain;
using models::common::CpAttentionOptions;
using models::common::CpCommType;
using models::common::CpLayout;

namespace {

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Args {
  int cp = 4, repeats = 3;
  int64_t seq = 4096, heads = 8, kv_heads = 2, dim = 64;
  std::string comm = "p2p", out = "bench/results", commit = "unknown";
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Per rank, per repeat: thread CPU seconds and wall seconds of forward + backward.
struct Timing {
  std::vector<std::vector<double>> cpu, wall;  // [rank][repeat]
};

Timing run_cp(const Args& a, CpLayout layout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& g) {
  static int job = 0;
  auto store = c10::make_intrusive<c10d::PrefixStore>("bench" + std::to_string(job++),
                                                      c10::make_intrusive<c10d::HashStore>());
  Timing t;
  t.cpu.assign(a.cp, {});
  t.wall.assign(a.cp, {});
  std::vector<std::string> errors(a.cp);
  std::vector<std::thread> threads;
  for (int r = 0; r < a.cp; ++r)
    threads.emplace_back([&, r] {
      try {
        at::set_num_threads(1);
        dist::DistEnv env;
        env.rank = r;
        env.world_size = a.cp;
        dist::RuntimeOptions ro;
        ro.cp = a.cp;
        ro.backend = "gloo";
        ro.timeout = std::chrono::minutes(10);
        dist::Runtime rt(env, ro, store);
        auto comm = parallel::make_cp_comm(rt);
        CpAttentionOptions opt;
        opt.comm_type = models::common::parse_cp_comm_type(a.comm);
        opt.layout = layout;
        auto shard = [&](const at::Tensor& x) { return models::common::cp_shard(x, 2, a.cp, r, layout).contiguous(); };
        auto gl = shard(g);
        for (int rep = 0; rep <= a.repeats; ++rep) {  // repeat 0 warms up
          auto ql = shard(q).requires_grad_(), kl = shard(k).requires_grad_(), vl = shard(v).requires_grad_();
          auto barrier = [&] { rt.barrier("bench barrier"); };
          barrier();
          const double c0 = thread_cpu_s(), w0 = wall_s();
          auto out = models::common::context_parallel_attention(ql, kl, vl, true, comm, opt);
          out.backward(gl);
          const double c1 = thread_cpu_s(), w1 = wall_s();
          if (rep > 0) {
            t.cpu[r].push_back(c1 - c0);
            t.wall[r].push_back(w1 - w0);
          }
          barrier();
        }
        rt.shutdown();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (int r = 0; r < a.cp; ++r)
    if (!errors[r].empty()) throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
  return t;
}

std::string now_utc(const char* fmt) {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, fmt, std::gmtime(&t));
  return buf;
}

std::string read_first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--cp") a.cp = std::stoi(v);
    else if (k == "--seq") a.seq = std::stoll(v);
    else if (k == "--heads") a.heads = std::stoll(v);
    else if (k == "--kv-heads") a.kv_heads = std::stoll(v);
    else if (k == "--dim") a.dim = std::stoll(v);
    else if (k == "--repeats") a.repeats = std::stoi(v);
    else if (k == "--comm") a.comm = v;
    else if (k == "--out") a.out = v;
    else if (k == "--commit") a.commit = v;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  at::set_num_threads(1);
  auto gen = at::detail::createCPUGenerator(1);
  auto q = at::randn({1, a.heads, a.seq, a.dim}, gen), k = at::randn({1, a.kv_heads, a.seq, a.dim}, gen),
       v = at::randn({1, a.kv_heads, a.seq, a.dim}, gen), g = at::randn({1, a.heads, a.seq, a.dim}, gen);

  // Baseline: the whole sequence on one rank (the same kernel, no ring).
  std::vector<double> single;
  for (int rep = 0; rep <= a.repeats; ++rep) {
    auto qf = q.clone().requires_grad_(), kf = k.clone().requires_grad_(), vf = v.clone().requires_grad_();
    const double c0 = thread_cpu_s();
    auto out = at::scaled_dot_product_attention(qf, kf, vf, {}, 0.0, true, std::nullopt, a.heads != a.kv_heads);
    out.backward(g);
    if (rep > 0) single.push_back(thread_cpu_s() - c0);
  }
  const double single_s = median(single);

  struct Row {
    std::string layout;
    std::vector<double> cpu, wall;  // per rank, median over repeats
    double busiest, idlest, ratio;
  };
  std::vector<Row> rows;
  for (auto layout : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    auto t = run_cp(a, layout, q, k, v, g);
    Row row;
    row.layout = layout == CpLayout::Zigzag ? "zigzag" : "contiguous";
    for (int r = 0; r < a.cp; ++r) {
      row.cpu.push_back(median(t.cpu[r]));
      row.wall.push_back(median(t.wall[r]));
    }
    row.busiest = *std::max_element(row.cpu.begin(), row.cpu.end());
    row.idlest = *std::min_element(row.cpu.begin(), row.cpu.end());
    row.ratio = row.busiest / row.idlest;
    rows.push_back(row);
  }

  const std::string stamp = now_utc("%Y%m%d-%H%M%S"), when = now_utc("%Y-%m-%d %H:%M UTC");
  const std::string load = read_first_line("/proc/loadavg");
  std::ostringstream md, js;
  md << std::fixed << std::setprecision(3);
  md << "# Context-parallel attention load balance on CPU (" << when << ")\n\n"
     << "- LibTorch " << TORCH_VERSION << "; commit " << a.commit << "; load average " << load << "\n"
     << "- causal attention forward + backward, B 1, " << a.heads << " query heads, " << a.kv_heads
     << " KV heads, head dim " << a.dim << ", sequence " << a.seq << ", fp32; cp " << a.cp << ", cp_comm_type "
     << a.comm << "; ranks as threads over Gloo (loopback), 1 intra-op thread each; median of " << a.repeats
     << " repeats after 1 warm-up\n"
     << "- a rank's time = its thread's CPU seconds over forward + backward (compute, not waits for peers)\n"
     << "- baseline, same run: one rank, whole sequence (at::scaled_dot_product_attention fwd + bwd): "
     << single_s << " s; ideal per rank = " << single_s / a.cp << " s\n\n"
     << "| load balance |";
  for (int r = 0; r < a.cp; ++r) md << " rank " << r << " s |";
  md << " busiest / idlest | busiest / ideal | wall s (max rank) |\n|---|";
  for (int r = 0; r < a.cp; ++r) md << "---:|";
  md << "---:|---:|---:|\n";
  for (const auto& row : rows) {
    md << "| " << row.layout << " |";
    for (double c : row.cpu) md << " " << c << " |";
    md << " " << row.ratio << " | " << row.busiest / (single_s / a.cp) << " | "
       << *std::max_element(row.wall.begin(), row.wall.end()) << " |\n";
  }
  js << std::setprecision(6) << "{\"bench\": \"cp_balance\", \"date\": \"" << when << "\", \"libtorch\": \""
     << TORCH_VERSION << "\", \"commit\": \"" << a.commit << "\", \"loadavg\": \"" << load << "\", \"cp\": " << a.cp
     << ", \"seq\": " << a.seq << ", \"heads\": " << a.heads << ", \"kv_heads\": " << a.kv_heads
     << ", \"dim\": " << a.dim << ", \"comm\": \"" << a.comm << "\", \"repeats\": " << a.repeats
     << ", \"single_rank_s\": " << single_s << ", \"layouts\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    js << (i ? ", " : "") << "{\"layout\": \"" << row.layout << "\", \"rank_cpu_s\": [";
    for (size_t r = 0; r < row.cpu.size(); ++r) js << (r ? ", " : "") << row.cpu[r];
    js << "], \"rank_wall_s\": [";
    for (size_t r = 0; r < row.wall.size(); ++r) js << (r ? ", " : "") << row.wall[r];
    js << "], \"busiest_over_idlest\": " << row.ratio << "}";
  }
  js << "]}\n";
  std::cout << md.str();
  if (!a.out.empty()) {
    const std::string base = a.out + "/cp_balance_" + stamp;
    std::ofstream(base + ".md") << md.str();
    std::ofstream(base + ".json") << js.str();
    std::cout << "wrote " << base << ".{md,json}\n";
  }
  return 0;
}
