#include "trainer/checkpoint/shard_spec.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace nnstrain::checkpoint {

ShardSpec ShardSpec::full(std::string name, std::string dtype, std::vector<int64_t> shape) {
  ShardSpec s;
  s.name = std::move(name);
  s.dtype = std::move(dtype);
  s.global_shape = shape;
  s.offsets.assign(shape.size(), 0);
  s.shape = std::move(shape);
  return s;
}

namespace {
int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}
}  // namespace

int64_t ShardSpec::slice_numel() const {
  int64_t n = numel_of(shape);
  for (const auto& b : more_blocks) n += numel_of(b.shape);
  return n;
}

int64_t ShardSpec::numel() const { return end() - flat_begin; }

bool ShardSpec::is_full() const {
  return more_blocks.empty() && shape == global_shape && flat_begin == 0 && end() == slice_numel();
}

std::string ShardSpec::describe() const {
  std::ostringstream o;
  o << name << "[";
  for (size_t d = 0; d < shape.size(); ++d)
    o << (d ? ", " : "") << offsets[d] << ":" << offsets[d] + shape[d];
  o << "]";
  for (const auto& b : more_blocks) {
    o << "+[";
    for (size_t d = 0; d < b.shape.size(); ++d)
      o << (d ? ", " : "") << b.offsets[d] << ":" << b.offsets[d] + b.shape[d];
    o << "]";
  }
  if (flat_begin != 0 || flat_end >= 0) o << " flat[" << flat_begin << ":" << end() << "]";
  return o.str();
}

void to_json(nlohmann::json& j, const ShardSpec& s) {
  j = {{"name", s.name}, {"dtype", s.dtype}, {"global_shape", s.global_shape},
       {"offsets", s.offsets}, {"shape", s.shape}, {"replica_ranks", s.replica_ranks}};
  if (s.flat_begin != 0 || s.flat_end >= 0) j["flat_range"] = {s.flat_begin, s.end()};
  if (!s.more_blocks.empty()) {
    j["more_blocks"] = nlohmann::json::array();
    for (const auto& b : s.more_blocks) j["more_blocks"].push_back({{"offsets", b.offsets}, {"shape", b.shape}});
  }
}

void from_json(const nlohmann::json& j, ShardSpec& s) {
  s.name = j.at("name").get<std::string>();
  s.dtype = j.at("dtype").get<std::string>();
  s.global_shape = j.at("global_shape").get<std::vector<int64_t>>();
  s.offsets = j.at("offsets").get<std::vector<int64_t>>();
  s.shape = j.at("shape").get<std::vector<int64_t>>();
  s.replica_ranks = j.value("replica_ranks", std::vector<int>{});
  if (j.contains("flat_range")) {
    s.flat_begin = j.at("flat_range").at(0).get<int64_t>();
    s.flat_end = j.at("flat_range").at(1).get<int64_t>();
  }
  s.more_blocks.clear();
  if (j.contains("more_blocks"))
    for (const auto& b : j.at("more_blocks"))
      s.more_blocks.push_back({b.at("offsets").get<std::vector<int64_t>>(), b.at("shape").get<std::vector<int64_t>>()});
  const auto rank = s.global_shape.size();
  auto check = [&](const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape) {
    if (offsets.size() != rank || shape.size() != rank)
      throw std::runtime_error("shard spec of '" + s.name + "': offsets/shape rank differs from global_shape");
    for (size_t d = 0; d < rank; ++d)
      if (offsets[d] < 0 || shape[d] < 0 || offsets[d] + shape[d] > s.global_shape[d])
        throw std::runtime_error("shard spec of '" + s.name + "': slice out of bounds in dim " + std::to_string(d));
  };
  check(s.offsets, s.shape);
  for (const auto& b : s.more_blocks) check(b.offsets, b.shape);
  if (s.flat_begin < 0 || s.flat_begin > s.end() || s.end() > s.slice_numel())
    throw std::runtime_error("shard spec of '" + s.name + "': flat range out of bounds");
}

// Runs of one rectangular block whose storage starts at `base` in the piece,
// clipped to the piece's flat range [begin, end).
static void block_runs(const ShardSpec& s, const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape,
                       int64_t base, int64_t begin, int64_t end, std::vector<Run>& out) {
  const size_t nd = shape.size();
  const int64_t n = numel_of(shape);
  const int64_t lo_all = std::max(begin, base), hi_all = std::min(end, base + n);
  if (hi_all <= lo_all) return;
  if (nd == 0) {
    out.push_back({0, lo_all - begin, hi_all - lo_all});
    return;
  }
  // Rows of the block's last dim are contiguous in the global tensor.
  const int64_t row = shape[nd - 1];
  std::vector<int64_t> gstride(nd, 1);
  for (int d = static_cast<int>(nd) - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * s.global_shape[d + 1];
  for (int64_t r = (lo_all - base) / row; base + r * row < hi_all; ++r) {
    int64_t idx = r, g = 0;  // global flat index of the start of block row r
    for (int d = static_cast<int>(nd) - 2; d >= 0; --d) {
      g += (offsets[d] + idx % shape[d]) * gstride[d];
      idx /= shape[d];
    }
    g += offsets[nd - 1];
    const int64_t lo = std::max(lo_all, base + r * row), hi = std::min(hi_all, base + (r + 1) * row);
    const int64_t gb = g + (lo - base - r * row);
    if (!out.empty() && out.back().global_begin + out.back().length == gb &&
        out.back().local_begin + out.back().length == lo - begin)
      out.back().length += hi - lo;  // consecutive rows of a full-width slice merge
    else
      out.push_back({gb, lo - begin, hi - lo});
  }
}

std::vector<Run> runs(const ShardSpec& s) {
  std::vector<Run> out;
  const int64_t begin = s.flat_begin, end = s.end();
  if (end <= begin) return out;
  block_runs(s, s.offsets, s.shape, 0, begin, end, out);
  int64_t base = numel_of(s.shape);
  for (const auto& b : s.more_blocks) {
    block_runs(s, b.offsets, b.shape, base, begin, end, out);
    base += numel_of(b.shape);
  }
  std::sort(out.begin(), out.end(), [](const Run& a, const Run& b) { return a.global_begin < b.global_begin; });
  return out;
}

std::vector<Copy> overlap(const ShardSpec& stored, const ShardSpec& wanted) {
  std::vector<Copy> out;
  const auto a = runs(stored), b = runs(wanted);
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].global_begin, b[j].global_begin);
    const int64_t hi = std::min(a[i].global_begin + a[i].length, b[j].global_begin + b[j].length);
    if (lo < hi)
      out.push_back({a[i].local_begin + (lo - a[i].global_begin), b[j].local_begin + (lo - b[j].global_begin), hi - lo});
    if (a[i].global_begin + a[i].length < b[j].global_begin + b[j].length) ++i; else ++j;
  }
  return out;
}

int64_t covered(const std::vector<ShardSpec>& pieces, const ShardSpec& wanted) {
  // Mark covered intervals of the wanted piece's local index space, then merge.
  std::vector<std::pair<int64_t, int64_t>> iv;
  for (const auto& p : pieces)
    for (const auto& c : overlap(p, wanted)) iv.push_back({c.dst, c.dst + c.length});
  std::sort(iv.begin(), iv.end());
  int64_t total = 0, cur_lo = -1, cur_hi = -1;
  for (const auto& [lo, hi] : iv) {
    if (lo > cur_hi) { total += cur_hi - cur_lo; cur_lo = lo; cur_hi = hi; }
    else cur_hi = std::max(cur_hi, hi);
  }
  return total + (cur_hi - cur_lo);
}

}  // namespace nnstrain::checkpoint
