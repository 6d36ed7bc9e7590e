// The training state's NVMe tier (compute_config.offload: nvme): what the
// host tier keeps in host memory for the offloaded buckets (weights, AdamW's
// moments; under ZeRO-3 params: nvme the compute-dtype parameter chunks) lives
// in files (nvme_store.h), one chunk per bucket, and passes through a ring of
// host slots bounded by offload.nvme_buffer_mb.
//
// The optimizer segments of bucket b view slot b % slots() permanently, so the
// host step's code is the host tier's. Around each bucket's step the state
// calls acquire(b) (waits for b's read, which was issued while the previous
// bucket stepped, and issues the read of b + 1 once the slot it lands in has
// been written back) and release(b) (issues b's write-back, which overlaps the
// next bucket's read and step). ZeRO-3 parameter chunks are read ahead of their
// all-gather: the unit that followed the same two units last time is read
// while the current one is gathered.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/offload/nvme_store.h"

namespace nnstrain::parallel {

struct NvmeTierOptions {
  std::string path, io = "auto";
  int rank = 0;
  int64_t buffer_bytes = 256 << 20;
  bool params = false;  // ZeRO-3 parameter chunks in files too
};

class NvmeTier {
 public:
  // lens: each offloaded bucket's elements (the optimizer's coordinates);
  // wdtype: the weights' and moments' dtype; pdtype: the compute dtype.
  NvmeTier(const NvmeTierOptions& o, const std::vector<int64_t>& lens, c10::ScalarType wdtype, c10::ScalarType pdtype);
  ~NvmeTier();

  size_t slots() const { return slot_.size(); }
  // Bucket b's views in its slot (valid between acquire and release).
  at::Tensor weights(size_t b) const;
  at::Tensor exp_avg(size_t b) const;
  at::Tensor exp_avg_sq(size_t b) const;
  at::Tensor stage(size_t b) const;  // the compute-dtype copy that leaves for the device (or the param file)

  // Start: bucket b's initial weights (moments zero) into its file.
  void fill(size_t b, const at::Tensor& init);
  void fill_param(size_t b, const at::Tensor& init);  // ZeRO-3 params: the unit's initial chunk
  // b's state in its slot; reads b + 1 ahead (when `ahead`).
  void acquire(size_t b, bool ahead = true);
  // b's state back to its file (dirty), or just the slot freed; with_param: stage(b) to the param file too.
  void release(size_t b, bool dirty, bool with_param = false);
  void finish();  // every write-back done (end of a step)

  // ZeRO-3 params: unit (bucket) b's compute-dtype chunk, read from its file
  // (read ahead where predicted); valid until the next call.
  at::Tensor param_chunk(size_t b);
  // The next step rewrites every chunk: nothing read ahead survives it.
  void drop_read_ahead();

  // Checkpoints: every chunk's checksum verified, then the files mapped;
  // views of bucket b's part (0 weights, 1 exp_avg, 2 exp_avg_sq) of the file.
  void map_for_checkpoint();
  at::Tensor file_view(size_t b, int part);
  // After a checkpoint load wrote through the views: new checksums.
  void after_checkpoint_load();
  void unmap_after_checkpoint() { store_->unmap(); }
  int64_t file_bytes() const { return store_->file_bytes(); }

  NvmeStore& store() { return *store_; }
  // Bytes read and written since the last call (a step's I/O).
  NvmeCounters take_counters();
  int64_t slot_bytes() const;  // host bytes the ring holds

 private:
  size_t slot_of(size_t b) const { return b % slot_.size(); }
  void start_read(size_t b);
  NvmeTierOptions o_;
  std::unique_ptr<NvmeStore> store_;
  std::vector<int64_t> lens_;
  c10::ScalarType wdtype_, pdtype_;
  int opt_file_ = -1, param_file_ = -1;
  std::vector<std::shared_ptr<void>> slot_mem_, stage_mem_;
  std::vector<at::Tensor> slot_, stage_;
  std::vector<long> slot_holds_;  // the bucket a slot's read or write is for (-1: none)
  std::vector<bool> read_issued_;
  // ZeRO-3 parameter read-ahead: two buffers, the unit each holds (or reads), and the order seen.
  std::shared_ptr<void> pbuf_mem_[2];
  at::Tensor pbuf_[2];
  long pbuf_unit_[2] = {-1, -1};
  int pcur_ = 0;
  long prev_ = -1, last_ = -1;
  std::map<std::pair<long, long>, long> next_;
  NvmeCounters taken_;
  // Fault injection for the tests (NNSTRAIN_TEST_NVME_FAULT=STEP:stop|kill):
  // at that optimizer step, SIGSTOP before the first chunk is read, or
  // SIGKILL once the first bucket is written back (mid-step by construction).
  int64_t steps_ = 0, fault_step_ = -1;
  std::string fault_;
};

}  // namespace nnstrain::parallel
