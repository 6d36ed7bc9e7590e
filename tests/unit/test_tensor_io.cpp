// LibTorch adapter for safetensors, and interop with the Python `safetensors`
// package (the reference implementation) in both directions.
#include <catch2/catch.hpp>
#include <dirent.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>

#include "trainer/checkpoint/tensor_io.h"

#include "tests/unit/test_support.h"

using namespace nnstrain::checkpoint;
using Catch::Matchers::Contains;

namespace {

using nnstrain::testing::TempDir;
using nnstrain::testing::exists;



// The same tensors, spelled once in C++ here and once in Python below.
std::vector<std::pair<std::string, torch::Tensor>> expected_tensors() {
  auto i64 = torch::kInt64;
  return {
      {"f32", torch::arange(12, torch::kFloat32).reshape({3, 4}) / 3},
      {"f64", torch::arange(6, torch::kFloat64).reshape({2, 3}) / 7},
      {"f16", (torch::arange(10, torch::kFloat32) / 9).to(torch::kHalf)},
      {"bf16", (torch::arange(8, torch::kFloat32) / 3 - 1).to(torch::kBFloat16).reshape({2, 2, 2})},
      {"i64", torch::arange(5, i64) * -123456789012LL},
      {"i32", torch::arange(4, torch::kInt32) - 2},
      {"i16", (torch::arange(6, i64) * -1000).to(torch::kInt16)},
      {"i8", (torch::arange(5, i64) * -25).to(torch::kInt8)},
      {"u8", (torch::arange(7, i64) * 30).to(torch::kUInt8)},
      {"bool", torch::arange(5, i64) % 2 == 0},
      {"u16", (torch::arange(5, i64) * 13000).to(torch::kUInt16)},
      {"u32", (torch::arange(3, i64) * 2000000000).to(torch::kUInt32)},
      {"u64", (torch::arange(3, i64) * 3000000000LL).to(torch::kUInt64)},
      {"scalar", torch::tensor(3.5)},
      {"empty", torch::zeros({0, 4})},
      // Not contiguous: the writer must lay it out row-major.
      {"transposed", torch::arange(6, torch::kFloat32).reshape({2, 3}).t()},
  };
}

const char* kPythonTensors = R"PY(
import sys, torch
i64 = torch.int64
expected = {
    "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3,
    "f64": torch.arange(6, dtype=torch.float64).reshape(2, 3) / 7,
    "f16": (torch.arange(10, dtype=torch.float32) / 9).half(),
    "bf16": (torch.arange(8, dtype=torch.float32) / 3 - 1).bfloat16().reshape(2, 2, 2),
    "i64": torch.arange(5, dtype=i64) * -123456789012,
    "i32": torch.arange(4, dtype=torch.int32) - 2,
    "i16": (torch.arange(6, dtype=i64) * -1000).to(torch.int16),
    "i8": (torch.arange(5, dtype=i64) * -25).to(torch.int8),
    "u8": (torch.arange(7, dtype=i64) * 30).to(torch.uint8),
    "bool": torch.arange(5, dtype=i64) % 2 == 0,
    "u16": (torch.arange(5, dtype=i64) * 13000).to(torch.uint16),
    "u32": (torch.arange(3, dtype=i64) * 2000000000).to(torch.uint32),
    "u64": (torch.arange(3, dtype=i64) * 3000000000).to(torch.uint64),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
    "transposed": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
}
)PY";

void check_equal(const std::string& name, const torch::Tensor& got, const torch::Tensor& want) {
  INFO("tensor " << name << ": got " << got.scalar_type() << got.sizes() << ", want "
                 << want.scalar_type() << want.sizes());
  REQUIRE(got.defined());
  CHECK(got.scalar_type() == want.scalar_type());
  CHECK(got.sizes() == want.sizes());
  CHECK(got.device().is_cpu());
  // Exact: both sides compute the same IEEE operations on the same values.
  if (got.scalar_type() == want.scalar_type() && got.sizes() == want.sizes())
    CHECK(torch::equal(got, want.contiguous()));
}

}  // namespace

TEST_CASE("tensor_io dtype mapping covers every safetensors dtype", "[safetensors]") {
  for (DType d : {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32,
                  DType::I16, DType::I8, DType::U8, DType::BOOL, DType::U16, DType::U32, DType::U64}) {
    INFO(dtype_name(d));
    CHECK(to_dtype(to_scalar_type(d)) == d);
    CHECK(c10::elementSize(to_scalar_type(d)) == dtype_size(d));
  }
  CHECK_THROWS_WITH(to_dtype(c10::ScalarType::ComplexFloat), Contains("ComplexFloat"));
}

TEST_CASE("tensor_io round trip through save_tensors and load_tensors", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("rt.safetensors");
  auto tensors = expected_tensors();
  save_tensors(path, tensors, {{"step", "7"}});
  auto loaded = load_tensors(path);
  REQUIRE(loaded.size() == tensors.size());
  for (const auto& [name, t] : tensors) check_equal(name, loaded.at(name), t);

  SafetensorsReader reader(path);
  CHECK(reader.metadata().at("step") == "7");
  auto one = read_tensor(reader, "f32");
  one.zero_();  // an owned copy: the mapping is read-only and must stay untouched
  check_equal("f32 again", read_tensor(reader, "f32"), tensors[0].second);
  CHECK_THROWS_WITH(read_tensor(reader, "absent"), Contains(path) && Contains("'absent'"));

  const std::string bad = dir.file("bad.safetensors");
  CHECK_THROWS_WITH(save_tensors(bad, {{"c", torch::zeros({2}, torch::kComplexFloat)}}),
                    Contains(bad) && Contains("tensor 'c'"));
  CHECK_FALSE(exists(bad));
}

TEST_CASE("tensor_io read_tensor_slice matches narrow", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("slice.safetensors");
  auto full = torch::randn({4, 6, 5}).to(torch::kBFloat16);
  save_tensors(path, {{"w", full}});
  SafetensorsReader reader(path);
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> blocks = {
      {{0, 0, 0}, {4, 6, 5}}, {{1, 2, 0}, {2, 3, 5}}, {{3, 5, 4}, {1, 1, 1}}, {{0, 3, 1}, {4, 3, 2}}};
  for (const auto& [off, sz] : blocks) {
    torch::Tensor want = full;
    for (size_t d = 0; d < off.size(); ++d) want = want.narrow(d, off[d], sz[d]);
    check_equal("w block", read_tensor_slice(reader, "w", off, sz), want);
  }
  CHECK_THROWS_WITH(read_tensor_slice(reader, "w", {0, 0, 3}, {4, 6, 3}),
                    Contains(path) && Contains("out of range in dim 2"));
}

TEST_CASE("tensor_io reads what Python safetensors writes", "[safetensors][interop]") {
  TempDir dir;
  const std::string path = dir.file("from_python.safetensors");
  const std::string script = std::string(kPythonTensors) + R"PY(
from safetensors.torch import save_file
# The Python writer refuses views; ours lays them out itself.
save_file({k: v.contiguous() for k, v in expected.items()}, sys.argv[1], metadata={"source": "python", "n": str(len(expected))})
)PY";
  REQUIRE(nnstrain::testing::python(script, {path}) == 0);
  SafetensorsReader reader(path);
  auto tensors = expected_tensors();
  const std::map<std::string, std::string> meta = {{"source", "python"},
                                                   {"n", std::to_string(tensors.size())}};
  CHECK(reader.metadata() == meta);
  REQUIRE(reader.tensors().size() == tensors.size());
  for (const auto& [name, t] : tensors) check_equal(name, read_tensor(reader, name), t);
}

TEST_CASE("Python safetensors reads what tensor_io writes", "[safetensors][interop]") {
  TempDir dir;
  const std::string path = dir.file("from_cpp.safetensors");
  save_tensors(path, expected_tensors(), {{"source", "nnstrain"}});
  // The Python side validates the file with the reference (Rust) parser, then
  // compares every tensor and the metadata; its exit status tells.
  const std::string script = std::string(kPythonTensors) + R"PY(
from safetensors import safe_open
from safetensors.torch import load_file
import numpy as np
got = load_file(sys.argv[1])
bad = []
if set(got) != set(expected):
    bad.append(f"names {sorted(got)} != {sorted(expected)}")
for k, want in expected.items():
    g = got.get(k)
    if g is None or g.dtype != want.dtype or g.shape != want.shape or not torch.equal(g, want):
        bad.append(f"{k}: got {g!r}, want {want!r}")
with safe_open(sys.argv[1], framework="pt") as f:
    if f.metadata() != {"source": "nnstrain"}:
        bad.append(f"metadata {f.metadata()!r}")
with safe_open(sys.argv[1], framework="np") as f:
    if not np.array_equal(f.get_tensor("f32"), expected["f32"].numpy()):
        bad.append("numpy f32 differs")
for b in bad:
    print("MISMATCH", b, file=sys.stderr)
sys.exit(1 if bad else 0)
)PY";
  CHECK(nnstrain::testing::python(script, {path}) == 0);
}
