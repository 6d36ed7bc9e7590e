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

int64_t ShardSpec::slice_numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int64_t ShardSpec::numel() const { return end() - flat_begin; }

bool ShardSpec::is_full() const {
  return shape == global_shape && flat_begin == 0 && end() == slice_numel();
}

std::string ShardSpec::describe() const {
  std::ostringstream o;
  o << name << "[";
  for (size_t d = 0; d < shape.size(); ++d)
    o << (d ? ", " : "") << offsets[d] << ":" << offsets[d] + shape[d];
  o << "]";
  if (flat_begin != 0 || flat_end >= 0) o << " flat[" << flat_begin << ":" << end() << "]";
  return o.str();
}

void to_json(nlohmann::json& j, const ShardSpec& s) {
  j = {{"name", s.name}, {"dtype", s.dtype}, {"global_shape", s.global_shape},
       {"offsets", s.offsets}, {"shape", s.shape}, {"replica_ranks", s.replica_ranks}};
  if (s.flat_begin != 0 || s.flat_end >= 0) j["flat_range"] = {s.flat_begin, s.end()};
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
  const auto rank = s.global_shape.size();
  if (s.offsets.size() != rank || s.shape.size() != rank)
    throw std::runtime_error("shard spec of '" + s.name + "': offsets/shape rank differs from global_shape");
  for (size_t d = 0; d < rank; ++d)
    if (s.offsets[d] < 0 || s.shape[d] < 0 || s.offsets[d] + s.shape[d] > s.global_shape[d])
      throw std::runtime_error("shard spec of '" + s.name + "': slice out of bounds in dim " + std::to_string(d));
  if (s.flat_begin < 0 || s.flat_begin > s.end() || s.end() > s.slice_numel())
    throw std::runtime_error("shard spec of '" + s.name + "': flat range out of bounds");
}

std::vector<Run> runs(const ShardSpec& s) {
  std::vector<Run> out;
  const size_t nd = s.shape.size();
  const int64_t begin = s.flat_begin, end = s.end();
  if (end <= begin) return out;
  if (nd == 0) return {{0, 0, end - begin}};
  // Collapse to rows of the slice's last dim; each row is contiguous globally.
  const int64_t row = s.shape[nd - 1];
  if (row == 0) return out;
  std::vector<int64_t> gstride(nd, 1);
  for (int d = static_cast<int>(nd) - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * s.global_shape[d + 1];
  for (int64_t r = begin / row; r * row < end; ++r) {
    // Global flat index of the start of slice row r.
    int64_t idx = r, g = 0;
    for (int d = static_cast<int>(nd) - 2; d >= 0; --d) {
      g += (s.offsets[d] + idx % s.shape[d]) * gstride[d];
      idx /= s.shape[d];
    }
    g += s.offsets[nd - 1];
    const int64_t lo = std::max(begin, r * row), hi = std::min(end, (r + 1) * row);
    const int64_t gb = g + (lo - r * row);
    if (!out.empty() && out.back().global_begin + out.back().length == gb)
      out.back().length += hi - lo;  // consecutive rows of a full-width slice merge
    else
      out.push_back({gb, lo - begin, hi - lo});
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
