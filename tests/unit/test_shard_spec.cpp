// ShardSpec geometry: runs(), overlap(), covered() on row and column splits,
// flat (ZeRO) ranges that cross rows, 0-d and 1-d tensors, and reassembly of a
// random tensor from random pieces. Expected values come from LibTorch slicing
// of an index tensor, not from the code under test.
#include <catch2/catch.hpp>

#include <torch/torch.h>

#include <random>

#include "trainer/sharding/shard_spec.h"

using nnstrain::sharding::Copy;
using nnstrain::sharding::covered;
using nnstrain::sharding::overlap;
using nnstrain::sharding::Run;
using nnstrain::sharding::runs;
using nnstrain::sharding::ShardSpec;

namespace {

ShardSpec piece(std::vector<int64_t> global, std::vector<int64_t> offsets, std::vector<int64_t> shape,
                int64_t flat_begin = 0, int64_t flat_end = -1) {
  ShardSpec s;
  s.name = "t";
  s.dtype = "F32";
  s.global_shape = std::move(global);
  s.offsets = std::move(offsets);
  s.shape = std::move(shape);
  s.flat_begin = flat_begin;
  s.flat_end = flat_end;
  return s;
}

// The elements of `global` a piece holds, in its own storage order: its blocks
// one after another, then the flat range of that.
torch::Tensor extract(const torch::Tensor& global, const ShardSpec& s) {
  auto block = [&](const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape) {
    auto t = global;
    for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(static_cast<int64_t>(d), offsets[d], shape[d]);
    return t.contiguous().reshape({-1});
  };
  std::vector<torch::Tensor> parts = {block(s.offsets, s.shape)};
  for (const auto& b : s.more_blocks) parts.push_back(block(b.offsets, b.shape));
  return torch::cat(parts).narrow(0, s.flat_begin, s.numel()).clone();
}

// runs() must list exactly the global flat indices of the piece, in local order.
void check_runs_against_torch(const ShardSpec& s) {
  int64_t n = 1;
  for (auto d : s.global_shape) n *= d;
  const auto index = torch::arange(n, torch::kInt64).reshape(s.global_shape);
  const auto want = extract(index, s);
  auto got = torch::full({s.numel()}, -1, torch::kInt64);
  int64_t total = 0, prev_end = -1;
  for (const auto& r : runs(s)) {
    REQUIRE(r.length > 0);
    REQUIRE(r.global_begin >= prev_end);  // sorted, disjoint
    prev_end = r.global_begin + r.length;
    got.narrow(0, r.local_begin, r.length).copy_(torch::arange(r.global_begin, r.global_begin + r.length));
    total += r.length;
  }
  INFO(s.describe());
  CHECK(total == s.numel());
  CHECK(torch::equal(got, want));
}

// Assembles `wanted` from `pieces` of `global` through overlap(); -1 where uncovered.
torch::Tensor assemble(const torch::Tensor& global, const std::vector<ShardSpec>& pieces, const ShardSpec& wanted) {
  auto out = torch::full({wanted.numel()}, -1.0, torch::kFloat64);
  for (const auto& p : pieces) {
    const auto data = extract(global, p);
    for (const auto& c : overlap(p, wanted)) {
      REQUIRE(c.src >= 0);
      REQUIRE(c.src + c.length <= p.numel());
      REQUIRE(c.dst + c.length <= wanted.numel());
      out.narrow(0, c.dst, c.length).copy_(data.narrow(0, c.src, c.length));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("runs of a row split are one contiguous run", "[shardspec]") {
  const auto s = piece({6, 4}, {2, 0}, {3, 4});
  const auto r = runs(s);
  REQUIRE(r.size() == 1);
  CHECK(r[0].global_begin == 8);
  CHECK(r[0].local_begin == 0);
  CHECK(r[0].length == 12);
  check_runs_against_torch(s);
}

TEST_CASE("runs of a column split are one run per row", "[shardspec]") {
  const auto s = piece({3, 8}, {0, 4}, {3, 4});
  const auto r = runs(s);
  REQUIRE(r.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(r[i].global_begin == 8 * i + 4);
    CHECK(r[i].local_begin == 4 * i);
    CHECK(r[i].length == 4);
  }
  check_runs_against_torch(s);
  check_runs_against_torch(piece({4, 6, 5}, {1, 2, 1}, {2, 3, 3}));  // 3-d block
}

TEST_CASE("flat ranges crossing rows", "[shardspec]") {
  // A ZeRO partition of a whole matrix: one run across row boundaries.
  const auto whole = piece({4, 5}, {0, 0}, {4, 5}, 3, 12);
  const auto r = runs(whole);
  REQUIRE(r.size() == 1);
  CHECK(r[0].global_begin == 3);
  CHECK(r[0].length == 9);
  check_runs_against_torch(whole);

  // A flat range of a column slice: a partial first row, then a partial second row.
  const auto col = piece({3, 8}, {0, 4}, {3, 4}, 2, 7);
  const auto rc = runs(col);
  REQUIRE(rc.size() == 2);
  CHECK(rc[0].global_begin == 6);
  CHECK(rc[0].local_begin == 0);
  CHECK(rc[0].length == 2);
  CHECK(rc[1].global_begin == 12);
  CHECK(rc[1].local_begin == 2);
  CHECK(rc[1].length == 3);
  check_runs_against_torch(col);

  CHECK(runs(piece({4, 5}, {0, 0}, {4, 5}, 7, 7)).empty());  // an empty range holds nothing
  CHECK(piece({4, 5}, {0, 0}, {4, 5}, 7, 7).numel() == 0);
}

TEST_CASE("0-d and 1-d tensors", "[shardspec]") {
  const auto scalar = ShardSpec::full("s", "F32", {});
  CHECK(scalar.slice_numel() == 1);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.is_full());
  const auto r = runs(scalar);
  REQUIRE(r.size() == 1);
  CHECK(r[0].global_begin == 0);
  CHECK(r[0].length == 1);
  const auto c = overlap(scalar, scalar);
  REQUIRE(c.size() == 1);
  CHECK(c[0].length == 1);
  CHECK(covered({scalar}, scalar) == 1);
  CHECK(covered({}, scalar) == 0);

  const auto slice = piece({10}, {3}, {4});
  REQUIRE(runs(slice).size() == 1);
  CHECK(runs(slice)[0].global_begin == 3);
  check_runs_against_torch(slice);
  const auto zero = piece({10}, {0}, {10}, 2, 9);
  check_runs_against_torch(zero);
  // The slice [3, 7) and the flat range [2, 9): elements 3..6 are shared.
  const auto ov = overlap(zero, slice);
  REQUIRE(ov.size() == 1);
  CHECK(ov[0].src == 1);
  CHECK(ov[0].dst == 0);
  CHECK(ov[0].length == 4);
  CHECK(overlap(piece({10}, {0}, {3}), piece({10}, {3}, {4})).empty());  // adjacent, not overlapping
}

TEST_CASE("overlap between a column shard and a row shard", "[shardspec]") {
  const auto global = torch::arange(48, torch::kFloat64).reshape({6, 8});
  const auto stored = piece({6, 8}, {0, 4}, {6, 4});  // right half (tensor-parallel column split)
  const auto wanted = piece({6, 8}, {2, 0}, {2, 8});  // rows 2..3 (another plan)
  const auto got = assemble(global, {stored}, wanted);
  // Only the right half of rows 2..3 comes from this piece; the left stays uncovered.
  const auto expect = global.narrow(0, 2, 2).clone();
  expect.narrow(1, 0, 4).fill_(-1);
  CHECK(torch::equal(got, expect.reshape({-1})));
  CHECK(covered({stored}, wanted) == 8);
  CHECK(covered({stored, piece({6, 8}, {0, 0}, {6, 4})}, wanted) == 16);
}

TEST_CASE("multi-block pieces: a tensor-parallel shard of a fused QKV weight", "[shardspec]") {
  // Global [3C, C] with C = 4 (Q, K, V stacked); rank 1 of tp=2 holds rows 2..3 of each part.
  const int64_t C = 4;
  auto s = piece({3 * C, C}, {2, 0}, {2, C});
  s.more_blocks = {{{C + 2, 0}, {2, C}}, {{2 * C + 2, 0}, {2, C}}};
  CHECK(s.slice_numel() == 24);
  CHECK_FALSE(s.is_full());
  check_runs_against_torch(s);
  CHECK(runs(s).size() == 3);
  CHECK(s.describe() == "t[2:4, 0:4]+[6:8, 0:4]+[10:12, 0:4]");
  // ZeRO on top: a flat range across the block boundary.
  auto z = s;
  z.flat_begin = 5;
  z.flat_end = 13;
  check_runs_against_torch(z);
  const auto global = torch::randn({3 * C, C}, torch::kFloat64);
  // Rank 0's blocks + rank 1's blocks cover the whole; a whole-tensor load reassembles it.
  auto r0 = piece({3 * C, C}, {0, 0}, {2, C});
  r0.more_blocks = {{{C, 0}, {2, C}}, {{2 * C, 0}, {2, C}}};
  const auto whole = ShardSpec::full("t", "F32", {3 * C, C});
  CHECK(covered({r0, s}, whole) == 3 * C * C);
  CHECK(torch::equal(assemble(global, {s, r0}, whole), global.reshape({-1})));
  CHECK(torch::equal(assemble(global, {r0, s}, z), extract(global, z)));
  nlohmann::json j = s;
  CHECK(j.get<ShardSpec>().more_blocks.size() == 2);
  CHECK(runs(j.get<ShardSpec>()).size() == 3);
}

TEST_CASE("covered counts every element once and sees gaps", "[shardspec]") {
  const auto wanted = ShardSpec::full("t", "F32", {4, 4});
  const auto top = piece({4, 4}, {0, 0}, {2, 4}), bottom = piece({4, 4}, {2, 0}, {2, 4});
  CHECK(covered({top, bottom}, wanted) == 16);
  CHECK(covered({top, top, bottom}, wanted) == 16);  // replicas do not count twice
  CHECK(covered({top}, wanted) == 8);
  // ZeRO pieces with a one-element gap at 9.
  CHECK(covered({piece({4, 4}, {0, 0}, {4, 4}, 0, 9), piece({4, 4}, {0, 0}, {4, 4}, 10, 16)}, wanted) == 15);
  CHECK(covered({piece({4, 4}, {0, 0}, {4, 4}, 0, 10), piece({4, 4}, {0, 0}, {4, 4}, 5, 16)}, wanted) == 16);
}

TEST_CASE("JSON round trip and validation", "[shardspec]") {
  auto s = piece({6, 8}, {2, 4}, {2, 4}, 1, 7);
  s.replica_ranks = {1, 3};
  nlohmann::json j = s;
  const auto back = j.get<ShardSpec>();
  CHECK(back.global_shape == s.global_shape);
  CHECK(back.offsets == s.offsets);
  CHECK(back.shape == s.shape);
  CHECK(back.flat_begin == 1);
  CHECK(back.end() == 7);
  CHECK(back.replica_ranks == s.replica_ranks);
  CHECK(back.owner() == 1);
  CHECK(s.describe() == "t[2:4, 4:8] flat[1:7]");
  CHECK_FALSE(nlohmann::json(ShardSpec::full("w", "F32", {3})).contains("flat_range"));

  auto bad = j;
  bad["offsets"] = {5, 4};  // rows 5..6 of 6
  CHECK_THROWS_WITH(bad.get<ShardSpec>(), Catch::Contains("out of bounds in dim 0"));
  bad = j;
  bad["flat_range"] = {0, 9};  // the slice holds 8
  CHECK_THROWS_WITH(bad.get<ShardSpec>(), Catch::Contains("flat range out of bounds"));
  bad = j;
  bad["shape"] = {2};
  CHECK_THROWS_WITH(bad.get<ShardSpec>(), Catch::Contains("rank differs"));
}

TEST_CASE("a random tensor reassembles from random pieces", "[shardspec]") {
  std::mt19937_64 rng(1234);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    const int nd = static_cast<int>(uni(0, 4));
    std::vector<int64_t> gshape;
    for (int d = 0; d < nd; ++d) gshape.push_back(uni(1, 7));
    const auto global = torch::randn(gshape, torch::kFloat64);

    // A partition: random cuts in every dim (a TP-like grid), each cell cut into
    // random flat ranges (ZeRO-like), then shuffled, plus a few overlapping extras.
    std::vector<std::vector<int64_t>> cuts(nd);
    for (int d = 0; d < nd; ++d) {
      cuts[d] = {0, gshape[d]};
      for (int k = 0; k < 2; ++k) cuts[d].push_back(uni(0, gshape[d]));
      std::sort(cuts[d].begin(), cuts[d].end());
      cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    }
    std::vector<ShardSpec> pieces;
    std::vector<size_t> cell(nd, 0);
    while (true) {
      std::vector<int64_t> off(nd), shp(nd);
      for (int d = 0; d < nd; ++d) {
        off[d] = cuts[d][cell[d]];
        shp[d] = cuts[d][cell[d] + 1] - off[d];
      }
      auto whole = piece(gshape, off, shp);
      const int64_t n = whole.slice_numel();
      std::vector<int64_t> fl = {0, n, uni(0, n), uni(0, n)};
      std::sort(fl.begin(), fl.end());
      for (size_t k = 0; k + 1 < fl.size(); ++k)
        if (fl[k] < fl[k + 1]) pieces.push_back(piece(gshape, off, shp, fl[k], fl[k + 1]));
      int d = nd - 1;
      while (d >= 0 && ++cell[d] + 1 >= cuts[d].size()) cell[d--] = 0;
      if (d < 0) break;
    }
    for (int k = 0; k < 2 && !pieces.empty(); ++k) pieces.push_back(pieces[uni(0, pieces.size() - 1)]);
    std::shuffle(pieces.begin(), pieces.end(), rng);

    // Wanted: the whole tensor, and a random block with a random flat range.
    std::vector<ShardSpec> wants = {ShardSpec::full("t", "F32", gshape)};
    std::vector<int64_t> off(nd), shp(nd);
    for (int d = 0; d < nd; ++d) {
      off[d] = uni(0, gshape[d] - 1);
      shp[d] = uni(1, gshape[d] - off[d]);
    }
    auto block = piece(gshape, off, shp);
    const int64_t n = block.slice_numel();
    block.flat_begin = uni(0, n - 1);
    block.flat_end = uni(block.flat_begin + 1, n);
    wants.push_back(block);

    for (const auto& p : pieces) check_runs_against_torch(p);
    for (const auto& w : wants) {
      INFO("trial " << trial << ": " << w.describe() << " from " << pieces.size() << " pieces");
      check_runs_against_torch(w);
      CHECK(covered(pieces, w) == w.numel());
      CHECK(torch::equal(assemble(global, pieces, w), extract(global, w)));
      // Without one non-replicated piece the assembly has a gap.
      std::vector<ShardSpec> fewer(pieces.begin() + 1, pieces.end());
      const bool still_there = std::any_of(fewer.begin(), fewer.end(), [&](const ShardSpec& p) {
        return p.offsets == pieces[0].offsets && p.flat_begin == pieces[0].flat_begin && p.end() == pieces[0].end();
      });
      if (!still_there) CHECK(covered(fewer, w) == w.numel() - static_cast<int64_t>([&] {
                                int64_t k = 0;
                                for (const auto& c : overlap(pieces[0], w)) k += c.length;
                                return k;
                              }()));
    }
  }
}
