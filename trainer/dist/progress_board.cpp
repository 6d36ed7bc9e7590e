#include "trainer/dist/progress_board.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace nnstrain::dist {

namespace {

// The worker's slot in the launcher's board, mapped on first use (null: none).
std::atomic<int64_t>* worker_slot() {
  static std::atomic<int64_t>* slot = []() -> std::atomic<int64_t>* {
    const char* fd_text = std::getenv(kProgressFdVar);
    const char* local = std::getenv("LOCAL_RANK");
    if (!fd_text || !local) return nullptr;
    const int fd = std::atoi(fd_text), index = std::atoi(local);
    const off_t size = lseek(fd, 0, SEEK_END);
    if (size < static_cast<off_t>((index + 1) * sizeof(int64_t))) return nullptr;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);  // the mapping stays
    if (p == MAP_FAILED) return nullptr;
    return reinterpret_cast<std::atomic<int64_t>*>(p) + index;
  }();
  return slot;
}

}  // namespace

void publish_step(int64_t step) {
  if (auto* s = worker_slot()) s->store(step, std::memory_order_relaxed);
}

ProgressBoard::ProgressBoard(int slots) : slots_(slots) {
  fd_ = memfd_create("nnstrain-progress", MFD_CLOEXEC);
  const size_t bytes = sizeof(int64_t) * static_cast<size_t>(slots);
  if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
    throw std::runtime_error(std::string("progress board: ") + std::strerror(errno));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) throw std::runtime_error(std::string("progress board: mmap: ") + std::strerror(errno));
  map_ = static_cast<volatile int64_t*>(p);
  clear();
}

ProgressBoard::~ProgressBoard() {
  if (map_) munmap(const_cast<int64_t*>(map_), sizeof(int64_t) * static_cast<size_t>(slots_));
  if (fd_ >= 0) close(fd_);
}

void ProgressBoard::clear() {
  for (int i = 0; i < slots_; ++i) map_[i] = 0;
}

int64_t ProgressBoard::step(int slot) const { return slot >= 0 && slot < slots_ ? map_[slot] : 0; }

}  // namespace nnstrain::dist
