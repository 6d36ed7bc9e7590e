#include "trainer/interop/model_source.h"

#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>

#include "base/config/trainer_args.h"
#include "data/indexed/sample_stream.h"
#include "data/tokenizer/tokenizer.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/manifest.h"
#include "trainer/interop/hf_import.h"
#include "trainer/interop/model_checkpoint.h"
#include "trainer/lora/peft_io.h"

namespace fs = std::filesystem;

namespace nnstrain::interop {

std::optional<fs::path> find_from_run(const fs::path& p, const checkpoint::Checkpoint& ck,
                                      const std::function<bool(const fs::path&)>& exists) {
  if (p.is_absolute() || exists(p)) return exists(p) ? std::optional<fs::path>(p) : std::nullopt;
  for (fs::path dir = fs::absolute(ck.dir()); dir.has_relative_path(); dir = dir.parent_path())
    if (exists(dir / p)) return dir / p;
  return std::nullopt;
}

namespace {

// The tokenizer of a checkpoint's training data: the meta.json `nnstrain
// prepare` writes beside token files, or the tokenizer an indexed dataset's
// manifest records (checked against the manifest's hash, so ids are decoded by
// the tokenizer that made them).
std::optional<std::string> dataset_tokenizer(const checkpoint::Checkpoint& ck) {
  const auto args = saved_args(ck);
  const auto file = [](const fs::path& p) { return fs::exists(p); };
  if (args.dataset.type != "indexed") {
    if (args.dataset.train_args.path.empty()) return std::nullopt;
    const auto meta = find_from_run(fs::path(args.dataset.train_args.path).parent_path() / "meta.json", ck, file);
    return meta ? std::optional<std::string>(meta->string()) : std::nullopt;
  }
  if (args.dataset.indexed_train.datasets.empty()) return std::nullopt;
  const auto manifest = find_from_run(args.dataset.indexed_train.datasets.front().path, ck, [](const fs::path& p) {
    return fs::exists(p.string() + ".manifest.json") || (fs::is_regular_file(p) && fs::exists(p));
  });
  if (!manifest) return std::nullopt;
  const auto m = indexed::read_manifest(manifest->string());
  if (m.tokenizer_path.empty()) return std::nullopt;
  auto tok = find_from_run(m.tokenizer_path, ck, file);
  if (!tok && fs::exists(fs::path(m.path).parent_path() / m.tokenizer_path))
    tok = fs::path(m.path).parent_path() / m.tokenizer_path;
  if (!tok) return std::nullopt;
  const auto sha = tok::Tokenizer::load(tok->string()).sha256();
  if (sha != m.tokenizer_sha256)
    throw std::runtime_error("the tokenizer " + tok->string() + " is not the one " + m.path +
                             " was prepared with (sha256 " + sha.substr(0, 12) + "..., the manifest records " +
                             m.tokenizer_sha256.substr(0, 12) + "...); give --tokenizer");
  return tok->string();
}

// A Hugging Face folder: the registered model whose hf_config() has config.json's model_type.
ModelSource hf_folder(const std::string& dir) {
  const auto j = checkpoint::read_json_bounded((fs::path(dir) / "config.json").string());
  const std::string type = j.is_object() ? j.value("model_type", "") : "";
  std::string why;  // what each model said, if none takes it
  for (const auto& entry : models::registered_models()) {
    if (!entry.from_hf_config) continue;
    std::shared_ptr<const config::ModelConfig> cfg;
    try {
      cfg = entry.from_hf_config(j);
    } catch (const std::exception& e) {
      why += "; " + entry.name + ": " + std::string(e.what()).substr(0, 200);
      continue;  // not this model's config, or one it cannot represent
    }
    models::common::ShardingContext meta;
    meta.options = meta.options.device(c10::kMeta);
    auto model = entry.build_sharded(*cfg, meta);
    if (model->hf_config().value("model_type", "") != type) continue;
    load_hf_weights(*model, dir, c10::Device(c10::kCPU));
    ModelSource s{model, "Hugging Face folder " + dir + " (" + type + ")", std::nullopt};
    for (const char* f : {"tokenizer.json", "encoder.json", "tokenizer.model"})
      if (fs::exists(fs::path(dir) / f)) s.tokenizer = (fs::path(dir) / f).string();
    return s;
  }
  throw std::runtime_error((fs::path(dir) / "config.json").string() + ": no registered model reads model_type '" +
                           type + "'" + why);
}

// A LoRA run's checkpoint holds its adapters alone (the base is frozen, not
// saved): the model is merge --hf's, the base folder with W + scale x B A,
// written to a temporary folder and read back as a Hugging Face folder.
ModelSource lora_checkpoint(const std::string& src) {
  const checkpoint::Checkpoint ck(src);
  const auto tmp = fs::temp_directory_path() / ("nnstrain-lora-merged-" + std::to_string(::getpid()));
  struct Remove {
    fs::path p;
    ~Remove() {
      std::error_code ec;
      fs::remove_all(p, ec);
      fs::remove_all(p.string() + ".tmp", ec);  // where the merge writes before its rename
    }
  } remove{tmp};
  fs::remove_all(tmp);  // a folder a killed run left
  fs::remove_all(tmp.string() + ".tmp");
  lora::write_merged_hf(src, tmp.string(), "F32");  // the merge in fp32; --dtype casts later
  ModelSource s = hf_folder(tmp.string());
  s.what = "LoRA checkpoint " + src + " (" + ck.state().value("model_type", "") + ", step " +
           std::to_string(ck.state().value("step", int64_t{0})) + ", adapters merged into " +
           saved_args(ck).model.init_from + ")";
  s.tokenizer = dataset_tokenizer(ck);
  if (!s.tokenizer)
    for (const char* f : {"tokenizer.json", "encoder.json", "tokenizer.model"})
      if (fs::exists(fs::path(saved_args(ck).model.init_from) / f))
        s.tokenizer = (fs::path(saved_args(ck).model.init_from) / f).string();
  return s;
}

}  // namespace

ModelSource load_model_source(std::string src) {
  if (!fs::exists(src)) throw ModelSourceError(src + ": no such checkpoint or folder");
  if (!fs::exists(fs::path(src) / "manifest.json") && fs::exists(fs::path(src) / "latest")) {
    const auto l = checkpoint::latest(src);
    if (l.empty()) throw ModelSourceError(src + ": a save_dir without a complete checkpoint");
    src = l;
  }
  if (fs::exists(fs::path(src) / "manifest.json") && lora::is_lora_checkpoint(src)) return lora_checkpoint(src);
  if (fs::exists(fs::path(src) / "manifest.json")) {
    const checkpoint::Checkpoint ck(src);
    ModelSource s;
    s.model = build_model(ck);
    load_model_weights(ck, *s.model);  // whole tensors from the pieces of any plan
    s.what = "checkpoint " + src + " (" + ck.state().value("model_type", "") + ", step " +
             std::to_string(ck.state().value("step", int64_t{0})) + ")";
    s.tokenizer = dataset_tokenizer(ck);
    return s;
  }
  if (fs::exists(fs::path(src) / "config.json")) return hf_folder(src);
  throw ModelSourceError(src + ": neither a checkpoint (manifest.json), a run's save_dir (latest) nor a "
                           "Hugging Face folder (config.json)");
}

}  // namespace nnstrain::interop
