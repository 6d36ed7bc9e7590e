#include "trainer/checkpoint/merge.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"

namespace fs = std::filesystem;

namespace nnstrain::checkpoint {

namespace {

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
  ShardSpec spec;  // the whole global tensor (one expert's slice [e, ...] under expert)
  std::string key;  // its name inside the file
  bool transposed = false;
  bool expert = false;  // written without the leading (expert) dimension
  // Parts of one fused tensor (HfName::fused_offset), written one after the
  // other: the first declares the whole (fused_rows), the rest only append.
  int64_t fused_offset = -1, fused_rows = 0;
  bool continues = false;
};

}  // namespace

MergeReport merge(const std::string& ckpt_dir, const std::string& out_dir, const MergeOptions& opts) {
  const Checkpoint ck(ckpt_dir);
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "DIR/"
  if (out.empty()) throw CheckpointError("merge: --out is empty");
  if (fs::exists(out)) throw CheckpointError(out.string() + ": already exists; merge writes a new folder");
  const fs::path tmp = out.string() + ".tmp";

  // Hugging Face names, by our parameter name: each must be used exactly once.
  std::map<std::string, HfName> hf;
  if (opts.hf) {
    hf = opts.hf->names;
    if (hf.empty()) throw CheckpointError("merge --hf: model '" + ck.state().value("model_type", "") +
                                          "' declares no Hugging Face names");
  }

  // Plan every output file before writing a byte: names, shapes, coverage.
  std::map<std::string, std::vector<Planned>> files;  // file -> tensors in write order
  std::map<std::string, std::map<int64_t, Planned>> fused;  // their name -> our parts by first row
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
        if (!it->second.experts.empty()) {  // one tensor per expert, each its slice of the stack
          const auto& names = it->second.experts;
          if (static_cast<int64_t>(names.size()) != p.spec.global_shape.at(0))
            throw CheckpointError("merge --hf: '" + p.key + "' stacks " + std::to_string(p.spec.global_shape.at(0)) +
                                  " experts but the model names " + std::to_string(names.size()));
          for (size_t e = 0; e < names.size(); ++e) {
            if (names[e].empty()) throw CheckpointError("merge --hf: expert " + std::to_string(e) + " of '" + p.key + "' has no Hugging Face name");
            Planned q = p;
            q.spec.offsets[0] = static_cast<int64_t>(e);
            q.spec.shape[0] = 1;
            q.key = names[e];
            q.expert = true;
            files[file].push_back(std::move(q));
          }
          hf.erase(it);
          continue;
        }
        p.transposed = it->second.transpose;
        if (p.transposed && p.spec.global_shape.size() != 2)
          throw CheckpointError("merge --hf: '" + p.key + "' is marked transposed but is not 2-d");
        p.key = it->second.theirs;
        p.fused_offset = it->second.fused_offset;
        hf.erase(it);
        if (p.fused_offset >= 0) {
          if (p.transposed || p.spec.global_shape.empty())
            throw CheckpointError("merge --hf: '" + p.spec.name + "' is fused into '" + p.key + "' but not by rows");
          if (!fused[p.key].emplace(p.fused_offset, p).second)
            throw CheckpointError("merge --hf: two tensors start at row " + std::to_string(p.fused_offset) + " of '" +
                                  p.key + "'");
          continue;
        }
      }
    } else if (opts.hf && hf.count(name)) {  // state the Hugging Face layout keeps beside the weights
      file = "model.safetensors";
      p.key = hf.at(name).theirs;
      hf.erase(name);
    } else if (name.rfind("optim/", 0) == 0) {
      file = "optimizer.safetensors";
      p.key = name.substr(6);
    }
    files[file].push_back(std::move(p));
  }
  // Each fused tensor: its parts cover its rows in order, agreeing on the other dimensions and dtype.
  for (auto& [theirs, parts] : fused) {
    int64_t rows = 0;
    const auto& first = parts.begin()->second;
    for (const auto& [offset, part] : parts) {
      const auto& s = part.spec.global_shape;
      if (offset != rows || s.size() != first.spec.global_shape.size() ||
          !std::equal(s.begin() + 1, s.end(), first.spec.global_shape.begin() + 1) || part.spec.dtype != first.spec.dtype)
        throw CheckpointError("merge --hf: '" + part.spec.name + "' does not continue '" + theirs + "' at row " +
                              std::to_string(rows) + " (same width and dtype)");
      rows += s[0];
    }
    bool head = true;
    for (auto& [offset, part] : parts) {
      part.fused_rows = rows;
      part.continues = !head;
      head = false;
      files["model.safetensors"].push_back(std::move(part));
    }
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
      auto hf_config = opts.hf->config;
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
        auto shape = p.expert ? std::vector<int64_t>(p.spec.shape.begin() + 1, p.spec.shape.end()) : p.spec.global_shape;
        if (p.transposed) std::swap(shape[0], shape[1]);
        if (p.fused_offset >= 0) shape[0] = p.fused_rows;
        if (!p.continues) w.declare(p.key, *parse_dtype(p.spec.dtype), shape);
        nlohmann::json j = p.spec;
        if (p.key != p.spec.name) j["key"] = p.key;
        if (p.transposed) j["transposed"] = true;
        if (p.fused_offset >= 0)  // where its elements start in the fused tensor (resume reads them there)
          j["key_offset"] = p.fused_offset * (p.spec.numel() / std::max<int64_t>(p.spec.global_shape[0], 1));
        entries.push_back(j);
      }
      // One global tensor in memory at a time.
      for (const auto& p : planned) {
        StateTensor st{p.spec, torch::empty(p.spec.shape, torch::TensorOptions().dtype(scalar_type_of(p.spec)))};
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
    try {
      remove_tree(tmp);
    } catch (const CheckpointError&) {
      // The first failure is the one to report; DIR.tmp is never mistaken for DIR.
    }
    throw;
  }
  return report;
}

}  // namespace nnstrain::checkpoint
