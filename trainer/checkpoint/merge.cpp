#include "trainer/checkpoint/merge.h"

#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>

#include <ftw.h>
#include <unistd.h>

#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"
#include "trainer/config/load.h"

namespace fs = std::filesystem;

namespace nnstrain::checkpoint {

namespace {

constexpr const char* kUsage = R"(usage: nnstrain merge CKPT --out DIR [--hf] [--dtype fp32|bf16|fp16]

  CKPT   a checkpoint folder (sharded, deduped or merged), or a save_dir (its `latest` is used)
  --out  the folder to create; written as DIR.tmp, then renamed
  --hf   Hugging Face names and config.json: transformers' from_pretrained(DIR) loads it
  --dtype  the weights' dtype in the output (default: as stored; *-mixed runs store fp32 masters)
)";

// POSIX rather than fs::remove_all: libtorch.so exports its own copy of it, which
// crashes when it wins symbol resolution (pytorch#133437).
int remove_entry(const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }
void remove_tree(const fs::path& p) {
  if (::access(p.c_str(), F_OK) == 0) ::nftw(p.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

at::ScalarType scalar_type_of(const ShardSpec& s) {
  const auto d = parse_dtype(s.dtype);
  if (!d) throw CheckpointError("'" + s.name + "' has unknown dtype '" + s.dtype + "'");
  return to_scalar_type(*d);
}

std::string hf_dtype_name(const std::string& st) {
  if (st == "F32") return "float32";
  if (st == "BF16") return "bfloat16";
  if (st == "F16") return "float16";
  return "";
}

// One tensor of the merged checkpoint and where it goes.
struct Planned {
  ShardSpec spec;  // the whole global tensor
  std::string key;  // its name inside the file
  bool transposed = false;
};

}  // namespace

std::shared_ptr<models::CausalLM> build_model(const Checkpoint& ck) {
  const auto& st = ck.state();
  const std::string where = (fs::path(ck.dir()) / "manifest.json").string();
  const std::string type = st.value("model_type", "");
  const std::string yaml = st.value("config", "");
  const auto* entry = models::find_model(type);
  if (!entry) throw CheckpointError(where + ": unknown model type '" + type + "' in the trainer state");
  if (yaml.empty()) throw CheckpointError(where + ": the trainer state holds no resolved config to rebuild the model");

  // load_trainer_args reads files; the saved config goes through a temporary one.
  const char* tmpdir = std::getenv("TMPDIR");
  std::string path = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/nnstrain_config_XXXXXX.yaml";
  const int fd = ::mkstemps(path.data(), 5);
  if (fd < 0) throw CheckpointError("cannot create a temporary file for the saved config: " + std::string(std::strerror(errno)));
  const bool written = ::write(fd, yaml.data(), yaml.size()) == static_cast<ssize_t>(yaml.size());
  ::close(fd);
  config::TrainerArgs args;
  try {
    if (!written) throw config::ConfigError("cannot write " + path);
    config::LoadOptions lo;
    lo.models = models::model_catalog();
    lo.check_files = false;            // the run's data need not be here
    lo.reject_unimplemented = false;   // only the model section matters
    args = config::load_trainer_args(path, lo);
  } catch (const config::ConfigError& e) {
    ::unlink(path.c_str());
    throw CheckpointError(where + ": the saved config does not load: " + e.what());
  }
  ::unlink(path.c_str());
  if (args.model.type != type || !args.model.args)
    throw CheckpointError(where + ": the saved config's model '" + args.model.type + "' is not the state's '" + type + "'");
  return entry->build(*args.model.args);
}

void load_model_weights(const Checkpoint& ck, models::CausalLM& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.named_parameters()) {
    auto t = p.value().detach();
    StateTensor st{ShardSpec::full("model/" + p.key(), dtype_name(to_dtype(t.scalar_type())), t.sizes().vec()), t};
    ck.load_into(st);
  }
}

MergeReport merge(const std::string& ckpt_dir, const std::string& out_dir, const MergeOptions& opts) {
  const Checkpoint ck(ckpt_dir);
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "DIR/"
  if (out.empty()) throw CheckpointError("merge: --out is empty");
  if (fs::exists(out)) throw CheckpointError(out.string() + ": already exists; merge writes a new folder");
  const fs::path tmp = out.string() + ".tmp";

  // Hugging Face names need the model's declaration; build it, take what we need, free it.
  std::map<std::string, models::HfTensor> hf;  // by our parameter name
  nlohmann::json hf_config;
  if (opts.hf) {
    auto model = build_model(ck);
    for (const auto& h : model->hf_tensors()) hf[h.ours] = h;
    hf_config = model->hf_config();
    if (hf.empty()) throw CheckpointError("merge --hf: model '" + ck.state().value("model_type", "") +
                                          "' declares no Hugging Face names");
  }

  // Plan every output file before writing a byte: names, shapes, coverage.
  std::map<std::string, std::vector<Planned>> files;  // file -> tensors in write order
  std::string model_dtype;
  for (const auto& name : ck.names()) {
    const auto pieces = ck.pieces(name);
    std::vector<ShardSpec> specs;
    for (const auto& [s, f] : pieces) specs.push_back(s);
    Planned p{ShardSpec::full(name, specs.front().dtype, specs.front().global_shape), name, false};
    p.spec.replica_ranks = {0};
    if (covered(specs, p.spec) != p.spec.numel())
      throw CheckpointError(ck.dir() + ": the stored pieces of '" + name + "' do not cover the whole tensor " +
                            nlohmann::json(p.spec.global_shape).dump() + ": is a shard file's entry missing?");
    (void)scalar_type_of(p.spec);
    std::string file = "state.safetensors";
    if (name.rfind("model/", 0) == 0) {
      file = "model.safetensors";
      p.key = name.substr(6);
      if (!opts.dtype.empty() && p.spec.dtype != opts.dtype) {
        if (!hf_dtype_name(p.spec.dtype).size())
          throw CheckpointError("merge --dtype: '" + name + "' is stored as " + p.spec.dtype + ", not a float type");
        p.spec.dtype = opts.dtype;  // load_into converts
      }
      model_dtype = model_dtype.empty() || model_dtype == p.spec.dtype ? p.spec.dtype : "mixed";
      if (opts.hf) {
        auto it = hf.find(p.key);
        if (it == hf.end())
          throw CheckpointError("merge --hf: model tensor '" + p.key + "' has no Hugging Face name");
        p.transposed = it->second.transpose;
        if (p.transposed && p.spec.global_shape.size() != 2)
          throw CheckpointError("merge --hf: '" + p.key + "' is marked transposed but is not 2-d");
        p.key = it->second.theirs;
        hf.erase(it);
      }
    } else if (name.rfind("optim/", 0) == 0) {
      file = "optimizer.safetensors";
      p.key = name.substr(6);
    }
    files[file].push_back(std::move(p));
  }
  if (opts.hf && !hf.empty())
    throw CheckpointError("merge --hf: '" + hf.begin()->first + "' (Hugging Face '" + hf.begin()->second.theirs +
                          "') is not in the checkpoint " + ck.dir());

  MergeReport report;
  report.out_dir = out.string();
  remove_tree(tmp);  // leftovers of a crashed merge
  try {
    fs::create_directories(tmp);
    const auto& state = ck.state();
    if (state.contains("config") && state.at("config").is_string())
      write_file_durable((tmp / "config.yaml").string(), state.at("config").get<std::string>());
    write_file_durable((tmp / "trainer_state.json").string(), state.dump(2) + "\n");
    if (opts.hf) {
      const auto hf_dtype = hf_dtype_name(model_dtype);
      if (!hf_dtype.empty() && hf_config.contains("torch_dtype")) hf_config["torch_dtype"] = hf_dtype;
      write_file_durable((tmp / "config.json").string(), hf_config.dump(2) + "\n");
    }

    nlohmann::json manifest_files = nlohmann::json::object();
    for (const auto& [file, planned] : files) {
      // "pt" is what transformers requires of a model file; it is a plain state dict.
      SafetensorsWriter w((tmp / file).string(),
                          {{"format", file == "model.safetensors" ? "pt" : "nnstrain-checkpoint"}});
      auto& entries = manifest_files[file] = nlohmann::json::array();
      for (const auto& p : planned) {
        auto shape = p.spec.global_shape;
        if (p.transposed) std::swap(shape[0], shape[1]);
        w.declare(p.key, *parse_dtype(p.spec.dtype), shape);
        nlohmann::json j = p.spec;
        if (p.key != p.spec.name) j["key"] = p.key;
        if (p.transposed) j["transposed"] = true;
        entries.push_back(j);
      }
      // One global tensor in memory at a time.
      for (const auto& p : planned) {
        StateTensor st{p.spec, torch::empty(p.spec.global_shape, torch::TensorOptions().dtype(scalar_type_of(p.spec)))};
        ck.load_into(st);
        auto t = p.transposed ? st.tensor.t().contiguous() : st.tensor;
        st.tensor = at::Tensor();
        const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
        if (nbytes > 0) w.append(t.data_ptr(), static_cast<size_t>(nbytes));
        report.tensors += 1;
        report.bytes += nbytes;
        report.largest_bytes = std::max(report.largest_bytes, nbytes);
      }
      w.finish();
    }

    auto src = ck.manifest();
    nlohmann::json manifest = {{"format", src.at("format")},
                               {"version", src.at("version")},
                               {"step", src.value("step", state.value("step", int64_t{0}))},
                               {"world_size", 1},
                               {"save_type", "merged"},
                               {"merged_from", {{"dir", fs::absolute(ck.dir()).lexically_normal().string()},
                                                {"world_size", src.value("world_size", 0)},
                                                {"save_type", src.value("save_type", "")}}},
                               {"files", manifest_files},
                               {"rank_states", src.at("rank_states")},
                               {"state", state}};
    write_file_durable((tmp / "manifest.json").string(), manifest.dump(1));  // last, as in save()
    fsync_dir(tmp.string());
    fs::rename(tmp, out);
    fsync_dir(fs::absolute(out).parent_path().string());
  } catch (...) {
    remove_tree(tmp);
    throw;
  }
  return report;
}

int merge_main(const std::vector<std::string>& args) {
  std::string src, out;
  MergeOptions opts;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (a == "--hf") {
      opts.hf = true;
    } else if (a == "--dtype" || a.rfind("--dtype=", 0) == 0) {
      std::string d = a == "--dtype" ? (i + 1 < args.size() ? args[++i] : "") : a.substr(8);
      const std::map<std::string, std::string> names = {{"fp32", "F32"}, {"bf16", "BF16"}, {"fp16", "F16"}};
      if (!names.count(d)) {
        std::cerr << "nnstrain merge: --dtype must be fp32, bf16 or fp16, not '" << d << "'\n";
        return 2;
      }
      opts.dtype = names.at(d);
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
      const auto l = latest(src);
      std::cout << "nnstrain merge: " << src << " is a save_dir; merging its latest checkpoint " << l << "\n";
      src = l;
    }
    const auto r = merge(src, out, opts);
    std::cout << "nnstrain merge: wrote " << r.out_dir << " (" << r.tensors << " tensors, "
              << r.bytes / 1048576.0 << " MiB; largest tensor " << r.largest_bytes / 1048576.0 << " MiB)"
              << (opts.hf ? " with Hugging Face names and config.json" : "") << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "nnstrain merge: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace nnstrain::checkpoint
