#include "trainer/checkpoint/checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <unistd.h>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/tensor_io.h"

namespace fs = std::filesystem;

namespace nnstrain::checkpoint {

namespace {

constexpr const char* kFormat = kCheckpointFormat;
constexpr int kVersion = kCheckpointVersion;

std::string rank_file(int rank, const char* ext) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.%s", rank, ext);
  return buf;
}

// NNSTRAIN_TEST_REMOVE_FAILS_AFTER=N: remove_tree fails after N entries (a kill
// in the middle of a deletion, for the tests of what such a kill leaves).
thread_local long g_removed = 0;  // entries the current remove_tree has removed
int remove_entry(const char* p, const struct stat*, int, struct FTW*) {
  if (const char* n = std::getenv("NNSTRAIN_TEST_REMOVE_FAILS_AFTER"); n && g_removed++ >= std::atol(n)) {
    errno = EIO;
    return -1;
  }
  return ::remove(p);
}

void discard(const fs::path& step_folder) { discard_step(step_folder.string()); }

// Drops the temporary folders of crashed or failed saves, then the oldest step folders.
void prune(const fs::path& save_dir, int keep_last, const fs::path& keep) {
  std::vector<fs::path> steps;
  for (const auto& e : fs::directory_iterator(save_dir)) {
    const auto name = e.path().filename().string();
    if (!e.is_directory()) continue;
    if (name.rfind(".tmp-step-", 0) == 0) remove_tree(e.path().string());
    if (name.rfind("step-", 0) == 0) steps.push_back(e.path());
  }
  if (keep_last <= 0) return;
  std::sort(steps.begin(), steps.end());  // zero-padded: lexical = numeric
  const int excess = static_cast<int>(steps.size()) - keep_last;
  for (int i = 0; i < excess; ++i)
    if (steps[i] != keep) discard(steps[i]);
}

}  // namespace

void remove_tree(const std::string& path) {
  g_removed = 0;
  if (::access(path.c_str(), F_OK) == 0 && ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
    throw CheckpointError("cannot remove " + path + ": " + std::strerror(errno));
}

void discard_step(const std::string& folder) {
  const fs::path step_folder(folder);
  const auto aside = step_folder.parent_path() / (".tmp-" + step_folder.filename().string() + ".old");
  remove_tree(aside.string());
  fs::rename(step_folder, aside);
  remove_tree(aside.string());
}

void write_file_durable(const std::string& path_str, const std::string& text) {
  const fs::path path(path_str);
  const auto tmp = path.string() + ".part";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError("cannot write " + tmp + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    auto n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      throw CheckpointError("cannot write " + tmp + ": " + std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw CheckpointError("cannot fsync " + tmp);
  fs::rename(tmp, path);
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

namespace {
fs::path tmp_dir(const SaveOptions& opts, int64_t step) { return fs::path(opts.save_dir) / (".tmp-" + step_dir_name(step)); }
}  // namespace

void begin_save(const SaveOptions& opts, int64_t step) {
  const fs::path tmp = tmp_dir(opts, step);
  fs::create_directories(opts.save_dir);
  remove_tree(tmp.string());  // leftovers of a crashed save
  fs::create_directories(tmp);
}

uint64_t write_rank_files(const SaveOptions& opts, int rank, int64_t step, const std::vector<StateTensor>& tensors,
                          const nlohmann::json& rank_state) {
  const fs::path tmp = tmp_dir(opts, step);
  nlohmann::json sidecar = {{"rank", rank}, {"tensors", nlohmann::json::array()}, {"state", rank_state}};
  std::vector<std::pair<std::string, at::Tensor>> out;
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    if (opts.save_type == "deduped" && t.spec.owner() != rank) continue;
    out.emplace_back(t.spec.name, t.tensor);
    sidecar["tensors"].push_back(t.spec);
    bytes += static_cast<uint64_t>(t.tensor.numel()) * t.tensor.element_size();
  }
  save_tensors((tmp / rank_file(rank, "safetensors")).string(), out, {{"format", kFormat}});
  write_file_durable((tmp / rank_file(rank, "json")).string(), sidecar.dump());
  return bytes;
}

void abandon_save(const SaveOptions& opts, int64_t step) { remove_tree(tmp_dir(opts, step).string()); }

std::string publish(const SaveOptions& opts, int world_size, int64_t step, const nlohmann::json& state) {
  const fs::path dir(opts.save_dir);
  const fs::path final_dir = dir / step_dir_name(step);
  const fs::path tmp = tmp_dir(opts, step);
  nlohmann::json files = nlohmann::json::object(), rank_states = nlohmann::json::object();
  for (int r = 0; r < world_size; ++r) {
    auto side = read_json_bounded((tmp / rank_file(r, "json")).string());
    files[rank_file(r, "safetensors")] = side.at("tensors");
    rank_states[std::to_string(r)] = side.at("state");
  }
  nlohmann::json manifest = {{"format", kFormat}, {"version", kVersion}, {"step", step},
                             {"world_size", world_size}, {"save_type", opts.save_type},
                             {"files", files}, {"rank_states", rank_states}, {"state", state}};
  write_file_durable((tmp / "manifest.json").string(), manifest.dump(1));  // last: its presence means complete
  fsync_dir(tmp.string());
  if (fs::exists(final_dir)) discard(final_dir);  // a stale one of the same step from an earlier run
  fs::rename(tmp, final_dir);
  fsync_dir(dir.string());
  write_file_durable((dir / "latest").string(), step_dir_name(step) + "\n");
  fsync_dir(dir.string());
  prune(dir, opts.keep_last, final_dir);
  return final_dir.string();
}

std::string save(const SaveOptions& opts, const SaveContext& ctx, int64_t step,
                 const std::vector<StateTensor>& tensors, const nlohmann::json& state,
                 const nlohmann::json& rank_state) {
  auto barrier = [&] { if (ctx.barrier) ctx.barrier(); };
  if (ctx.rank == 0) begin_save(opts, step);
  barrier();

  // Every rank writes what it holds (sharded) or what it owns among replicas (deduped).
  bool ok = true;
  std::string failure;
  try {
    write_rank_files(opts, ctx.rank, step, tensors, rank_state);
  } catch (const std::exception& e) {
    ok = false;
    failure = e.what();
  }
  const bool all_ok = ctx.all_ok ? ctx.all_ok(ok) : ok;
  if (!ok) throw CheckpointError("rank " + std::to_string(ctx.rank) + " could not write its shard: " + failure);
  if (!all_ok) {
    if (ctx.rank == 0) abandon_save(opts, step);  // every rank is past writing: all_ok is collective
    throw CheckpointError("checkpoint of step " + std::to_string(step) + " not published: another rank failed to write");
  }
  if (ctx.rank == 0) publish(opts, ctx.world_size, step, state);
  barrier();
  return (fs::path(opts.save_dir) / step_dir_name(step)).string();
}

void rewrite_state(const std::string& checkpoint_dir, const std::function<void(nlohmann::json& state)>& edit) {
  const auto path = (fs::path(checkpoint_dir) / "manifest.json").string();
  auto manifest = read_json_bounded(path);
  edit(manifest.at("state"));
  write_file_durable(path, manifest.dump(1));
  fsync_dir(checkpoint_dir);
}

std::string latest(const std::string& save_dir) {
  // The newest complete step folder. `latest` can lag behind it (a crash after a
  // folder is published but before the pointer moves), so it is not trusted for this.
  std::string best;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(save_dir, ec)) {
    const auto n = e.path().filename().string();
    if (n.size() == 13 && n.rfind("step-", 0) == 0 && std::all_of(n.begin() + 5, n.end(), ::isdigit) &&
        fs::exists(e.path() / "manifest.json") && n > best)
      best = n;
  }
  if (!best.empty()) return (fs::path(save_dir) / best).string();
  // None complete: the folder the pointer names, if any, so that loading it says what is wrong.
  std::ifstream in(fs::path(save_dir) / "latest");
  std::string name;
  if (!(in && (in >> name))) return "";
  check_plain_name(name, (fs::path(save_dir) / "latest").string() + ": checkpoint name");
  return (fs::path(save_dir) / name).string();
}

Checkpoint::Checkpoint(std::string dir) : dir_(std::move(dir)) {
  const fs::path m = fs::path(dir_) / "manifest.json";
  if (!fs::is_directory(dir_)) throw CheckpointError(dir_ + ": no such checkpoint folder");
  if (!fs::exists(m)) throw CheckpointError(dir_ + ": manifest.json missing: not a complete checkpoint");
  auto parsed = parse_manifest(read_file_bounded(m.string()), m.string());
  // Names are plain (parse_manifest); here, before any shard is opened, no link may leave the folder.
  for (const auto& file : parsed.files)
    if (!fs::exists(confined_path(dir_, file, m.string() + ": shard file")))
      throw CheckpointError(dir_ + ": shard file " + file + " listed in manifest.json is missing");
  manifest_ = std::move(parsed.json);
  index_ = std::move(parsed.index);
}

std::optional<nlohmann::json> Checkpoint::rank_state(int rank) const {
  const auto& rs = manifest_.at("rank_states");
  auto it = rs.find(std::to_string(rank));
  if (it == rs.end()) return std::nullopt;
  return *it;
}

bool Checkpoint::has(const std::string& name) const { return index_.count(name) > 0; }

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : index_) n.push_back(k);
  return n;
}

std::vector<std::pair<ShardSpec, std::string>> Checkpoint::pieces(const std::string& name) const {
  std::vector<std::pair<ShardSpec, std::string>> out;
  auto it = index_.find(name);
  if (it != index_.end())
    for (const auto& st : it->second) out.emplace_back(st.spec, st.file);
  return out;
}

void Checkpoint::load_into(StateTensor& want) const {
  const auto& ws = want.spec;
  auto it = index_.find(ws.name);
  if (it == index_.end()) throw CheckpointError(dir_ + ": no tensor '" + ws.name + "' in this checkpoint");
  const auto& stored = it->second;
  const auto& first = stored.front().spec;
  const std::string where = (fs::path(dir_) / stored.front().file).string();
  if (first.global_shape != ws.global_shape) {
    auto show = [](const std::vector<int64_t>& s) { return nlohmann::json(s).dump(); };
    throw CheckpointError(where + ": '" + ws.name + "' has shape " + show(first.global_shape) +
                          " in the checkpoint but " + show(ws.global_shape) + " in the model");
  }
  // Floating-point weights convert (a bf16-true checkpoint resumes under 32-true
  // and the reverse); anything else (RNG bytes, counters) must match exactly.
  const auto is_float = [](const std::string& d) { return d == "F32" || d == "BF16" || d == "F16" || d == "F64"; };
  if (first.dtype != ws.dtype && !(is_float(first.dtype) && is_float(ws.dtype)))
    throw CheckpointError(where + ": '" + ws.name + "' has dtype " + first.dtype + " in the checkpoint but " +
                          ws.dtype + " in the model");
  for (const auto& st : stored)
    if (st.spec.dtype != first.dtype)
      throw CheckpointError(where + ": the stored pieces of '" + ws.name + "' disagree on the dtype (" + first.dtype +
                            ", " + st.spec.dtype + ")");
  // Every stored piece checked against its file before any arithmetic trusts the
  // manifest's shapes (a row count is then bounded by the bytes really stored).
  std::vector<const SafetensorsReader*> readers;
  std::vector<const TensorInfo*> infos;
  std::vector<ShardSpec> specs;
  for (const auto& st : stored) {
    const auto path = (fs::path(dir_) / st.file).string();
    auto& reader = readers_[path];
    if (!reader) reader = std::make_shared<SafetensorsReader>(path);
    const auto* info = reader->find(st.key);
    if (!info)
      throw CheckpointError(path + ": tensor '" + st.key + "' listed in manifest.json is not in the file");
    auto expect_shape = st.spec.shape;
    if (st.transposed) std::reverse(expect_shape.begin(), expect_shape.end());
    const bool part_of_key = st.key_offset >= 0;  // a fused tensor's rows (merge --hf)
    if (dtype_name(info->dtype) != st.spec.dtype ||
        (part_of_key ? st.key_offset + st.spec.numel() > info->numel() : info->numel() != st.spec.numel()) ||
        (st.transposed && info->shape != expect_shape))
      throw CheckpointError(path + ": tensor '" + st.key + "' disagrees with its manifest entry (dtype " +
                            dtype_name(info->dtype) + ", shape " + nlohmann::json(info->shape).dump() +
                            "; manifest: " + st.spec.dtype + ", " + std::to_string(st.spec.numel()) + " elements" +
                            (st.transposed ? ", transposed " + nlohmann::json(expect_shape).dump() : "") + ")");
    readers.push_back(reader.get());
    infos.push_back(info);
    specs.push_back(st.spec);
  }
  if (covered(specs, ws) != ws.numel())
    throw CheckpointError(dir_ + ": the stored pieces of '" + ws.name + "' do not cover " + ws.describe());

  const auto stored_type = to_scalar_type(*parse_dtype(first.dtype));
  auto cpu = want.tensor.device().is_cpu() && want.tensor.is_contiguous() && want.tensor.scalar_type() == stored_type
                 ? want.tensor
                 : torch::empty({ws.numel()}, want.tensor.options().device(torch::kCPU).dtype(stored_type));
  auto* dst = static_cast<uint8_t*>(cpu.data_ptr());
  const size_t es = cpu.element_size();
  for (size_t i = 0; i < stored.size(); ++i) {
    const auto& st = stored[i];
    const auto copies = overlap(st.spec, ws);
    if (copies.empty()) continue;
    const auto* reader = readers[i];
    const auto* info = infos[i];
    const uint8_t* src = reader->data(*info) + (st.key_offset > 0 ? st.key_offset * es : 0);
    at::Tensor untransposed;  // the stored transpose turned back, for a transposed piece
    if (st.transposed) {
      untransposed = torch::from_blob(const_cast<uint8_t*>(src), info->shape,
                                      cpu.options().dtype(to_scalar_type(info->dtype)))
                         .t()
                         .contiguous();
      src = static_cast<const uint8_t*>(untransposed.data_ptr());
    }
    for (const auto& c : copies) std::memcpy(dst + c.dst * es, src + c.src * es, c.length * es);
    // The bytes are copied: drop the mapped pages from this process (they stay in the
    // page cache), so loading or merging a large checkpoint does not grow the RSS by it.
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto lo = reinterpret_cast<uintptr_t>(reader->data(*info)) & ~(page - 1);
    const auto hi = reinterpret_cast<uintptr_t>(reader->data(*info)) + info->nbytes();
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  }
  if (!cpu.is_same(want.tensor)) want.tensor.view({-1}).copy_(cpu.view({-1}));
}

}  // namespace nnstrain::checkpoint
