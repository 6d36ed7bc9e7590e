#include "trainer/interop/merge_command.h"

#include <filesystem>
#include <iostream>
#include <map>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/interop/model_checkpoint.h"
#include "trainer/lora/peft_io.h"

namespace fs = std::filesystem;

namespace nnstrain::interop {

namespace {

constexpr const char* kMergeUsage = R"(usage: nnstrain merge CKPT --out DIR [--hf | --adapter] [--dtype fp32|bf16|fp16]

  CKPT   a checkpoint folder (sharded, deduped or merged), or a save_dir (its `latest` is used)
  --out  the folder to create; written as DIR.tmp, then renamed
  --hf   Hugging Face names and config.json: transformers' from_pretrained(DIR) loads it
         (a LoRA run's: its base folder with the adapters merged in, W + scale x B A)
  --adapter  a LoRA run's adapters as a peft folder (adapter_config.json, adapter_model.safetensors):
         peft.PeftModel.from_pretrained(base, DIR) loads it
  --dtype  the weights' dtype in the output (default: as stored; *-mixed runs store fp32 masters)
)";

}  // namespace

int merge_main(const std::vector<std::string>& args) {
  std::string src, out;
  std::string dtype;
  bool hf = false, adapter = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kMergeUsage;
      return 0;
    } else if (a == "--hf") {
      hf = true;
    } else if (a == "--adapter") {
      adapter = true;
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
        std::cerr << "nnstrain merge: --out needs a folder\n\n" << kMergeUsage;
        return 2;
      }
      out = args[++i];
    } else if (a.rfind("--out=", 0) == 0) {
      out = a.substr(6);
    } else if (a.rfind("-", 0) == 0 || !src.empty()) {
      std::cerr << "nnstrain merge: unexpected argument '" << a << "'\n\n" << kMergeUsage;
      return 2;
    } else {
      src = a;
    }
  }
  if (src.empty() || out.empty()) {
    std::cerr << "nnstrain merge: need CKPT and --out DIR\n\n" << kMergeUsage;
    return 2;
  }
  if (hf && adapter) {
    std::cerr << "nnstrain merge: --hf (the merged model) or --adapter (the adapters alone), not both\n";
    return 2;
  }
  try {
    // A run's save_dir stands for its latest checkpoint.
    if (!fs::exists(fs::path(src) / "manifest.json") && fs::exists(fs::path(src) / "latest")) {
      const auto l = checkpoint::latest(src);
      std::cout << "nnstrain merge: " << src << " is a save_dir; merging its latest checkpoint " << l << "\n";
      src = l;
    }
    if (adapter && !lora::is_lora_checkpoint(src)) {
      std::cerr << "nnstrain merge: --adapter: " << src << " is not a LoRA run's checkpoint (its config has no lora:)\n";
      return 2;
    }
    const bool lora_hf = hf && lora::is_lora_checkpoint(src);
    const auto r = adapter ? lora::write_peft_adapter(src, out)
                   : lora_hf ? lora::write_merged_hf(src, out, dtype)
                             : merge(src, out, hf, dtype);
    std::cout << "nnstrain merge: wrote " << r.out_dir << " (" << r.tensors << " tensors, "
              << r.bytes / 1048576.0 << " MiB; largest tensor " << r.largest_bytes / 1048576.0 << " MiB)"
              << (adapter ? " as a peft adapter folder"
                  : lora_hf ? " with Hugging Face names: the base with the adapters merged in"
                  : hf      ? " with Hugging Face names and config.json"
                            : "")
              << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "nnstrain merge: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace nnstrain::interop
