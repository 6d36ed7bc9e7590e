// libFuzzer target: manifest.json and its ShardSpecs. Contract: parse_manifest
// either accepts the text or throws CheckpointError (never a JSON or other
// exception); every shard file it accepts is a plain name; an accepted ShardSpec
// survives a JSON round trip and its overlap arithmetic stays in bounds.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "trainer/checkpoint/manifest.h"

using namespace nnstrain::checkpoint;

namespace {

// Rows of a piece (runs() visits each): bounded so one input cannot take minutes.
int64_t rows(const ShardSpec& s) {
  auto r = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) n *= shape[d];
    return shape.empty() ? 1 : n;
  };
  int64_t n = r(s.shape);
  for (const auto& b : s.more_blocks) n += r(b.shape);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Manifest m;
  try {
    m = parse_manifest(text, "manifest.json");
  } catch (const CheckpointError&) {
    return 0;
  }
  for (const auto& f : m.files)
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos) std::abort();
  for (const auto& [name, pieces] : m.index) {
    for (const auto& e : pieces) {
      const ShardSpec again = nlohmann::json(e.spec).get<ShardSpec>();
      if (again.describe() != e.spec.describe() || again.numel() != e.spec.numel()) std::abort();
      if (e.spec.numel() < 0 || e.spec.numel() > e.spec.slice_numel()) std::abort();
    }
    const auto& first = pieces.front().spec;
    bool small = true;
    for (const auto& e : pieces) small = small && rows(e.spec) <= 4096;
    const auto whole = ShardSpec::full(name, first.dtype, first.global_shape);
    if (!small || rows(whole) > 4096) continue;
    std::vector<ShardSpec> specs;
    for (const auto& e : pieces) {
      specs.push_back(e.spec);
      for (const auto& c : overlap(e.spec, whole))
        if (c.src < 0 || c.length <= 0 || c.src + c.length > e.spec.numel() || c.dst < 0 ||
            c.dst + c.length > whole.numel())
          std::abort();
    }
    const int64_t cov = covered(specs, whole);
    if (cov < 0 || cov > whole.numel()) std::abort();
  }
  return 0;
}
