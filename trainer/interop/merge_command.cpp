#include "trainer/interop/merge_command.h"

#include <filesystem>
#include <iostream>
#include <map>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/interop/model_checkpoint.h"

namespace fs = std::filesystem;

namespace nnstrain::interop {

namespace {

constexpr const char* kUsage = R"(usage: nnstrain merge CKPT --out DIR [--hf] [--dtype fp32|bf16|fp16]

  CKPT   a checkpoint folder (sharded, deduped or merged), or a save_dir (its `latest` is used)
  --out  the folder to create; written as DIR.tmp, then renamed
  --hf   Hugging Face names and config.json: transformers' from_pretrained(DIR) loads it
  --dtype  the weights' dtype in the output (default: as stored; *-mixed runs store fp32 masters)
)";

}  // namespace

int merge_main(const std::vector<std::string>& args) {
  std::string src, out;
  std::string dtype;
  bool hf = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (a == "--hf") {
      hf = true;
    } else if (a == "--dtype" || a.rfind("--dtype=", 0) == 0) {
      std::string d = a == "--dtype" ? (i + 1 < args.size() ? args[++i] : "") : a.substr(8);
      const std::map<std::string, std::string> names = {{"fp32", "F32"}, {"bf16", "BF16"}, {"fp16", "F16"}};
      if (!names.count(d)) {
        std::cerr << "nnstrain merge: --dtype must be fp32, bf16 or fp16, not '" << d << "'\n";
        return 2;
      }
      dtype = names.at(d);
    } else if (a == "--out") {
      if (i + 1 >= args.size()) {
        std::cerr << "nnstrain merge: --out needs a folder\n\n" << kUsage;
        return 2;
      }
      out = args[++i];
    } else if (a.rfind("--out=", 0) == 0) {
      out = a.substr(6);
    } else if (a.rfind("-", 0) == 0 || !src.empty()) {
      std::cerr << "nnstrain merge: unexpected argument '" << a << "'\n\n" << kUsage;
      return 2;
    } else {
      src = a;
    }
  }
  if (src.empty() || out.empty()) {
    std::cerr << "nnstrain merge: need CKPT and --out DIR\n\n" << kUsage;
    return 2;
  }
  try {
    // A run's save_dir stands for its latest checkpoint.
    if (!fs::exists(fs::path(src) / "manifest.json") && fs::exists(fs::path(src) / "latest")) {
      const auto l = checkpoint::latest(src);
      std::cout << "nnstrain merge: " << src << " is a save_dir; merging its latest checkpoint " << l << "\n";
      src = l;
    }
    const auto r = merge(src, out, hf, dtype);
    std::cout << "nnstrain merge: wrote " << r.out_dir << " (" << r.tensors << " tensors, "
              << r.bytes / 1048576.0 << " MiB; largest tensor " << r.largest_bytes / 1048576.0 << " MiB)"
              << (hf ? " with Hugging Face names and config.json" : "") << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "nnstrain merge: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace nnstrain::interop
