#include "trainer/offload/nvme_tier.h"

#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "base/config/arg_map.h"

namespace nnstrain::parallel {

namespace {
at::Tensor over(const std::shared_ptr<void>& mem, int64_t n, c10::ScalarType dtype) {
  return at::from_blob(mem.get(), {n}, at::TensorOptions().dtype(dtype));
}
}  // namespace

NvmeTier::NvmeTier(const NvmeTierOptions& o, const std::vector<int64_t>& lens, c10::ScalarType wdtype,
                   c10::ScalarType pdtype)
    : o_(o), lens_(lens), wdtype_(wdtype), pdtype_(pdtype) {
  TORCH_CHECK(!lens_.empty(), "NvmeTier: no buckets");
  const int64_t wsize = c10::elementSize(wdtype), psize = c10::elementSize(pdtype);
  const int64_t longest = *std::max_element(lens_.begin(), lens_.end());
  // A slot: one bucket's weights and moments, and the compute-dtype stage.
  const int64_t per_slot = nvme_round_up(3 * longest * wsize) + nvme_round_up(longest * psize);
  const int64_t pbufs = o_.params ? 2 * nvme_round_up(longest * psize) : 0;
  const int64_t fits = (o_.buffer_bytes - pbufs) / per_slot;
  // Two slots at least: one bucket steps while the next is read.
  if (fits < 2 && lens_.size() > 1) {
    auto mib = [](double bytes) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3g", bytes / 1048576.0);
      return std::string(buf);
    };
    throw config::ConfigError("compute_config.offload.nvme_buffer_mb: " + mib(double(o_.buffer_bytes)) +
                              " MiB holds fewer than the two slots the nvme tier streams through (the largest bucket "
                              "needs " + std::to_string(per_slot) + " bytes a slot" +
                              (pbufs ? " plus " + std::to_string(pbufs) + " for parameter read-ahead" : "") +
                              "); give it at least " + mib(double(2 * per_slot + pbufs)) +
                              " MiB, or smaller buckets (reducer_bucket_cap_mb)");
  }
  const size_t k = std::min<size_t>(lens_.size(), static_cast<size_t>(std::max<int64_t>(1, fits)));
  for (size_t s = 0; s < k; ++s) {
    slot_mem_.push_back(nvme_buffer(3 * longest * wsize));
    slot_.push_back(over(slot_mem_.back(), 3 * longest, wdtype));
    stage_mem_.push_back(nvme_buffer(longest * psize));
    stage_.push_back(over(stage_mem_.back(), longest, pdtype));
  }
  slot_holds_.assign(k, -1);
  read_issued_.assign(lens_.size(), false);
  if (o_.params)
    for (int i = 0; i < 2; ++i) {
      pbuf_mem_[i] = nvme_buffer(longest * psize);
      pbuf_[i] = over(pbuf_mem_[i], longest, pdtype);
    }

  if (const char* e = std::getenv("NNSTRAIN_TEST_NVME_FAULT")) {
    char kind[16] = {0};
    long long step = 0;
    if (std::sscanf(e, "%lld:%15s", &step, kind) != 2 || (std::string(kind) != "stop" && std::string(kind) != "kill"))
      throw NvmeError(std::string("NNSTRAIN_TEST_NVME_FAULT='") + e + "': expected STEP:stop or STEP:kill");
    fault_step_ = step;
    fault_ = kind;
  }
  try {
    store_ = std::make_unique<NvmeStore>(o_.path, o_.rank, o_.io);
  } catch (const NvmeSetupError& e) {  // the folder or the engine the config names: exit 2, naming the key
    throw config::ConfigError("compute_config.offload." + e.key + ": " + e.what());
  }
  std::vector<int64_t> opt_bytes, param_bytes;
  for (auto n : lens_) {
    opt_bytes.push_back(3 * n * wsize);
    param_bytes.push_back(n * psize);
  }
  opt_file_ = store_->add_file("optimizer.bin", opt_bytes);
  if (o_.params) param_file_ = store_->add_file("params.bin", param_bytes);
  store_->allocate();
}

NvmeTier::~NvmeTier() { store_.reset(); }  // its I/O in flight lands in the slots: done before they are freed

at::Tensor NvmeTier::weights(size_t b) const { return slot_[slot_of(b)].narrow(0, 0, lens_[b]); }
at::Tensor NvmeTier::exp_avg(size_t b) const { return slot_[slot_of(b)].narrow(0, lens_[b], lens_[b]); }
at::Tensor NvmeTier::exp_avg_sq(size_t b) const { return slot_[slot_of(b)].narrow(0, 2 * lens_[b], lens_[b]); }
at::Tensor NvmeTier::stage(size_t b) const { return stage_[slot_of(b)].narrow(0, 0, lens_[b]); }

int64_t NvmeTier::slot_bytes() const {
  int64_t n = 0;
  for (const auto& t : slot_) n += t.nbytes();
  for (const auto& t : stage_) n += t.nbytes();
  for (const auto& t : pbuf_)
    if (t.defined()) n += t.nbytes();
  return n;
}

void NvmeTier::start_read(size_t b) {
  const size_t s = slot_of(b);
  const long prev = slot_holds_[s];
  if (prev >= 0 && prev != static_cast<long>(b)) {  // the slot's last bucket must be written back first
    store_->wait(opt_file_, prev);
    if (param_file_ >= 0) store_->wait(param_file_, prev);
  }
  slot_holds_[s] = static_cast<long>(b);
  store_->submit_read(opt_file_, b, slot_[s].data_ptr());
  read_issued_[b] = true;
}

void NvmeTier::fill(size_t b, const at::Tensor& init) {
  const size_t s = slot_of(b);
  if (slot_holds_[s] >= 0) {
    store_->wait(opt_file_, slot_holds_[s]);
  }
  slot_holds_[s] = static_cast<long>(b);
  weights(b).copy_(init);
  exp_avg(b).zero_();
  exp_avg_sq(b).zero_();
  store_->submit_write(opt_file_, b, slot_[s].data_ptr());
}

void NvmeTier::fill_param(size_t b, const at::Tensor& init) {
  if (b >= slot_.size()) store_->wait(param_file_, b - slot_.size());  // the stage is the earlier bucket's until written
  stage(b).copy_(init);
  store_->submit_write(param_file_, b, stage_[slot_of(b)].data_ptr());
}

void NvmeTier::acquire(size_t b, bool ahead) {
  if (fault_ == "stop" && b == 0 && steps_ + 1 == fault_step_) std::raise(SIGSTOP);
  if (fault_ == "kill" && b == 1 && steps_ == fault_step_) {
    store_->wait(opt_file_, 0);
    std::raise(SIGKILL);
  }
  if (pbuf_unit_[0] >= 0 || pbuf_unit_[1] >= 0) drop_read_ahead();
  if (!read_issued_[b]) start_read(b);
  if (ahead && b + 1 < lens_.size() && !read_issued_[b + 1]) start_read(b + 1);
  store_->wait(opt_file_, b);
}

void NvmeTier::release(size_t b, bool dirty, bool with_param) {
  read_issued_[b] = false;
  if (dirty && b == 0) ++steps_;
  if (dirty) store_->submit_write(opt_file_, b, slot_[slot_of(b)].data_ptr());
  if (with_param) store_->submit_write(param_file_, b, stage_[slot_of(b)].data_ptr());
}

void NvmeTier::finish() {
  store_->drain();
  std::fill(slot_holds_.begin(), slot_holds_.end(), -1);
  std::fill(read_issued_.begin(), read_issued_.end(), false);
}

at::Tensor NvmeTier::param_chunk(size_t b) {
  const long u = static_cast<long>(b);
  int c = pcur_;
  if (pbuf_unit_[c ^ 1] == u) {
    c ^= 1;  // read ahead: it is (or soon will be) there
  } else {
    if (pbuf_unit_[c] >= 0) store_->wait(param_file_, pbuf_unit_[c]);
    store_->submit_read(param_file_, b, pbuf_[c].data_ptr());
    pbuf_unit_[c] = u;
  }
  store_->wait(param_file_, b);
  pcur_ = c;
  // What followed these two units last time is read while this one is gathered.
  if (last_ >= 0) next_[{prev_, last_}] = u;
  prev_ = last_;
  last_ = u;
  const auto it = next_.find({prev_, last_});
  const int other = c ^ 1;
  if (it != next_.end() && it->second != u && pbuf_unit_[other] != it->second) {
    if (pbuf_unit_[other] >= 0) store_->wait(param_file_, pbuf_unit_[other]);
    store_->submit_read(param_file_, it->second, pbuf_[other].data_ptr());
    pbuf_unit_[other] = it->second;
  }
  return pbuf_[c].narrow(0, 0, lens_[b]);
}

void NvmeTier::drop_read_ahead() {
  for (int i = 0; i < 2; ++i) {
    if (pbuf_unit_[i] >= 0) store_->wait(param_file_, pbuf_unit_[i]);
    pbuf_unit_[i] = -1;
  }
}

void NvmeTier::map_for_checkpoint() {
  drop_read_ahead();
  finish();
  store_->verify_all(slot_[0].data_ptr());
  store_->map(opt_file_);
}

at::Tensor NvmeTier::file_view(size_t b, int part) {
  auto* base = static_cast<char*>(store_->map(opt_file_)) + store_->chunk_offset(opt_file_, b);
  const int64_t n = lens_[b];
  return at::from_blob(base + part * n * static_cast<int64_t>(c10::elementSize(wdtype_)), {n},
                       at::TensorOptions().dtype(wdtype_));
}

void NvmeTier::after_checkpoint_load() {
  for (size_t b = 0; b < lens_.size(); ++b) store_->rehash(opt_file_, b);
  store_->unmap();  // the load's views are gone; the steps read the files directly
}

NvmeCounters NvmeTier::take_counters() {
  const auto now = store_->counters();
  NvmeCounters d{now.bytes_read - taken_.bytes_read, now.bytes_written - taken_.bytes_written, now.reads - taken_.reads,
                 now.writes - taken_.writes};
  taken_ = now;
  return d;
}

}  // namespace nnstrain::parallel
