// The progress board: how `nnstrain launch --max-restarts` learns the step each
// of its workers was running when one failed, with no file and no syscall per
// step. The launcher maps a small shared memory file (one int64 per local
// worker), passes it to each worker as descriptor kProgressFd (named by
// NNSTRAIN_PROGRESS_FD), and reads a failed worker's slot after it ended.
// A worker not started by such a launcher publishes nowhere. No LibTorch here.
#pragma once

#include <cstdint>

namespace nnstrain::dist {

constexpr const char* kProgressFdVar = "NNSTRAIN_PROGRESS_FD";
constexpr int kProgressFd = 4;

// In a worker: records that step `step` (1-based; 0: before training) is running
// (the slot of LOCAL_RANK). Cheap: one store into shared memory.
void publish_step(int64_t step);

// Whether `fd` is a launcher's board (a memfd of that name, sealed against
// resizing): what a worker checks before it maps descriptor kProgressFd.
bool is_progress_board(int fd);

// In the launcher: the board for `slots` workers.
class ProgressBoard {
 public:
  explicit ProgressBoard(int slots);
  ~ProgressBoard();
  ProgressBoard(const ProgressBoard&) = delete;
  ProgressBoard& operator=(const ProgressBoard&) = delete;
  int fd() const { return fd_; }  // close-on-exec; the worker gets a copy at kProgressFd
  void clear();
  int64_t step(int slot) const;

 private:
  int fd_ = -1;
  int slots_ = 0;
  volatile int64_t* map_ = nullptr;
};

}  // namespace nnstrain::dist
