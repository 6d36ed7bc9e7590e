#include "trainer/sharding/shard_spec.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "base/text.h"

namespace nnstrain::sharding {

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

namespace {
// A list of integers from a file: nlohmann would convert a float such as 1e300 with
// an undefined cast (found by fuzz_manifest), so anything but integers is refused.
template <typename T>
std::vector<T> int_list(const nlohmann::json& j, const char* key, const std::string& name) {
  const auto& v = j.at(key);
  if (!v.is_array()) throw std::runtime_error("shard spec of " + util::quote_prefix(name) + ": " + key + " is not a list");
  std::vector<T> out;
  for (const auto& x : v) {
    if (!x.is_number_integer() || (x.is_number_unsigned() && x.get<uint64_t>() > uint64_t(INT64_MAX)) ||
        x.get<int64_t>() < std::numeric_limits<T>::min() || x.get<int64_t>() > std::numeric_limits<T>::max())
      throw std::runtime_error("shard spec of " + util::quote_prefix(name) + ": " + key + " holds " +
                               util::quote_prefix(x.dump()) + ", not an integer in range");
    out.push_back(static_cast<T>(x.get<int64_t>()));
  }
  return out;
}
}  // namespace

void from_json(const nlohmann::json& j, ShardSpec& s) {
  s.name = j.at("name").get<std::string>();
  s.dtype = j.at("dtype").get<std::string>();
  s.global_shape = int_list<int64_t>(j, "global_shape", s.name);
  s.offsets = int_list<int64_t>(j, "offsets", s.name);
  s.shape = int_list<int64_t>(j, "shape", s.name);
  s.replica_ranks = j.contains("replica_ranks") ? int_list<int>(j, "replica_ranks", s.name) : std::vector<int>{};
  if (j.contains("flat_range")) {
    const auto range = int_list<int64_t>(j, "flat_range", s.name);
    if (range.size() != 2) throw std::runtime_error("shard spec of " + util::quote_prefix(s.name) + ": flat_range is not [begin, end]");
    s.flat_begin = range[0];
    s.flat_end = range[1];
  }
  s.more_blocks.clear();
  if (j.contains("more_blocks"))
    for (const auto& b : j.at("more_blocks"))
      s.more_blocks.push_back({int_list<int64_t>(b, "offsets", s.name), int_list<int64_t>(b, "shape", s.name)});
  // Everything below is data from a file: bound it before any arithmetic on it.
  const std::string what = "shard spec of " + util::quote_prefix(s.name);
  const auto rank = s.global_shape.size();
  if (rank > kMaxRank) throw std::runtime_error(what + ": " + std::to_string(rank) + " dimensions, more than " + std::to_string(kMaxRank));
  auto checked_numel = [&](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (auto d : shape)
      if (d < 0 || __builtin_mul_overflow(n, d, &n) || n > kMaxNumel)
        throw std::runtime_error(what + ": shape " + nlohmann::json(shape).dump() + " is negative or too large");
    return n;
  };
  checked_numel(s.global_shape);
  int64_t slice = 0;
  auto check = [&](const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape) {
    if (offsets.size() != rank || shape.size() != rank)
      throw std::runtime_error(what + ": offsets/shape rank differs from global_shape");
    for (size_t d = 0; d < rank; ++d)
      if (offsets[d] < 0 || shape[d] < 0 || offsets[d] > s.global_shape[d] - shape[d])
        throw std::runtime_error(what + ": slice out of bounds in dim " + std::to_string(d));
    slice += checked_numel(shape);
    if (slice > kMaxNumel) throw std::runtime_error(what + ": its blocks hold too many elements");
  };
  check(s.offsets, s.shape);
  for (const auto& b : s.more_blocks) check(b.offsets, b.shape);
  if (s.flat_begin < 0 || s.flat_end < -1 || s.flat_begin > s.end() || s.end() > s.slice_numel())
    throw std::runtime_error(what + ": flat range out of bounds");
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

}  // namespace nnstrain::sharding
