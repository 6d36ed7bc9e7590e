#include "trainer/optim/muon/matrix_exchange.h"

#include "trainer/optim/muon/newton_schulz.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace nnstrain::optim::muon {

namespace {

// Every member's pieces: this rank's specs as JSON, gathered (sizes first, then the padded bytes).
std::vector<std::vector<sharding::ShardSpec>> exchange_specs(const std::vector<sharding::ShardSpec>& mine,
                                                             OptimizerComm& comm) {
  if (comm.size() == 1) return {mine};
  const std::string text = nlohmann::json(mine).dump();
  auto dev = torch::TensorOptions().device(comm.device());
  auto sizes = comm.all_gather(torch::full({1}, static_cast<int64_t>(text.size()), dev.dtype(torch::kLong))).cpu();
  const int64_t longest = sizes.max().item<int64_t>();
  auto bytes = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  auto all = comm.all_gather(bytes.to(comm.device())).cpu();
  std::vector<std::vector<sharding::ShardSpec>> out;
  for (int s = 0; s < comm.size(); ++s) {
    const auto* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + s * longest;
    out.push_back(nlohmann::json::parse(std::string(p, p + sizes[s].item<int64_t>())).get<std::vector<sharding::ShardSpec>>());
  }
  return out;
}

// Two specs hold the same piece: the same slice and flat range of the same tensor.
std::string piece_key(const sharding::ShardSpec& s) {
  auto j = nlohmann::json(s);
  j.erase("replica_ranks");
  j.erase("dtype");
  return j.dump();
}

}  // namespace

MatrixExchange::MatrixExchange(const std::vector<sharding::ShardSpec>& mine, OptimizerComm& comm) : comm_(comm) {
  const auto members = exchange_specs(mine, comm);
  const int n = comm.size(), me = comm.rank();

  // The matrices: every parameter any member holds a piece of, by name.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& specs : members)
    for (const auto& s : specs) {
      auto [it, fresh] = shapes.emplace(s.name, s.global_shape);
      if (!fresh && it->second != s.global_shape)
        throw std::runtime_error("Muon: ranks disagree on the shape of " + s.name);
      if (s.global_shape.size() < 2) throw std::runtime_error("Muon: " + s.name + " is not a matrix");
    }
  std::map<std::string, size_t> first;  // each parameter's first matrix
  for (const auto& [name, shape] : shapes) {
    const int64_t rows = shape[shape.size() - 2], cols = shape.back();
    const int64_t count = std::accumulate(shape.begin(), shape.end() - 2, int64_t{1}, std::multiplies<int64_t>());
    first[name] = matrices_.size();
    for (int64_t e = 0; e < count; ++e) matrices_.push_back({name, e, rows, cols, 0, newton_schulz_flops(rows, cols, 1)});
  }
  // Owners: largest first, each to the least-loaded member.
  std::vector<size_t> order(matrices_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return matrices_[a].cost > matrices_[b].cost; });
  std::vector<double> load(n, 0.0);
  for (size_t i : order) {
    const int o = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    matrices_[i].owner = o;
    load[o] += matrices_[i].cost;
  }
  owned_offset_.assign(matrices_.size(), -1);
  for (size_t i = 0; i < matrices_.size(); ++i)
    if (matrices_[i].owner == me) {
      owned_.push_back(i);
      owned_offset_[i] = owned_size_;
      owned_size_ += matrices_[i].rows * matrices_[i].cols;
    }

  // Each member's pieces as blocks, by matrix; and which members hold the same piece.
  using ByMatrix = std::map<size_t, std::vector<Block>>;
  std::vector<std::vector<ByMatrix>> blocks(n);
  std::map<std::string, std::vector<int>> holders;
  std::vector<std::vector<std::string>> keys(n);
  for (int s = 0; s < n; ++s) {
    int64_t base = 0;
    for (const auto& spec : members[s]) {
      ByMatrix by;
      const auto& shape = shapes[spec.name];
      const int64_t rows = shape[shape.size() - 2], cols = shape.back(), msize = rows * cols;
      for (const auto& r : sharding::runs(spec)) {
        for (int64_t g = r.global_begin; g < r.global_begin + r.length;) {  // split at matrix boundaries
          const int64_t e = g / msize, end = std::min(r.global_begin + r.length, (e + 1) * msize);
          Block b{base + r.local_begin + (g - r.global_begin), g - e * msize, end - g, 1, end - g};
          auto& v = by[first[spec.name] + e];
          if (!v.empty()) {  // rows of equal length, contiguous here and evenly spaced in the matrix
            auto& l = v.back();
            const int64_t stride = l.rows > 1 ? l.stride : b.global - l.global;
            if (l.len == b.len && l.local + l.rows * l.len == b.local && b.global == l.global + l.rows * stride &&
                stride >= l.len) {
              l.stride = stride;
              ++l.rows;
              g = end;
              continue;
            }
          }
          v.push_back(b);
          g = end;
        }
      }
      base += spec.numel();
      if (s == me) piece_shape_.push_back({rows, cols});
      keys[s].push_back(piece_key(spec));
      holders[keys[s].back()].push_back(s);
      blocks[s].push_back(std::move(by));
    }
    if (s == me) local_size_ = base;
  }
  // The pieces of every matrix must tile it: one holder of each distinct piece counted.
  std::vector<int64_t> covered(matrices_.size(), 0);
  for (const auto& [key, who] : holders) {
    const int s = who.front();
    const size_t k = std::find(keys[s].begin(), keys[s].end(), key) - keys[s].begin();
    for (const auto& [m, bs] : blocks[s][k])
      for (const auto& b : bs) covered[m] += b.rows * b.len;
  }
  for (size_t m = 0; m < matrices_.size(); ++m)
    if (covered[m] != matrices_[m].rows * matrices_[m].cols)
      throw std::runtime_error("Muon: the pieces of " + matrices_[m].name + " held by this stage's ranks cover " +
                               std::to_string(covered[m]) + " of its " +
                               std::to_string(matrices_[m].rows * matrices_[m].cols) + " elements");

  // The sender of a piece to owner o: its holders take turns by o.
  auto provides = [&](int s, size_t k, int o) {
    const auto& who = holders[keys[s][k]];
    return who[o % who.size()] == s;
  };
  gather_send_.resize(n), gather_recv_.resize(n), scatter_send_.resize(n), scatter_recv_.resize(n);
  auto add = [](Transfer& t, size_t m, const std::vector<Block>& bs) {
    for (const auto& b : bs) {
      t.blocks.push_back({m, b});
      t.numel += b.rows * b.len;
    }
  };
  for (int peer = 0; peer < n; ++peer)
    for (size_t m = 0; m < matrices_.size(); ++m) {
      const int o = matrices_[m].owner;
      if (o == peer)  // what I send to, and receive from, the owner `peer`
        for (size_t k = 0; k < blocks[me].size(); ++k) {
          auto it = blocks[me][k].find(m);
          if (it == blocks[me][k].end()) continue;
          if (provides(me, k, o)) add(gather_send_[peer], m, it->second);
          add(scatter_recv_[peer], m, it->second);
        }
      if (o == me)  // what `peer` sends me for my matrix, and what I return to it
        for (size_t k = 0; k < blocks[peer].size(); ++k) {
          auto it = blocks[peer][k].find(m);
          if (it == blocks[peer][k].end()) continue;
          if (provides(peer, k, me)) add(gather_recv_[peer], m, it->second);
          add(scatter_send_[peer], m, it->second);
        }
    }
  check_splits();
}

// NCCL's all-to-all trusts each side's sizes: what s sends d must be what d
// expects from s, or the transfer corrupts memory or hangs. Checked once, on
// every backend, by gathering every member's send sizes.
void MatrixExchange::check_splits() {
  const int n = comm_.size(), me = comm_.rank();
  if (n == 1) return;
  std::vector<int64_t> sent;
  for (const auto* v : {&gather_send_, &scatter_send_})
    for (const auto& t : *v) sent.push_back(t.numel);
  auto all = comm_.all_gather(torch::tensor(sent, torch::kLong).to(comm_.device())).cpu();
  auto a = all.accessor<int64_t, 1>();
  for (int s = 0; s < n; ++s)
    for (int phase = 0; phase < 2; ++phase) {
      const int64_t they_send = a[s * 2 * n + phase * n + me];
      const int64_t i_expect = (phase == 0 ? gather_recv_ : scatter_recv_)[s].numel;
      if (they_send != i_expect)
        throw std::runtime_error("Muon: rank " + std::to_string(comm_.global_rank(s)) + " sends " +
                                 std::to_string(they_send) + " elements to rank " +
                                 std::to_string(comm_.global_rank(me)) + ", which expects " +
                                 std::to_string(i_expect) + " (" + (phase == 0 ? "gather" : "scatter") +
                                 "): the ranks disagree on the matrices' pieces");
    }
}

// Block b of a piece in `t`, this rank's pieces concatenated: contiguous rows.
at::Tensor MatrixExchange::piece_view(const at::Tensor& t, const Block& b) const {
  return t.narrow(0, b.local, b.rows * b.len).view({b.rows, b.len});
}

// Block b of owned matrix m in `t`, the owned matrices concatenated: rows `stride` apart.
at::Tensor MatrixExchange::matrix_view(const at::Tensor& t, size_t m, const Block& b) const {
  return t.as_strided({b.rows, b.len}, {b.stride, 1}, t.storage_offset() + owned_offset_[m] + b.global);
}

at::Tensor MatrixExchange::move(const at::Tensor& from, bool from_matrices, const std::vector<Transfer>& send,
                                const std::vector<Transfer>& recv, int64_t out_size) {
  torch::NoGradGuard no_grad;
  const auto src = from.contiguous();
  std::vector<int64_t> in_splits, out_splits;
  int64_t total = 0;
  for (const auto& t : send) in_splits.push_back(t.numel), total += t.numel;
  for (const auto& t : recv) out_splits.push_back(t.numel);
  auto wire = torch::empty({total}, src.options());
  int64_t pos = 0;
  for (const auto& t : send)
    for (const auto& [m, b] : t.blocks) {
      wire.narrow(0, pos, b.rows * b.len).view({b.rows, b.len}).copy_(from_matrices ? matrix_view(src, m, b) : piece_view(src, b));
      pos += b.rows * b.len;
    }
  const auto got = comm_.all_to_all(wire, in_splits, out_splits);
  auto out = torch::empty({out_size}, src.options());
  pos = 0;
  for (const auto& t : recv)
    for (const auto& [m, b] : t.blocks) {
      (from_matrices ? piece_view(out, b) : matrix_view(out, m, b)).copy_(got.narrow(0, pos, b.rows * b.len).view({b.rows, b.len}));
      pos += b.rows * b.len;
    }
  return out;
}

at::Tensor MatrixExchange::gather(const at::Tensor& local) {
  return move(local, false, gather_send_, gather_recv_, owned_size_);
}

at::Tensor MatrixExchange::scatter(const at::Tensor& owned) {
  return move(owned, true, scatter_send_, scatter_recv_, local_size_);
}

std::string MatrixExchange::describe() const {
  std::vector<double> load(comm_.size(), 0.0);
  double all = 0;
  for (const auto& m : matrices_) load[m.owner] += m.cost, all += m.cost;
  std::ostringstream o;
  o << matrices_.size() << " matrices over " << comm_.size() << " rank" << (comm_.size() > 1 ? "s" : "")
    << ", this rank owns " << owned_.size();
  if (comm_.size() > 1 && all > 0)
    o << "; the largest owner's share of the Newton-Schulz work " << static_cast<int>(100 * *std::max_element(load.begin(), load.end()) / all + 0.5)
      << "% (even: " << static_cast<int>(100.0 / comm_.size() + 0.5) << "%)";
  return o.str();
}

}  // namespace nnstrain::optim::muon
