#include "trainer/checkpoint/async_save.h"

#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>

#ifdef NNSTRAIN_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nnstrain::checkpoint {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A test-only switch: NNSTRAIN_TEST_COPY_DELAY_CYCLES=N puts a GPU busy-wait of N
// clock cycles on the copy stream ahead of the device-to-host copies, so a writer
// that did not wait for them would write buffers not yet filled (the device tests
// compare such checkpoints with synchronous ones, bitwise).
int64_t test_copy_delay_cycles() {
  static const int64_t cycles = [] {
    const char* e = std::getenv("NNSTRAIN_TEST_COPY_DELAY_CYCLES");
    return e ? std::stoll(e) : int64_t{0};
  }();
  return cycles;
}

}  // namespace

struct Saver::Impl {
  SaveOptions opts;
  SaveContext ctx;
  SaveStore store;
  std::function<void(const SaveReport&)> on_published;
  // Asynchronous saves started by this saver: every rank starts the same ones in
  // the same order, so the count names a save in the store on every rank. The
  // step alone does not: after a rewind a step is saved again, and its keys of
  // the first save are still in the store.
  int64_t saves = 0;

  std::vector<at::Tensor> host;  // snapshot buffers, reused while shapes and dtypes stay
  std::vector<bool> host_pinned;
  std::thread worker;            // the save in flight, if joinable
  std::string error;             // its failure, set by the worker
  // CPU: the worker copies the state while training runs the next forward and
  // backward (they only read it); state_may_change() waits for that copy.
  std::mutex m;
  std::condition_variable cv;
  bool snapshot_done = true;
#ifdef NNSTRAIN_CUDA
  std::unique_ptr<at::cuda::CUDAEvent> copied;  // the device-to-host copies are done
  bool training_must_wait = false;              // state_may_change() still has to order the training stream
#endif

  // Copies every tensor into `host`; returns the pieces as the writer sees them.
  std::vector<StateTensor> snapshot(const std::vector<StateTensor>& tensors) {
    torch::NoGradGuard no_grad;
    if (host.size() != tensors.size()) {
      host.assign(tensors.size(), at::Tensor());
      host_pinned.assign(tensors.size(), false);
    }
    std::vector<StateTensor> out;
    out.reserve(tensors.size());
#ifdef NNSTRAIN_CUDA
    std::optional<c10::Device> cuda;
    for (const auto& t : tensors)
      if (t.tensor.is_cuda()) cuda = t.tensor.device();
    std::optional<c10::cuda::CUDAStreamGuard> on_side;
    if (cuda) {
      // The copies run on a side stream once the training stream has produced the state;
      // state_may_change() makes the training stream wait for them (on the device, not
      // the host) before the optimizer touches the state again.
      auto training = c10::cuda::getCurrentCUDAStream(cuda->index());
      auto side = c10::cuda::getStreamFromPool(false, cuda->index());
      at::cuda::CUDAEvent ready;
      ready.record(training);
      ready.block(side);
      on_side.emplace(side);
      if (test_copy_delay_cycles() > 0) at::cuda::sleep(test_copy_delay_cycles());
    }
#endif
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& src = tensors[i].tensor;
      auto& buf = host[i];
      // A buffer is pinned exactly when its source is a CUDA tensor (no is_pinned() query:
      // on a machine without a GPU that would consult the CUDA runtime).
      if (!buf.defined() || buf.sizes() != src.sizes() || buf.scalar_type() != src.scalar_type() ||
          host_pinned[i] != src.is_cuda()) {
        buf = torch::empty(src.sizes(), src.options().device(torch::kCPU).pinned_memory(src.is_cuda()));
        host_pinned[i] = src.is_cuda();
      }
      buf.copy_(src, /*non_blocking=*/src.is_cuda());
      out.push_back({tensors[i].spec, buf});
    }
#ifdef NNSTRAIN_CUDA
    if (cuda) {
      copied = std::make_unique<at::cuda::CUDAEvent>();
      copied->record(c10::cuda::getCurrentCUDAStream(cuda->index()));  // the side stream, under the guard
      training_must_wait = true;
    } else {
      copied.reset();
    }
#endif
    return out;
  }

  void set_snapshot_done() {
    {
      std::lock_guard<std::mutex> lock(m);
      snapshot_done = true;
    }
    cv.notify_all();
  }

  // The background half of one save: (CPU) the copy, then write, agree through the store, publish.
  // `pieces` are the live tensors when `copy_first`, else the snapshot already.
  void write_and_publish(int64_t step, int64_t save_index, std::vector<StateTensor> pieces, nlohmann::json state,
                         nlohmann::json rank_state, std::chrono::steady_clock::time_point t0, bool copy_first) {
    std::string copy_failure;
    if (copy_first) {
      try {
        pieces = snapshot(pieces);
      } catch (const std::exception& e) {
        copy_failure = e.what();
        pieces.clear();
      }
      set_snapshot_done();
    }
    const bool multi = ctx.world_size > 1;
    const std::string key = "nnstrain/checkpoint/" + std::to_string(save_index) + "/" + std::to_string(step) + "/";
    SaveReport report;
    report.step = step;
    try {
#ifdef NNSTRAIN_CUDA
      if (copied) copied->synchronize();
#endif
      // Rank 0 prepares the folder; the others start writing once it says so.
      std::string ready = "ok";
      if (ctx.rank == 0) {
        try {
          begin_save(opts, step);
        } catch (const std::exception& e) {
          ready = e.what();
        }
        if (multi) store.set(key + "ready", ready);
      } else {
        ready = store.get(key + "ready");
      }
      if (ready != "ok") throw CheckpointError("checkpoint of step " + std::to_string(step) + " not started: " + ready);

      std::string status = "ok";
      const auto tw = std::chrono::steady_clock::now();
      try {
        if (!copy_failure.empty()) throw std::runtime_error("copying the state to host memory failed: " + copy_failure);
        report.bytes = write_rank_files(opts, ctx.rank, step, pieces, rank_state);
      } catch (const std::exception& e) {
        status = "rank " + std::to_string(ctx.rank) + " could not write its shard: " + e.what();
      }
      report.write_s = seconds_since(tw);
      pieces.clear();  // the buffers stay in `host`; nothing else holds them

      std::string outcome = status;
      if (ctx.rank == 0) {
        if (multi) {
          store.set(key + "rank0", status);
          for (int r = 1; r < ctx.world_size && outcome == "ok"; ++r) outcome = store.get(key + "rank" + std::to_string(r));
        }
        if (outcome == "ok") {
          try {
            report.dir = publish(opts, ctx.world_size, step, state);
          } catch (const std::exception& e) {
            outcome = std::string("publishing failed: ") + e.what();
          }
        }
        if (outcome != "ok") abandon_save(opts, step);
        if (multi) store.set(key + "done", outcome);
      } else {
        store.set(key + "rank" + std::to_string(ctx.rank), status);
        outcome = store.get(key + "done");
        report.dir = opts.save_dir + "/" + step_dir_name(step);
      }
      if (outcome != "ok")
        throw CheckpointError("checkpoint of step " + std::to_string(step) + " not published: " + outcome);
      report.total_s = seconds_since(t0);
      if (on_published) on_published(report);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }

  // Blocks until the snapshot no longer needs the live state.
  void release_state() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return snapshot_done; });
#ifdef NNSTRAIN_CUDA
    if (training_must_wait && copied) {
      copied->block(c10::cuda::getCurrentCUDAStream(copied->device_index()));
      training_must_wait = false;
    }
#endif
  }

  // Joins the worker; returns its failure ("" if none) and clears it.
  std::string join() {
    if (worker.joinable()) worker.join();
    return std::exchange(error, std::string());
  }
};

Saver::Saver(SaveOptions opts, SaveContext ctx, bool async, SaveStore store,
             std::function<void(const SaveReport&)> on_published)
    : impl_(std::make_unique<Impl>()), async_(async) {
  impl_->opts = std::move(opts);
  impl_->ctx = std::move(ctx);
  impl_->store = std::move(store);
  impl_->on_published = std::move(on_published);
  if (async_ && impl_->ctx.world_size > 1 && (!impl_->store.set || !impl_->store.get))
    throw std::invalid_argument("an asynchronous save across ranks needs the store");
}

Saver::~Saver() {
  const std::string failure = impl_->join();
  if (!failure.empty()) std::cerr << "nnstrain: rank " << impl_->ctx.rank << ": error: " << failure << std::endl;
}

void Saver::state_may_change() { impl_->release_state(); }

void Saver::wait() {
  const std::string failure = impl_->join();
  if (!failure.empty()) throw CheckpointError(failure);
}

void Saver::save(int64_t step, const std::vector<StateTensor>& tensors, const nlohmann::json& state,
                 const nlohmann::json& rank_state) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!async_) {
    SaveReport report;
    report.step = step;
    report.dir = checkpoint::save(impl_->opts, impl_->ctx, step, tensors, state, rank_state);
    for (const auto& t : tensors)
      if (impl_->opts.save_type != "deduped" || t.spec.owner() == impl_->ctx.rank)
        report.bytes += static_cast<uint64_t>(t.tensor.numel()) * t.tensor.element_size();
    report.total_s = report.write_s = seconds_since(t0);
    if (impl_->on_published) impl_->on_published(report);
    return;
  }
  wait();  // at most one in flight: its buffers are the ones about to be overwritten
  std::vector<StateTensor> pieces = tensors;
  bool any_cuda = false;
  for (const auto& t : tensors) any_cuda = any_cuda || t.tensor.is_cuda();
  const bool copy_in_worker = !any_cuda;
  if (copy_in_worker) {
    std::lock_guard<std::mutex> lock(impl_->m);
    impl_->snapshot_done = false;  // until the worker has copied `pieces` (the live tensors)
  } else {
    pieces = impl_->snapshot(tensors);  // enqueues the copies on a side stream: the host does not wait
  }
  const int64_t index = impl_->saves++;
  impl_->worker = std::thread([this, step, index, pieces = std::move(pieces), state, rank_state, t0,
                               copy_in_worker]() mutable {
    impl_->write_and_publish(step, index, std::move(pieces), std::move(state), std::move(rank_state), t0, copy_in_worker);
  });
}

}  // namespace nnstrain::checkpoint
